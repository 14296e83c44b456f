"""The llama layout from a Hugging Face checkpoint (config.json and model.safetensors, the names
model.layers.N.self_attn.q_proj, ..., mlp.gate_proj, ...): small randomly initialised
LlamaForCausalLM models built by transformers from a config (grouped kv heads, rotary with the
default, linear, llama3 and dynamic scalings, tied and untied unembedding, a gelu-gated
feed-forward block), a MistralForCausalLM (its
sliding window, narrower than the prompts) and a Qwen2ForCausalLM (biases on q, k and v, which
emflow runs as a factored layer in d + 1 dimensions), converted by `emflow convert` and
run by `emflow flow --model --logits` on a right-padded batch, equal the framework's hidden
states and last-token logits layer by layer; and the same from GGUF files written as llama.cpp's
converter writes them (a qwen2 model; a llama model with llama3's per-frequency factors).
"""
import json

import numpy as np
import pytest
from emflow_cli import relative_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from llama_reference import float64_reference, token_error  # noqa: E402 (needs torch)

LAYERS, VOCAB = 3, 101
CASES = {
    "tied": dict(tie_word_embeddings=True, rope={"rope_type": "default", "rope_theta": 5000.0}),
    "untied-linear": dict(tie_word_embeddings=False,
                          rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    # llama3's scaling: frequencies of wavelength above 16 / low_freq_factor divided by the
    # factor, below 16 / high_freq_factor kept, the band between blended (head dim 16, so both
    # ends and the band have frequencies).
    "llama3": dict(tie_word_embeddings=True,
                   rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0}),
    # dynamic NTK: up to max_position_embeddings the frequencies are the default ones, as
    # transformers computes them for these prompts.
    "dynamic": dict(tie_word_embeddings=False,
                    rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "mistral-window": dict(kind="mistral", tie_word_embeddings=False, sliding_window=4,
                           rope={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2-biases": dict(kind="qwen2", tie_word_embeddings=True,
                         rope={"rope_type": "default", "rope_theta": 1000000.0}),
    # A gelu-gated feed-forward block (GeGLU): LlamaMLP applies the config's hidden_act to the
    # gate, here gelu with tanh.
    "gelu-gated": dict(tie_word_embeddings=False, hidden_act="gelu_pytorch_tanh",
                       rope={"rope_type": "default", "rope_theta": 10000.0}),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def make_model(case, folder):
    torch.manual_seed(11)
    settings = CASES[case]
    kind = settings.get("kind", "llama")
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[kind])
    extra = {key: settings[key] for key in ("sliding_window", "hidden_act") if key in settings}
    config = config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=64, initializer_range=0.2,
        tie_word_embeddings=settings["tie_word_embeddings"], rope_parameters=settings["rope"],
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa", **extra)
    model = model_class(config).eval()
    with torch.no_grad():  # gains away from 1 and biases away from 0, so that each matters
        for module in model.modules():
            if isinstance(module, type(model.model.norm)):
                module.weight.uniform_(0.5, 1.5)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.uniform_(-0.5, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    model = make_model(request.param, folder / "model")
    saved = json.loads((folder / "model" / "config.json").read_text())
    assert saved["model_type"] == CASES[request.param].get("kind", "llama")
    run("convert", str(folder / "model"), "--out", str(folder / "ops"), "--dtype", "float64")
    manifest = json.loads((folder / "ops" / "manifest.json").read_text())
    assert manifest["layout"] == "llama" and manifest["kv_heads"] == 2
    assert manifest["tied_embeddings"] == CASES[request.param]["tie_word_embeddings"]
    assert manifest["rotary"]["scaling"] == CASES[request.param]["rope"]["rope_type"]
    assert manifest["sliding_window"] == CASES[request.param].get("sliding_window", 0)
    assert manifest["activation"] == ("gelu_tanh" if request.param == "gelu-gated" else "silu")
    biases = "query_bias" in manifest["layer_files"][0]["files"]
    assert biases == (CASES[request.param].get("kind") == "qwen2")
    return request.param, model, folder / "ops"


def check_flow(reference, ops, tmp_path, label, precision, ids, lengths, positions=None):
    """Runs `reference` (a transformers model) and `emflow flow --model ops` on the same
    right-padded batch (and rotary positions, where given), and asserts that every layer's
    cloud but the last (after the final norm there) and the last-token logits agree: 1e-12 in
    float64, 1e-5 in float32."""
    np_dtype = np.float64 if precision == "float64" else np.float32
    n = ids.shape[1]
    mask = (torch.arange(n)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    given = {} if positions is None else {"position_ids": torch.from_numpy(positions)}
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True, **given)
    hidden = [h.numpy() for h in out.hidden_states]
    last = np.stack([out.logits.numpy()[b, k - 1] for b, k in enumerate(lengths)])
    np.save(tmp_path / "x.npy", hidden[0].astype(np_dtype))
    np.save(tmp_path / "k.npy", lengths)
    extra = []
    if positions is not None:
        np.save(tmp_path / "p.npy", positions)
        extra = ["--positions", str(tmp_path / "p.npy")]
    run("flow", "--model", str(ops), "--cloud", str(tmp_path / "x.npy"), "--key-lengths",
        str(tmp_path / "k.npy"), *extra, "--device", "cpu", "--out", str(tmp_path / "traj.npy"),
        "--logits", str(tmp_path / "logits.npy"))
    traj, ours = np.load(tmp_path / "traj.npy"), np.load(tmp_path / "logits.npy")
    tol = 1e-12 if precision == "float64" else 1e-5
    for layer in range(1, LAYERS):
        e = token_error(traj[layer], hidden[layer], lengths)
        print(f"{label} {precision} after layer {layer - 1}: per token rel err {e:.3e}")
        assert e < tol, (layer, e)
    e = float(np.max(np.abs(ours - last)) / np.max(np.abs(last)))
    print(f"{label} {precision}: last-token logits rel err {e:.3e}")
    assert e < tol


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_llama_layers_and_logits_match_the_framework(converted, tmp_path, precision):
    case, model, ops = converted
    model = float64_reference(model) if precision == "float64" else model
    np_dtype = np.float64 if precision == "float64" else np.float32
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 12), generator=generator)
    lengths = np.array([12, 7, 9], dtype=np.int64)
    mask = (torch.arange(12)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    captured = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, inputs, output: captured.append(
            (output[0] if isinstance(output, tuple) else output).detach().numpy().copy()))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hook.remove()
    hidden = [h.numpy() for h in out.hidden_states]
    logits = out.logits.numpy()
    last = np.stack([logits[b, n - 1] for b, n in enumerate(lengths)])
    np.save(tmp_path / "x.npy", hidden[0].astype(np_dtype))
    np.save(tmp_path / "k.npy", lengths)
    run("flow", "--model", str(ops), "--cloud", str(tmp_path / "x.npy"), "--key-lengths",
        str(tmp_path / "k.npy"), "--device", "cpu", "--out", str(tmp_path / "traj.npy"),
        "--logits", str(tmp_path / "logits.npy"))
    traj, ours = np.load(tmp_path / "traj.npy"), np.load(tmp_path / "logits.npy")
    tol = 1e-12 if precision == "float64" else 1e-5
    for layer in range(1, LAYERS + 1):
        theirs = hidden[layer] if layer < LAYERS else captured[0]
        e = relative_error(traj[layer], theirs, lengths)
        t = token_error(traj[layer], theirs, lengths)
        print(f"llama {case} {precision} after layer {layer - 1}: hidden state rel err {e:.3e}, "
              f"per token {t:.3e}")
        assert e < tol and t < tol, (layer, e, t)
    e = float(np.max(np.abs(ours - last)) / np.max(np.abs(last)))
    print(f"llama {case} {precision}: last-token logits rel err {e:.3e}")
    assert ours.shape == (3, VOCAB) and e < tol


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_explicit_positions_are_the_frameworks_position_ids(converted, tmp_path, precision):
    # `emflow flow --positions`: each token turned at a position of its own (a chunk of a longer
    # sequence, gaps), as transformers' position_ids turn it; the masks stay by index in both.
    case, model, ops = converted
    reference = float64_reference(model) if precision == "float64" else model
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    lengths = np.array([10, 7], dtype=np.int64)
    positions = np.array([[20, 21, 22, 23, 27, 28, 29, 35, 36, 37],
                          [3, 5, 8, 13, 21, 34, 55, 0, 0, 0]], dtype=np.int64)  # < 64
    check_flow(reference, ops, tmp_path, f"llama {case} at given positions", precision, ids,
               lengths, positions)
    np.save(tmp_path / "p.npy", positions[:, :9])  # not one per token: refused by name
    refused = run("flow", "--model", str(ops), "--cloud", str(tmp_path / "x.npy"), "--positions",
                  str(tmp_path / "p.npy"), "--out", str(tmp_path / "t2.npy"), ok=False)
    assert refused.returncode != 0 and "--positions" in refused.stderr, refused.stderr
    assert "(2, 9)" in refused.stderr and "(2, 10)" in refused.stderr, refused.stderr
    assert not (tmp_path / "t2.npy").exists()


def test_rotary_report_is_the_framework_forms_drift(converted, tmp_path):
    # `emflow convert --report` on a llama model writes rotary.csv: per layer, head and offset t,
    # how M(t) = A^T R(-t) B (a key t positions before its query) compares with M(0). Here the
    # forms are built from the framework's own weights and rotation (transformers' q_proj,
    # k_proj and their biases as the extra coordinate, its inv_freq, its rotate_half pairing):
    # a wrong sign, pairing or frequency would move the cosines by far more than the tolerance,
    # which covers transformers' float32 inv_freq against emflow's double frequencies.
    case, model, ops = converted
    out = tmp_path / "ops"
    printed = run("convert", ops.parent / "model", "--out", out, "--report").stdout
    assert "rotary.csv" in printed and "cos(M(t), M(0))" in printed
    rows = np.genfromtxt(out / "rotary.csv", delimiter=",", names=True)
    config = model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dk = config.hidden_size // heads
    offsets = sorted(set(int(t) for t in rows["offset"]))
    assert offsets == [2**k for k in range(13)]
    assert len(rows) == LAYERS * heads * len(offsets)
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    scaling = getattr(model.model.rotary_emb, "attention_scaling", 1.0)
    assert scaling == 1.0
    if config.rope_parameters.get("rope_type") == "dynamic":
        # The dynamic scaling's frequencies depend on the sequence's length: the report takes a
        # sequence of 1 + the largest offset (factored.hpp, rotary_drift), here transformers' own
        # frequencies for that length.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, factor = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=max(offsets) + 1)
        inv_freq = inv_freq.double().numpy()
        assert factor == 1.0

    def rotation(position):  # transformers: x cos + rotate_half(x) sin, as a matrix
        angles = np.concatenate([inv_freq, inv_freq]) * position
        half = dk // 2
        turn = np.zeros((dk, dk))
        turn[:half, half:] = -np.eye(half)
        turn[half:, :half] = np.eye(half)
        return np.diag(np.cos(angles)) + np.diag(np.sin(angles)) @ turn

    for layer in range(LAYERS):
        attention = model.model.layers[layer].self_attn
        q = attention.q_proj.weight.detach().double().numpy()
        k = attention.k_proj.weight.detach().double().numpy()
        if attention.q_proj.bias is not None:  # the cloud lifted by a last coordinate 1
            q = np.hstack([q, attention.q_proj.bias.detach().double().numpy()[:, None]])
            k = np.hstack([k, attention.k_proj.bias.detach().double().numpy()[:, None]])
        for head in range(heads):
            a = q[head * dk:(head + 1) * dk]
            g = head // (heads // kv)
            b = k[g * dk:(g + 1) * dk]
            form0 = a.T @ b
            mine = rows[(rows["layer"] == layer) & (rows["head"] == head)]
            assert np.all(mine["kv_head"] == g)
            for t, change, cosine in zip(mine["offset"], mine["relative_change"], mine["cosine"]):
                form = a.T @ rotation(t).T @ rotation(0) @ b  # query at t, key at 0
                want_cos = np.sum(form * form0) / (np.linalg.norm(form) * np.linalg.norm(form0))
                want_change = np.linalg.norm(form - form0) / np.linalg.norm(form0)
                assert abs(cosine - want_cos) < 2e-3, (case, layer, head, t)
                assert abs(change - want_change) < 2e-3, (case, layer, head, t)


def write_gguf(model, path, arch="qwen2", rope_factors=None):
    """`model` as llama.cpp's converter writes a GGUF file of `arch`: the keys under "<arch>.",
    the tensors in float32 under llama.cpp's names and a token list for the vocabulary size. A
    qwen2 model's query and key rows as they are (its rotary pairs halves) with its q, k, v
    biases; a llama model's permuted per head for llama.cpp's interleaved rotary, and its
    rope_freqs.weight where `rope_factors` are given (llama3's scaling as llama.cpp stores it)."""
    gguf = pytest.importorskip("gguf")
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def permute(w, n):  # transformers' row h k + j k/2 + i stored at h k + 2 i + j
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_factors, dtype=np.float32))
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, kv_heads)
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", array)
        else:
            parts = name.split(".")  # model.layers.N.<module>.<sub>.weight|bias
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_qwen2_gguf_file_matches_the_framework(tmp_path, precision):
    # transformers reads the file back to the model it was written from (so the file follows
    # the format's conventions), and emflow's conversion of the file runs as that model does.
    model = make_model("qwen2-biases", tmp_path / "model")
    write_gguf(model, tmp_path / "model.gguf")
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", torch_dtype=torch.float32).eval()
    for (name, theirs), (_, mine) in zip(model.state_dict().items(), read.state_dict().items()):
        assert torch.equal(theirs, mine), name
    run("convert", str(tmp_path / "model.gguf"), "--out", str(tmp_path / "ops"), "--dtype",
        precision)
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    assert manifest["layout"] == "llama" and manifest["kv_heads"] == 2
    assert "query_bias" in manifest["layer_files"][0]["files"]
    reference = float64_reference(model) if precision == "float64" else model
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    check_flow(reference, tmp_path / "ops", tmp_path, "qwen2 gguf", precision, ids,
               np.array([10, 6], dtype=np.int64))


def llama3_rope_factors(config):
    """The factors llama.cpp's converter writes as rope_freqs.weight for llama3's scaling: per
    frequency f = base^(-2i / dim), 1 above the high-frequency wavelength bound, the scaling's
    factor below the low one, and between them the blend's divisor, 1 / ((1 - s) / factor + s),
    s = (original context / wavelength - low) / (high - low)."""
    params = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * np.pi / params["rope_theta"] ** (-i / dim)
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_llama3_gguf_file_with_rope_freqs_matches_the_framework(tmp_path, precision):
    # llama3's scaling reaches a GGUF file as per-frequency factors (rope_freqs.weight), not as
    # a scaling type. In float64 the reference turns at the frequencies the file gives,
    # base^(-2i / dim) / factor_i with the float32 factors; in float32 it is the framework's own
    # llama3 model, whose frequencies those are to float32's rounding.
    model = make_model("llama3", tmp_path / "model")
    factors = llama3_rope_factors(model.config)
    factor = model.config.rope_parameters["factor"]
    assert (factors == factor).any() and ((factors > 1) & (factors < factor)).any()  # both bands
    write_gguf(model, tmp_path / "model.gguf", "llama", factors)
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="model.gguf", torch_dtype=torch.float32).eval()
    for (name, theirs), (_, mine) in zip(model.state_dict().items(), read.state_dict().items()):
        assert torch.equal(theirs, mine), name  # the rows permuted as llama.cpp permutes them
    conversion = run("convert", str(tmp_path / "model.gguf"), "--out", str(tmp_path / "ops"),
                     "--dtype", precision)
    assert "per-frequency factors" in conversion.stdout, conversion.stdout
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    dim = model.config.hidden_size // model.config.num_attention_heads
    base = 1.0 / model.config.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    frequencies = base / factors.astype(np.float64)
    assert manifest["rotary"]["scaling"] == "default"
    np.testing.assert_allclose(manifest["rotary"]["inverse_frequencies"], frequencies,
                               rtol=1e-15)
    reference = float64_reference(model, frequencies) if precision == "float64" else model
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    check_flow(reference, tmp_path / "ops", tmp_path, "llama3 gguf", precision, ids,
               np.array([12, 8], dtype=np.int64))
