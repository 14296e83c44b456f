"""emflow.gguf on files written here byte by byte: values come back as Python values of their
type, tensors as float32 arrays of their row-major shape, and the library's refusals as
RuntimeError / ValueError with its message. (tests/model_parity/test_gguf_parity.py holds the reader
to the gguf package.)"""
import struct

import numpy as np
import pytest

import emflow


def string(s):
    data = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_file(entries, tensors=(), data=b""):
    """A version 3 file: entries [(key, type code, value bytes)], tensors [(name, extents as
    stored, type code, offset)], the data section at the next multiple of 32."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(entries))
    for key, code, value in entries:
        out += string(key) + struct.pack("<I", code) + value
    for name, extents, code, offset in tensors:
        out += string(name) + struct.pack("<I", len(extents))
        out += b"".join(struct.pack("<Q", e) for e in extents) + struct.pack("<IQ", code, offset)
    return out + b"\0" * (-len(out) % 32) + data


def test_values_tensors_and_tokens(tmp_path):
    entries = [
        ("general.architecture", 8, string("llama")),
        ("llama.block_count", 4, struct.pack("<I", 30)),
        ("big", 10, struct.pack("<Q", 2 ** 64 - 1)),
        ("eps", 6, struct.pack("<f", 1e-5)),
        ("flag", 7, b"\1"),
        ("raw", 8, string(b"\xff\xfe")),
        ("tokenizer.ggml.model", 8, string("gpt2")),
        ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + string("\u0120the") + string(".")),
        ("ids", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", -1, 0, 7)),
        ("nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 2) + b"\1\2"),
    ]
    q8 = struct.pack("<e", 0.5) + bytes(range(32))  # d = 0.5, q = 0 .. 31
    data = struct.pack("<2f", 1.5, -2.0) + b"\0" * 24 + q8
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_file(entries, [("norm", [2], 0, 0), ("w", [32, 1], 8, 32)], data))

    f = emflow.gguf.File(path)
    assert (f.version, f.alignment) == (3, 32)
    assert f.data_offset % 32 == 0
    m = f.metadata
    assert m["general.architecture"] == "llama"
    assert m["llama.block_count"] == 30 and type(m["llama.block_count"]) is int
    assert m["big"] == 2 ** 64 - 1
    assert m["eps"] == float(np.float32(1e-5))
    assert m["flag"] is True
    assert m["raw"].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert f.tokens == ["\u0120the", "."]
    assert f.detokenize([0, 1, 0]) == " the. the"  # GPT-2's byte-level "Ġ" is a space

    assert m["ids"].dtype == np.int32 and m["ids"].tolist() == [-1, 0, 7]
    assert [a.tolist() for a in m["nested"]] == [[1, 2]]
    assert f.types["ids"] == ("array", "int32")
    assert f.types["eps"] == ("float32", None)

    assert [t.name for t in f.tensors] == ["norm", "w"]
    assert f.tensor("w") == emflow.gguf.TensorInfo("w", "Q8_0", (1, 32), 32, 34)
    norm = f.read("norm")
    assert norm.dtype == np.float32 and norm.tolist() == [1.5, -2.0]
    w = f.read("w")
    assert w.shape == (1, 32)
    np.testing.assert_array_equal(w[0], np.arange(32) * 0.5)
    np.testing.assert_array_equal(emflow.gguf.dequantize("Q8_0", q8, 32), w[0])


def test_refusals_carry_the_library_message(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_file([("k", 7, b"\2")]))
    with pytest.raises(RuntimeError, match=r"read_gguf: '.*bad\.gguf': key 'k': holds the bool "
                                           r"byte 2"):
        emflow.gguf.File(path)
    path.write_bytes(gguf_file([], [("q", [256], 14, 0)], b"\0" * 210))
    f = emflow.gguf.File(path)
    with pytest.raises(RuntimeError, match="tensor 'q' has type Q6_K, which emflow does not "
                                           "dequantize"):
        f.read("q")
    with pytest.raises(RuntimeError, match="has no tensor 'absent'"):
        f.read("absent")
    with pytest.raises(ValueError, match="argument 'type' is 'Q9_9'"):
        emflow.gguf.dequantize("Q9_9", b"", 0)
    with pytest.raises(ValueError, match="argument 'blocks' has 33 bytes"):
        emflow.gguf.dequantize("Q8_0", b"\0" * 33, 32)
    with pytest.raises(ValueError, match="argument 'count' is 31"):
        emflow.gguf.dequantize("Q8_0", b"\0" * 34, 31)


def test_the_type_table():
    table = {name: (code, block, nbytes, dequantized)
             for code, name, block, nbytes, dequantized in emflow.gguf.types()}
    assert table["Q4_1"] == (3, 32, 20, True)
    assert table["Q6_K"] == (14, 256, 210, False)
    assert sorted(n for n, row in table.items() if row[3]) == sorted(
        ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
