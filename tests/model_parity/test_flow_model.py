"""`emflow flow --model` end to end with numpy only: hand-made BERT- and GPT-2-layout
checkpoints are converted and run on a padded batch, and every record equals a plain numpy
forward pass written from the raw weights (standard multi-head attention with Q, K, V and O, not
the EMF operators); plus the outputs' shapes, the picture and the errors.
"""
import json
import os
from math import erf, sqrt

import numpy as np
import pytest
from emflow_cli import run

from test_convert_errors import D, FFN, HEADS, LAYERS, bert_config, bert_tensors, make_model



def gpt2_tensors():
    rng = np.random.default_rng(1)
    t = {"wte.weight": rng.normal(size=(11, D)), "wpe.weight": rng.normal(size=(6, D))}
    for l in range(LAYERS):
        p = f"transformer.h.{l}."
        for name, shape in [("attn.c_attn", (D, 3 * D)), ("attn.c_proj", (D, D)),
                            ("mlp.c_fc", (D, FFN)), ("mlp.c_proj", (FFN, D))]:
            t[p + name + ".weight"] = rng.normal(size=shape) / np.sqrt(shape[0])
            t[p + name + ".bias"] = rng.normal(size=shape[1]) * 0.1
        for norm in ("ln_1", "ln_2"):
            t[p + norm + ".weight"] = 1 + 0.1 * rng.normal(size=D)
            t[p + norm + ".bias"] = 0.1 * rng.normal(size=D)
    t["transformer.ln_f.weight"] = 1 + 0.1 * rng.normal(size=D)
    t["transformer.ln_f.bias"] = 0.1 * rng.normal(size=D)
    return {k: v.astype(np.float32).astype(np.float64) for k, v in t.items()}


def layer_norm(x, g, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def attention(x, wq, bq, wk, bk, wv, bv, wo, bo, lengths, causal):
    """Standard multi-head attention; weights as nn.Linear stores them (out, in)."""
    B, N, _ = x.shape
    k = D // HEADS
    q, kk, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    out = np.zeros_like(x)
    for b in range(B):
        n = lengths[b]
        heads = []
        for h in range(HEADS):
            s = slice(h * k, (h + 1) * k)
            scores = q[b, :, s] @ kk[b, :n, s].T / np.sqrt(k)
            if causal:
                scores = np.where(np.arange(n)[None, :] > np.arange(N)[:, None], -np.inf, scores)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[b, :n, s])
        out[b, :n] = (np.concatenate(heads, -1) @ wo.T + bo)[:n]
    return out


def gelu(x, tanh):
    if tanh:
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


def bert_forward(t, x, lengths):
    records = [x]
    for l in range(LAYERS):
        p = f"encoder.layer.{l}."
        w = lambda name: t[p + name]
        a = attention(x, *(w(f"attention.self.{n}.{part}") for n in ("query", "key", "value")
                           for part in ("weight", "bias")),
                      w("attention.output.dense.weight"), w("attention.output.dense.bias"),
                      lengths, causal=False)
        h = layer_norm(x + a, w("attention.output.LayerNorm.weight"),
                       w("attention.output.LayerNorm.bias"), 1e-12)
        f = gelu(h @ w("intermediate.dense.weight").T + w("intermediate.dense.bias"), False)
        f = f @ w("output.dense.weight").T + w("output.dense.bias")
        x = layer_norm(h + f, w("output.LayerNorm.weight"), w("output.LayerNorm.bias"), 1e-12)
        records.append(x)
    return records


def gpt2_forward(t, x, lengths):
    records = [x]
    for l in range(LAYERS):
        w = lambda name: t[f"transformer.h.{l}." + name]
        qkv, qkv_b = w("attn.c_attn.weight"), w("attn.c_attn.bias")
        parts = []
        for i in range(3):  # Conv1D (in, out): the nn.Linear weight is the transpose
            parts += [qkv[:, i * D:(i + 1) * D].T, qkv_b[i * D:(i + 1) * D]]
        a = attention(layer_norm(x, w("ln_1.weight"), w("ln_1.bias"), 1e-5), *parts,
                      w("attn.c_proj.weight").T, w("attn.c_proj.bias"), lengths, causal=True)
        h = x + a
        f = gelu(layer_norm(h, w("ln_2.weight"), w("ln_2.bias"), 1e-5) @ w("mlp.c_fc.weight")
                 + w("mlp.c_fc.bias"), True)
        x = h + f @ w("mlp.c_proj.weight") + w("mlp.c_proj.bias")
        records.append(x)
    records[-1] = layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], 1e-5)
    return records


@pytest.mark.parametrize("layout", ["bert", "gpt2"])
def test_the_layers_equal_a_plain_forward_pass(tmp_path, layout):
    if layout == "bert":
        t = {k: v.astype(np.float32).astype(np.float64) for k, v in bert_tensors().items()}
        config = bert_config()
    else:
        t = gpt2_tensors()
        config = {"model_type": "gpt2", "n_embd": D, "n_head": HEADS, "n_layer": LAYERS,
                  "n_inner": FFN, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    model = make_model(tmp_path / "model", t, config)
    run("convert", model, "--out", tmp_path / "ops")
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    assert manifest["layout"] == layout and manifest["pre_norm"] == (layout == "gpt2")
    x = np.random.default_rng(2).normal(size=(3, 5, D))
    lengths = np.array([5, 3, 4], dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "k.npy", lengths)
    run("flow", "--model", tmp_path / "ops", "--cloud", tmp_path / "x.npy", "--key-lengths",
        tmp_path / "k.npy", "--out", tmp_path / "traj.npy", "--attention-out",
        tmp_path / "att.npy", "--metrics", tmp_path / "m.csv", "--plot", tmp_path / "p.png")
    traj, att = np.load(tmp_path / "traj.npy"), np.load(tmp_path / "att.npy")
    assert traj.shape == (LAYERS + 1, 3, 5, D) and att.shape == (LAYERS, 3, 5, D)
    expected = (bert_forward if layout == "bert" else gpt2_forward)(t, x, lengths)
    for r in range(LAYERS + 1):
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(traj[r, b, :n], expected[r][b, :n], rtol=0, atol=1e-12)
    assert np.all(att[:, 1, 3:] == 0)  # padding rows get no attention update
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 1 + (LAYERS + 1) * 3


def test_flow_model_errors(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    run("convert", model, "--out", tmp_path / "ops")
    np.save(tmp_path / "wrong.npy", np.zeros((4, D + 1)))
    result = run("flow", "--model", tmp_path / "ops", "--cloud", tmp_path / "wrong.npy",
                 "--out", tmp_path / "t.npy", ok=False)
    assert result.returncode != 0 and f"has d = {D}" in result.stderr
    np.save(tmp_path / "x.npy", np.zeros((2, 4, D)))
    np.save(tmp_path / "k.npy", np.array([4, 5], dtype=np.int64))
    result = run("flow", "--model", tmp_path / "ops", "--cloud", tmp_path / "x.npy",
                 "--key-lengths", tmp_path / "k.npy", "--out", tmp_path / "t.npy", ok=False)
    assert result.returncode != 0 and "expected 2..4" in result.stderr
    assert not (tmp_path / "t.npy").exists()
    result = run("flow", "--model", tmp_path / "ops", "--cloud", tmp_path / "x.npy",
                 "--layers", "3", ok=False)
    assert result.returncode != 0 and "--layers excludes --model" in result.stderr


def converted(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    run("convert", model, "--out", tmp_path / "ops")
    np.save(tmp_path / "x.npy", np.random.default_rng(3).normal(size=(1, 4, D)))
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    return tmp_path / "ops"


def test_no_output_replaces_a_file_the_run_reads(tmp_path):
    ops = converted(tmp_path)
    before = {p.name: p.read_bytes() for p in ops.iterdir()}
    base = ["flow", "--model", ops, "--cloud", tmp_path / "x.npy"]
    for option, target in [("--out", ops / "layer0.M.npy"), ("--metrics", ops / "manifest.json"),
                           ("--attention-out", ops / "layer1.ffn_out.npy"),
                           ("--plot", tmp_path / "labels.txt")]:
        result = run(*base, "--labels", tmp_path / "labels.txt", option, target, ok=False)
        assert result.returncode == 1, result.stderr
        assert f"{option} '{target}' is the input file of" in result.stderr, result.stderr
        # The model still reads back as it was, and the labels are intact.
        assert {p.name: p.read_bytes() for p in ops.iterdir()} == before
        assert (tmp_path / "labels.txt").read_text() == "a\nb\nc\nd\n"
    # A new file in the folder is no input: allowed.
    run(*base, "--out", ops / "trajectory.npy")
    assert np.load(ops / "trajectory.npy").shape == (LAYERS + 1, 1, 4, D)


def test_labels_errors_name_labels(tmp_path):
    ops = converted(tmp_path)
    base = ["flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--plot", tmp_path / "p.png"]
    result = run(*base, "--labels", tmp_path / "nope.txt", ok=False)
    assert result.returncode == 1 and "--labels '" in result.stderr and "--tokens" not in \
        result.stderr, result.stderr
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    result = run(*base, "--labels", tmp_path / "three.txt", ok=False)
    assert result.returncode == 1 and "--labels '" in result.stderr and "holds 3 lines" in \
        result.stderr, result.stderr
    result = run(*base, "--labels", tmp_path, ok=False)
    assert result.returncode == 1 and "is a folder" in result.stderr, result.stderr
    assert not (tmp_path / "p.png").exists()


def test_one_token_clouds_are_refused_as_flow_refuses_them(tmp_path):
    ops = converted(tmp_path)
    np.save(tmp_path / "one.npy", np.ones((1, D)))
    result = run("flow", "--model", ops, "--cloud", tmp_path / "one.npy", "--metrics",
                 tmp_path / "m.csv", ok=False)
    assert result.returncode == 1 and "expected at least 2" in result.stderr, result.stderr
    np.save(tmp_path / "k.npy", np.array([1], dtype=np.int64))
    result = run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--key-lengths",
                 tmp_path / "k.npy", "--metrics", tmp_path / "m.csv", ok=False)
    assert result.returncode == 1 and "expected 2..4" in result.stderr, result.stderr
    assert not (tmp_path / "m.csv").exists()


@pytest.mark.parametrize("field, value, phrase", [
    ("norm_eps", -1e-5, "'norm_eps' is -1e-05, expected a finite number > 0"),
    ("norm_eps", "1e-5", "'norm_eps' is \"1e-5\" (string), expected a finite number > 0"),
    ("heads", 2.0, "'heads' is 2.0 (number), expected a positive integer"),
    ("pre_norm", 0, "'pre_norm' is 0 (number), expected true or false"),
])
def test_a_manifest_field_of_the_wrong_type_or_value_is_named(tmp_path, field, value, phrase):
    ops = converted(tmp_path)
    manifest = json.loads((ops / "manifest.json").read_text())
    manifest[field] = value
    (ops / "manifest.json").write_text(json.dumps(manifest))
    result = run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--metrics",
                 tmp_path / "m.csv", ok=False)
    assert result.returncode == 1 and phrase in result.stderr, result.stderr
    assert "manifest.json" in result.stderr and "\n" not in result.stderr.strip()
