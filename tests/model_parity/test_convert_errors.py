"""`emflow convert` on small hand-made checkpoints (numpy only, no framework needed): a good one
converts, and every bad one (missing tensor, wrong shape, unknown layout, rotary or relative
position embeddings, a layer count that disagrees with the config; for the llama layout also a
missing lm_head, an unknown rope scaling, biases, another activation) gets a clear error and leaves
no output folder behind.
"""
import json
import os
import struct

import numpy as np
import pytest
from emflow_cli import run

D, HEADS, FFN, LAYERS = 8, 2, 16, 2


def save_safetensors(path, tensors):
    header, data, at = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def bert_tensors(prefix=""):
    rng = np.random.default_rng(0)
    t = {prefix + "embeddings.position_ids": np.arange(4, dtype=np.float32)}
    for l in range(LAYERS):
        p = f"{prefix}encoder.layer.{l}."
        for name, shape in [("attention.self.query", (D, D)), ("attention.self.key", (D, D)),
                            ("attention.self.value", (D, D)), ("attention.output.dense", (D, D)),
                            ("intermediate.dense", (FFN, D)), ("output.dense", (D, FFN))]:
            t[p + name + ".weight"] = rng.normal(size=shape) / np.sqrt(shape[1])
            t[p + name + ".bias"] = rng.normal(size=shape[0]) * 0.1
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"] = 1 + 0.1 * rng.normal(size=D)
            t[p + norm + ".bias"] = 0.1 * rng.normal(size=D)
    return t


def bert_config(**extra):
    config = {"model_type": "bert", "hidden_size": D, "num_attention_heads": HEADS,
              "num_hidden_layers": LAYERS, "intermediate_size": FFN, "hidden_act": "gelu",
              "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"}
    config.update(extra)
    return config


def make_model(folder, tensors, config):
    folder.mkdir()
    save_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def convert(*args):
    return run("convert", *args, ok=False)


def expect_refused(tmp_path, tensors, config, *phrases):
    model = make_model(tmp_path / "model", tensors, config)
    result = convert(model, "--out", tmp_path / "ops")
    assert result.returncode != 0
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert "\n" not in result.stderr.strip(), "one-line message"
    # No output folder and no staging folder left behind.
    assert sorted(os.listdir(tmp_path)) == ["model"], os.listdir(tmp_path)


def test_a_good_checkpoint_converts_with_its_manifest(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors("bert."), bert_config())
    result = convert(model, "--out", tmp_path / "ops", "--report")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    assert manifest["layout"] == "bert" and manifest["layers"] == LAYERS
    assert manifest["heads"] == HEADS and manifest["dim"] == D and manifest["norm_eps"] == 1e-12
    assert manifest["pre_norm"] is False and manifest["activation"] == "gelu"
    sources = manifest["layer_files"][1]["sources"]
    assert sources["query.weight"] == "bert.encoder.layer.1.attention.self.query.weight"
    # The exact mapping (docs/MATH.md section 3), head 1 of layer 1, from the raw weights.
    t = bert_tensors("bert.")
    p = "bert.encoder.layer.1.attention."
    wq, wk = t[p + "self.query.weight"].astype(np.float32), t[p + "self.key.weight"]
    wv, wo = t[p + "self.value.weight"], t[p + "output.dense.weight"]
    wq, wk, wv, wo = (np.asarray(w, dtype=np.float32).astype(np.float64) for w in (wq, wk, wv, wo))
    bq = t[p + "self.query.bias"].astype(np.float32).astype(np.float64)
    k = D // HEADS
    h = slice(k, 2 * k)
    M = np.load(tmp_path / "ops" / "layer1.M.npy")
    F = np.load(tmp_path / "ops" / "layer1.F.npy")
    u = np.load(tmp_path / "ops" / "layer1.u.npy")
    np.testing.assert_allclose(M[1], wq[h].T @ wk[h] / np.sqrt(k), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(F[1], wo[:, h] @ wv[h], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(u[1], wk[h].T @ bq[h] / np.sqrt(k), rtol=1e-13, atol=1e-15)
    csv = (tmp_path / "ops" / "spectrum.csv").read_text().splitlines()
    assert csv[0] == "layer,head,operator,index,real,imag"
    assert len(csv) == 1 + LAYERS * HEADS * 2 * D
    # A second convert replaces the earlier operator folder.
    assert convert(model, "--out", tmp_path / "ops").returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["model", "ops"]


def test_missing_tensor(tmp_path):
    t = bert_tensors()
    del t["encoder.layer.1.output.dense.bias"]
    expect_refused(tmp_path, t, bert_config(), "encoder.layer.1.output.dense.bias", "missing",
                   "model.safetensors")


def test_wrong_shape(tmp_path):
    t = bert_tensors()
    t["encoder.layer.0.attention.self.key.weight"] = np.zeros((D, D + 1))
    expect_refused(tmp_path, t, bert_config(), "encoder.layer.0.attention.self.key.weight",
                   f"has shape ({D}, {D + 1}), expected ({D}, {D})")


def test_unknown_layout_lists_what_it_found(tmp_path):
    t = {k.replace("encoder.layer.", "model.layers."): v for k, v in bert_tensors().items()}
    expect_refused(tmp_path, t, bert_config(), "no known layout",
                   "found: ", "model.layers.N.attention.self.query.weight")


@pytest.mark.parametrize("extra, phrase", [
    ({"rope_theta": 10000.0}, "rotary position embeddings ('rope_theta'"),
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' uses rotary"),
    ({"model_type": "qwen3"}, "model_type 'qwen3' uses rotary"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
])
def test_position_dependent_models_are_refused(tmp_path, extra, phrase):
    expect_refused(tmp_path, bert_tensors(), bert_config(**extra), phrase)


def test_layer_count_must_match_the_config(tmp_path):
    expect_refused(tmp_path, bert_tensors(), bert_config(num_hidden_layers=3),
                   "holds 2 layers", "says 3")


def test_an_existing_folder_that_is_not_an_operator_folder_is_kept(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "mine.txt").write_text("keep")
    result = convert(model, "--out", tmp_path / "ops")
    assert result.returncode != 0 and "not an operator folder" in result.stderr
    assert os.listdir(tmp_path / "ops") == ["mine.txt"]


def test_names_given_on_the_command_line(tmp_path):
    t = {k.replace("encoder.layer.", "blocks."): v for k, v in bert_tensors().items()}
    model = make_model(tmp_path / "model", t, bert_config())
    roles = {"query": "attention.self.query", "key": "attention.self.key",
             "value": "attention.self.value", "output": "attention.output.dense",
             "norm1": "attention.output.LayerNorm", "ffn_in": "intermediate.dense",
             "ffn_out": "output.dense", "norm2": "output.LayerNorm"}
    names = []
    for role, name in roles.items():
        for part in ("weight", "bias"):
            names += ["--name", f"{role}.{part}=blocks.{{layer}}.{name}.{part}"]
    result = convert(model, "--out", tmp_path / "ops", "--layout", "bert", *names)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    assert manifest["layer_files"][0]["sources"]["ffn_out.bias"] == "blocks.0.output.dense.bias"
    bad = convert(model, "--out", tmp_path / "ops2", "--layout", "bert", "--name", "qq=x")
    assert bad.returncode != 0 and "'qq' is not a role of the bert layout" in bad.stderr


def test_a_per_layer_pattern_without_layer_is_refused_at_once(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    result = subprocess_convert(model, "--out", tmp_path / "ops", "--name",
                                "query.weight=encoder.layer.0.attention.self.query.weight")
    assert result.returncode == 1
    assert "the pattern of 'query.weight'" in result.stderr and "has no {layer}" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["model"]


def subprocess_convert(*args):
    """convert with a time limit: a hang fails the test instead of the suite."""
    import subprocess

    from emflow_cli import CLI
    if not CLI:
        pytest.skip("EMFLOW_CLI is not set (run through ctest)")
    return subprocess.run([CLI, "convert", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_an_operator_folder_with_other_files_is_kept(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    assert convert(model, "--out", tmp_path / "ops", "--report").returncode == 0
    (tmp_path / "ops" / "notes.txt").write_text("hi")
    (tmp_path / "ops" / "results").mkdir()
    before = sorted(os.listdir(tmp_path / "ops"))
    result = convert(model, "--out", tmp_path / "ops")
    assert result.returncode == 1 and "holds '" in result.stderr, result.stderr
    assert "which its manifest.json does not list" in result.stderr
    assert sorted(os.listdir(tmp_path / "ops")) == before
    assert (tmp_path / "ops" / "notes.txt").read_text() == "hi"
    # Without them (spectrum.csv is listed by the manifest) the folder is replaced.
    (tmp_path / "ops" / "notes.txt").unlink()
    (tmp_path / "ops" / "results").rmdir()
    assert convert(model, "--out", tmp_path / "ops").returncode == 0
    assert "spectrum.csv" not in os.listdir(tmp_path / "ops")


def dead_pid():
    """The id of a process that has exited (and been reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_staging_folders_of_a_killed_conversion_are_removed(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    pid = dead_pid()
    stale = tmp_path / f".ops.emflow-tmp-{pid}-1f2e"
    stale.mkdir()
    (stale / "layer0.M.npy").write_bytes(b"x" * 1000)
    live = tmp_path / f".ops.emflow-tmp-{os.getpid()}-3a"  # a live writer's: kept
    live.mkdir()
    assert convert(model, "--out", tmp_path / "ops").returncode == 0
    assert sorted(os.listdir(tmp_path)) == [live.name, "model", "ops"]


def test_a_folder_a_killed_conversion_moved_aside_is_put_back(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    assert convert(model, "--out", tmp_path / "ops").returncode == 0
    # Killed between moving the old folder aside and renaming the new one into place.
    moved = tmp_path / f".ops.old.emflow-tmp-{dead_pid()}-9c"
    os.rename(tmp_path / "ops", moved)
    (tmp_path / f".ops.emflow-tmp-{dead_pid()}-9c").mkdir()
    assert convert(model, "--out", tmp_path / "ops").returncode == 0
    assert sorted(os.listdir(tmp_path)) == ["model", "ops"]


def test_out_with_a_trailing_slash_and_links(tmp_path):
    model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    result = convert(model, "--out", f"{tmp_path / 'ops'}/")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ops" / "manifest.json").exists()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    result = convert(model, "--out", tmp_path / "dangling")
    assert result.returncode == 1 and "is a symbolic link to" in result.stderr, result.stderr
    assert "which does not exist" in result.stderr
    assert not (tmp_path / "nowhere").exists()
    # A link to an operator folder: the folder it names is replaced, the link stays a link.
    os.symlink(tmp_path / "ops", tmp_path / "link")
    assert convert(model, "--out", tmp_path / "link").returncode == 0
    assert os.path.islink(tmp_path / "link") and (tmp_path / "ops" / "manifest.json").exists()


def test_the_out_folder_is_checked_before_the_conversion(tmp_path):
    # A model that cannot even be read: the --out error comes first.
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "mine.txt").write_text("keep")
    result = convert(tmp_path / "missing-model", "--out", tmp_path / "ops")
    assert result.returncode == 1 and "--out" in result.stderr, result.stderr


@pytest.mark.parametrize("extra, phrase", [
    ({"model_type": 7}, "'model_type' is 7 (number), expected a string"),
    ({"num_hidden_layers": "2"}, "'num_hidden_layers' is \"2\" (string), expected a positive "
                                 "integer"),
    ({"num_hidden_layers": 2.0}, "'num_hidden_layers' is 2.0 (number), expected a positive "
                                 "integer"),
    ({"hidden_act": ["gelu"]}, "'hidden_act' is [\"gelu\"] (array), expected a string"),
    ({"layer_norm_eps": -1e-12}, "'layer_norm_eps' is -1e-12 (number), expected a finite "
                                 "number > 0"),
    ({"layer_norm_eps": "small"}, "'layer_norm_eps' is \"small\" (string)"),
    ({"position_embedding_type": 3}, "'position_embedding_type' is 3 (number)"),
])
def test_config_values_of_the_wrong_type_name_the_file_and_key(tmp_path, extra, phrase):
    expect_refused(tmp_path, bert_tensors(), bert_config(**extra), "config.json", phrase)


def test_gpt2_n_inner_must_be_an_integer(tmp_path):
    config = {"model_type": "gpt2", "n_embd": D, "n_head": HEADS, "n_layer": LAYERS,
              "n_inner": float(FFN)}
    expect_refused(tmp_path, {"h.0.attn.c_attn.weight": np.zeros((D, 3 * D))}, config,
                   f"'n_inner' is {float(FFN)} (number), expected a positive integer")


def test_a_config_that_is_a_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    save_safetensors(model / "model.safetensors", bert_tensors())
    (model / "config.json").mkdir()
    result = convert(model, "--out", tmp_path / "ops")
    assert result.returncode == 1 and "config.json': is a folder" in result.stderr, result.stderr
    assert "basic_filebuf" not in result.stderr


def test_report_names_a_non_finite_operator(tmp_path):
    t = bert_tensors()
    t["encoder.layer.1.attention.self.key.weight"][2, 3] = np.nan
    expect_refused_with(tmp_path, t, bert_config(), ["--report"],
                        "--report needs finite operators", "M_h of layer 1 head 0 holds nan")


def expect_refused_with(tmp_path, tensors, config, args, *phrases):
    model = make_model(tmp_path / "model", tensors, config)
    result = convert(model, "--out", tmp_path / "ops", *args)
    assert result.returncode != 0
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["model"], os.listdir(tmp_path)


# The llama layout (model_type llama, Hugging Face names): a good one converts, and each bad one
# is refused naming the file and the tensor or key, leaving no folder.
KV, VOCAB = 1, 5


def llama_tensors(tied=True):
    rng = np.random.default_rng(1)
    k = D // HEADS
    t = {"model.embed_tokens.weight": rng.normal(size=(VOCAB, D)),
         "model.norm.weight": 1 + 0.1 * rng.normal(size=D)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        for name, shape in [("self_attn.q_proj", (D, D)), ("self_attn.k_proj", (KV * k, D)),
                            ("self_attn.v_proj", (KV * k, D)), ("self_attn.o_proj", (D, D)),
                            ("mlp.gate_proj", (FFN, D)), ("mlp.up_proj", (FFN, D)),
                            ("mlp.down_proj", (D, FFN))]:
            t[p + name + ".weight"] = rng.normal(size=shape) / np.sqrt(shape[1])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"] = 1 + 0.1 * rng.normal(size=D)
    if not tied:
        t["lm_head.weight"] = rng.normal(size=(VOCAB, D))
    return t


def llama_config(**extra):
    config = {"model_type": "llama", "hidden_size": D, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True}
    config.update(extra)
    return config


def test_a_llama_checkpoint_converts(tmp_path):
    model = make_model(tmp_path / "model", llama_tensors(), llama_config())
    result = convert(model, "--out", tmp_path / "ops")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "ops" / "manifest.json").read_text())
    assert manifest["layout"] == "llama" and manifest["kv_heads"] == KV
    assert manifest["dtype"] == "float32" and manifest["tied_embeddings"] is True
    assert manifest["rotary"]["base"] == 10000.0 and manifest["rotary"]["dim"] == D // HEADS
    assert "unembedding" not in manifest["model_files"]
    assert not any(name.endswith(".M.npy") for name in os.listdir(tmp_path / "ops"))
    # No single M_h to take the spectrum of: --report says how each head's rotary form turns
    # with the offset instead (test_llama_parity.py checks its values against transformers).
    report = convert(model, "--out", tmp_path / "ops2", "--report")
    assert report.returncode == 0, report.stderr
    assert "rotary.csv" in report.stdout and not (tmp_path / "ops2" / "spectrum.csv").exists()
    manifest = json.loads((tmp_path / "ops2" / "manifest.json").read_text())
    assert "rotary.csv" in json.dumps(manifest)
    lines = (tmp_path / "ops2" / "rotary.csv").read_text().splitlines()
    assert lines[0] == "layer,head,kv_head,offset,relative_change,cosine"
    assert len(lines) == 1 + LAYERS * HEADS * 13


@pytest.mark.parametrize("change, config, phrases", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), {},
     ["tensor 'model.layers.1.mlp.up_proj.weight' is missing", "ffn_in.weight of layer 1"]),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((D, D))}), {},
     ["'model.layers.0.self_attn.k_proj.weight'", f"has shape ({D}, {D}), expected (4, {D})"]),
    (None, {"tie_word_embeddings": False}, ["tensor 'lm_head.weight' is missing"]),
    (None, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn"]),
    (None, {"attention_bias": True}, ["'attention_bias' is true"]),
    (None, {"hidden_act": "quick_gelu"}, ["hidden_act 'quick_gelu'", "silu, gelu, gelu_new"]),
    (None, {"num_key_value_heads": 3}, ["not a multiple of num_key_value_heads 3"]),
    (None, {"num_hidden_layers": 3}, ["holds 2 layers", "says 3"]),
    (None, {"model_type": "qwen2", "use_sliding_window": True}, ["use_sliding_window is true"]),
    (None, {"model_type": "qwen2"},
     ["tensor 'model.layers.0.self_attn.q_proj.bias' is missing", "query.bias of layer 0"]),
])
def test_bad_llama_checkpoints_are_refused(tmp_path, change, config, phrases):
    tensors = llama_tensors()
    if change:
        change(tensors)
    expect_refused(tmp_path, tensors, llama_config(**config), *phrases)
