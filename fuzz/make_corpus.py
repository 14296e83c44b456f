#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers to tests/fuzz_corpus/<target>/ (valid and malformed
.npy, safetensors and GGUF files, and `emflow attend` invocations). Deterministic; run it again
after changing it:
    python3 fuzz/make_corpus.py
"""
import math
import os
import shutil
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fuzz_corpus")
SEPARATOR = b"@@FILE@@"


def npy(descr, shape, payload=None, version=(1, 0), fortran="False", dict_text=None, pad=True):
    """A .npy file; `payload` defaults to the right number of bytes for descr and shape."""
    shape_text = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    if dict_text is None:
        dict_text = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran,
                                                                             shape_text)
    header = dict_text.encode()
    length_bytes = 2 if version[0] == 1 else 4
    if pad:
        total = 6 + 2 + length_bytes + len(header) + 1
        header += b" " * ((64 - total % 64) % 64)
        header += b"\n"
    prefix = b"\x93NUMPY" + bytes(version)
    prefix += struct.pack("<H" if length_bytes == 2 else "<I", len(header))
    if payload is None:
        count = math.prod(shape)
        size = {"<f4": 4, "<i4": 4, "<f8": 8, "<i8": 8}.get(descr, 4)
        kind = {"<f4": "<f", "<f8": "<d", "<i4": "<i", "<i8": "<q"}.get(descr, "<f")
        if kind in ("<f", "<d"):
            values = [math.sin(0.7 * i + 0.1) * 0.5 for i in range(count)]
        else:
            values = [(i * 7) % 5 for i in range(count)]
        payload = struct.pack("<%d%s" % (count, kind[1]), *values) if count else b""
        assert len(payload) == count * size
    return prefix + header + payload


def write(target, name, data):
    folder = os.path.join(ROOT, target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as out:
        out.write(data)


def npy_corpus():
    t = "fuzz_npy"
    write(t, "f4_rank1", npy("<f4", (5,)))
    write(t, "f4_rank2", npy("<f4", (3, 4)))
    write(t, "f8_rank3", npy("<f8", (2, 3, 2)))
    write(t, "f4_rank4", npy("<f4", (1, 2, 2, 3)))
    write(t, "i8_rank1", npy("<i8", (4,)))
    write(t, "i4_rank1", npy("<i4", (3,)))
    write(t, "f4_empty", npy("<f4", (0, 3)))
    write(t, "f8_v2", npy("<f8", (2, 2), version=(2, 0)))
    write(t, "f4_v3", npy("<f4", (3,), version=(3, 0)))
    write(t, "double_quotes", npy("<f4", (2,), dict_text='{"descr": "<f4", "fortran_order": '
                                  'False, "shape": (2,)}'))
    write(t, "keys_reordered", npy("<f4", (2, 1), dict_text="{'shape': (2, 1), 'descr': '<f4', "
                                   "'fortran_order': False}"))
    write(t, "fortran", npy("<f4", (2, 2), fortran="True"))
    write(t, "big_endian", npy(">f4", (2,), payload=b"\0" * 8))
    write(t, "unsupported_dtype", npy("<f2", (2,), payload=b"\0" * 4))
    write(t, "truncated_payload", npy("<f4", (4, 4))[:-10])
    write(t, "extra_bytes", npy("<f4", (2,)) + b"\0\0\0\0")
    write(t, "overflow_shape", npy("<f4", (4294967296, 4294967296), payload=b""))
    write(t, "huge_extent", npy("<f4", (99999999999999999999,), payload=b""))
    write(t, "rank0", npy("<f4", (), payload=b"\0\0\0\0"))
    write(t, "rank5", npy("<f4", (1, 1, 1, 1, 2)))
    write(t, "bad_magic", b"\x93NUMPZ" + npy("<f4", (2,))[6:])
    write(t, "bad_version", npy("<f4", (2,), version=(4, 0)))
    write(t, "header_too_long", b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30) + b"{}")
    write(t, "no_newline", npy("<f4", (2,), pad=False))
    write(t, "unterminated", npy("<f4", (2,), dict_text="{'descr': '<f4, 'fortran_order"))
    write(t, "repeated_key", npy("<f4", (2,), dict_text="{'descr': '<f4', 'descr': '<f4', "
                                 "'fortran_order': False, 'shape': (2,), }"))
    write(t, "missing_shape", npy("<f4", (2,), dict_text="{'descr': '<f4', "
                                  "'fortran_order': False, }", payload=b""))
    write(t, "negative_extent", npy("<f4", (2,), dict_text="{'descr': '<f4', "
                                    "'fortran_order': False, 'shape': (-2,), }"))
    write(t, "empty", b"")
    write(t, "magic_only", b"\x93NUMPY")


def cli_case(name, arguments, files):
    data = "\n".join(arguments).encode()
    for contents in files:
        data += SEPARATOR + contents
    write("fuzz_attend_cli", name, data)


def cli_corpus():
    x = npy("<f4", (6, 3))
    xb = npy("<f4", (2, 5, 3))
    x64 = npy("<f8", (4, 2))
    m = npy("<f4", (3, 3))
    mh = npy("<f4", (2, 3, 3))
    m64 = npy("<f8", (2, 2))
    k = npy("<i8", (2,), payload=struct.pack("<2q", 5, 3))
    base = ["--x", "x.npy", "--m", "m.npy", "--f", "f.npy", "--out", "u.npy"]
    cli_case("plain", base, [x, m, m])
    cli_case("scratch_folder", ["--x", "$D/x.npy", "--m", "$D/m.npy", "--f", "$D/f.npy",
                                "--out", "$D/u.npy"], [x, m, m])
    cli_case("every_output", base + ["--lse", "l.npy", "--entropy", "e.npy", "--weights",
                                     "w.npy", "--mask", "causal", "--device", "cpu"], [x, m, m])
    cli_case("heads_batch", base + ["--key-lengths", "k.npy", "--mask", "window:2",
                                    "--device", "reference"], [xb, mh, mh, k])
    cli_case("bias_offset", base + ["--key-bias", "k.npy", "--offset", "k.npy", "--beta", "0.5"],
             [x, m, m, npy("<f4", (3,))])
    cli_case("float64", base + ["--check-finite", "--weights", "w.npy"], [x64, m64, m64])
    cli_case("nan_check", base + ["--check-finite"],
             [npy("<f4", (2, 3), payload=struct.pack("<6f", 1, 2, float("nan"), 0, 1, 2)), m, m])
    cli_case("mixed_precision", base, [x, m64, m])
    cli_case("wrong_shape", base, [x, mh, m])
    cli_case("integer_cloud", base, [k, m, m])
    cli_case("same_output_twice", base + ["--lse", "u.npy"], [x, m, m])
    cli_case("output_named_like_a_temporary", base[:-1] + [".u.npy.tmp.1.2.ab"], [x, m, m])
    cli_case("missing_folder", base[:-1] + ["$D/nowhere/u.npy"], [x, m, m])
    cli_case("bad_mask", base + ["--mask", "window:0"], [x, m, m])
    cli_case("bad_beta", base + ["--beta", "inf"], [x, m, m])
    cli_case("bad_device", base + ["--device", "tpu"], [x, m, m])
    cli_case("missing_input", base, [x])
    cli_case("unknown_option", base + ["--frobnicate"], [x, m, m])
    cli_case("help", ["--help"], [])
    cli_case("bad_key_lengths", base + ["--key-lengths", "k.npy"],
             [xb, m, m, npy("<i8", (2,), payload=struct.pack("<2q", 9, -1))])


def safetensors(entries, payload=None, metadata=None, header_text=None, pad=0):
    """A safetensors file: entries [(name, dtype, shape)] laid out back to back."""
    import json
    sizes = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8}
    header, data, at = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in entries:
        count = math.prod(shape)
        size = count * sizes.get(dtype, 4)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        if dtype == "F32":
            data += struct.pack("<%df" % count, *[math.cos(0.3 * i) for i in range(count)])
        elif dtype == "F64":
            data += struct.pack("<%dd" % count, *[math.sin(0.3 * i) for i in range(count)])
        elif dtype == "F16":
            data += struct.pack("<%de" % count, *[0.25 * i - 1 for i in range(count)])
        else:
            data += bytes((7 * i + 3) % 256 for i in range(size))
        at += size
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text + (data if payload is None else payload)


def safetensors_corpus():
    t = "fuzz_safetensors"
    write(t, "one_f32", safetensors([("w", "F32", (2, 3))]))
    write(t, "every_dtype", safetensors([("a", "F16", (4,)), ("b", "BF16", (2, 2)),
                                         ("c", "F32", (3,)), ("d", "F64", (1, 2))],
                                        metadata={"format": "pt"}, pad=5))
    write(t, "scalar_and_empty", safetensors([("s", "F32", ()), ("e", "F64", (0, 3))]))
    write(t, "unknown_dtype", safetensors([("w", "Q7", (2,))]))
    write(t, "integer_dtype", safetensors([("w", "I64", (2,))]))
    write(t, "short_payload", safetensors([("w", "F32", (4,))], payload=b"\0" * 8))
    write(t, "gap", safetensors([], header_text='{"w":{"dtype":"F32","shape":[1],'
                                '"data_offsets":[4,8]}}', payload=b"\0" * 8))
    write(t, "overlap", safetensors([], header_text='{"a":{"dtype":"F32","shape":[2],'
                                    '"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],'
                                    '"data_offsets":[4,8]}}', payload=b"\0" * 8))
    write(t, "duplicate", safetensors([], header_text='{"a":{"dtype":"F32","shape":[1],'
                                      '"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],'
                                      '"data_offsets":[0,4]}}', payload=b"\0" * 4))
    write(t, "bad_json", safetensors([], header_text='{"a": [1, 2', payload=b""))
    write(t, "huge_length", struct.pack("<Q", 2 ** 62) + b"{}")
    write(t, "empty", b"")


def gguf_string(text):
    data = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_array(element, count, items):
    return struct.pack("<IQ", element, count) + items


# GGUF value types (uint8 0, int8 1, uint16 2, int16 3, uint32 4, int32 5, float32 6, bool 7,
# string 8, array 9, uint64 10, int64 11, float64 12) and tensor types (F32 0, F16 1, Q4_0 2,
# Q4_1 3, Q8_0 8, Q6_K 14, BF16 30).
GGUF_VALUES = [(0, b"\xc8"), (1, b"\xfb"), (2, struct.pack("<H", 60000)),
               (3, struct.pack("<h", -300)), (4, struct.pack("<I", 7)),
               (5, struct.pack("<i", -7)), (6, struct.pack("<f", 0.1)), (7, b"\x01"),
               (8, gguf_string("h\u00e9llo")), (10, struct.pack("<Q", 2 ** 64 - 1)),
               (11, struct.pack("<q", -2 ** 63)), (12, struct.pack("<d", 1e300))]


def gguf(entries=(), tensors=(), version=3, alignment=32, counts=None, pad=True, offsets=None):
    """A GGUF file: entries [(key, type, value bytes)], tensors [(name, extents as stored,
    type, payload bytes)] laid out at aligned offsets (or at offsets[name], to break it)."""
    head = b"".join(gguf_string(k) + struct.pack("<I", t) + v for k, t, v in entries)
    data, infos = b"", b""
    for name, extents, kind, payload in tensors:
        data += b"\0" * (-len(data) % alignment)
        infos += gguf_string(name) + struct.pack("<I", len(extents))
        infos += b"".join(struct.pack("<Q", e) for e in extents)
        infos += struct.pack("<IQ", kind, (offsets or {}).get(name, len(data)))
        data += payload
    tensor_count, entry_count = counts or (len(tensors), len(entries))
    out = b"GGUF" + struct.pack("<IQQ", version, tensor_count, entry_count) + head + infos
    if pad:
        out += b"\0" * (-len(out) % alignment)
    return out + data


def gguf_corpus():
    t = "fuzz_gguf"
    half = lambda value: struct.pack("<e", value)
    q8_0 = half(0.5) + bytes((7 * i) % 256 for i in range(32))
    q4_0 = half(-2.0) + bytes((11 * i + 3) % 256 for i in range(16))
    q4_1 = half(0.25) + half(-1.0) + bytes((13 * i + 5) % 256 for i in range(16))
    f32 = struct.pack("<3f", 1.5, -0.0, float("inf"))
    f16 = struct.pack("<4H", 0x3c00, 0x0001, 0x7c00, 0x7e01)
    bf16 = struct.pack("<2H", 0x3f80, 0xff81)
    tensors = [("f32", [3], 0, f32), ("f16", [2, 2], 1, f16), ("bf16", [2], 30, bf16),
               ("q8_0", [32], 8, q8_0), ("q4_0", [32], 2, q4_0), ("q4_1", [32, 1], 3, q4_1)]
    every = [("t.%d" % kind, kind, value) for kind, value in GGUF_VALUES]
    every += [("a.%d" % kind, 9, gguf_array(kind, 2, value * 2)) for kind, value in GGUF_VALUES]
    every.append(("nested", 9, gguf_array(9, 2, gguf_array(5, 1, struct.pack("<i", 3)) +
                                          gguf_array(8, 1, gguf_string("x")))))
    vocabulary = [("general.architecture", 8, gguf_string("llama")),
                  ("llama.block_count", 4, struct.pack("<I", 1)),
                  ("tokenizer.ggml.tokens", 9, gguf_array(8, 3, gguf_string("<s>") +
                                                          gguf_string("\u0120the") +
                                                          gguf_string(".")))]
    write(t, "every_type_v3", gguf(every, tensors))
    write(t, "every_type_v2", gguf(every, tensors, version=2))
    write(t, "model", gguf(vocabulary, [("token_embd.weight", [32, 2], 8, q8_0 * 2),
                                         ("output_norm.weight", [32], 0, b"\0" * 128)]))
    write(t, "alignment_64", gguf([("general.alignment", 4, struct.pack("<I", 64))], tensors,
                                  alignment=64))
    write(t, "alignment_1", gguf([("general.alignment", 4, struct.pack("<I", 1))], tensors,
                                 alignment=1))
    write(t, "alignment_not_a_power", gguf([("general.alignment", 4, struct.pack("<I", 48))]))
    write(t, "alignment_int32", gguf([("general.alignment", 5, struct.pack("<i", 32))]))
    write(t, "q6_k", gguf([], [("q6", [256], 14, b"\0" * 210), ("w", [1], 0, b"\0" * 4)]))
    write(t, "scalar_and_empty", gguf([], [("s", [], 0, f32[:4]), ("e", [0, 3], 0, b"")]))
    write(t, "no_tensors_no_padding", gguf(vocabulary, pad=False))
    write(t, "truncated_header", gguf(every, tensors)[:200])
    write(t, "truncated_data", gguf(every, tensors)[:-5])
    write(t, "bad_magic", b"GGML" + gguf(vocabulary)[4:])
    write(t, "version_1", b"GGUF" + struct.pack("<III", 1, 0, 0))
    write(t, "big_endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    write(t, "huge_counts", gguf(counts=(2 ** 63, 2 ** 62)))
    write(t, "duplicate_key", gguf([("k", 4, struct.pack("<I", 1))] * 2))
    write(t, "control_bytes_in_names", gguf([("a\0\\b", 4, struct.pack("<I", 1))] * 2,
                                            [("w\n\0", [256], 14, b"\0" * 210)]))
    write(t, "duplicate_tensor", gguf([], [("w", [1], 0, f32[:4]), ("w", [1], 0, f32[:4])]))
    write(t, "unknown_value_type", gguf([("k", 13, b"\0" * 8)]))
    write(t, "unknown_tensor_type", gguf([], [("w", [1], 99, b"\0" * 8)]))
    write(t, "bool_two", gguf([("k", 7, b"\x02")]))
    write(t, "string_past_end", gguf([("k", 8, struct.pack("<Q", 2 ** 40) + b"ab")], pad=False))
    write(t, "array_past_end", gguf([("k", 9, gguf_array(10, 2 ** 60, b"\0" * 8))]))
    write(t, "deep_arrays", gguf([("k", 9, b"".join(struct.pack("<IQ", 9, 1)
                                                     for _ in range(70)))], pad=False))
    write(t, "block_not_multiple", gguf([], [("w", [33], 2, b"\0" * 36)]))
    write(t, "five_dimensions", gguf([], [("w", [1, 1, 1, 1, 1], 0, b"\0" * 4)]))
    write(t, "overflowing_shape", gguf([], [("w", [2 ** 32] * 3, 0, b"\0" * 4)]))
    write(t, "overflowing_shape_beside_zero", gguf([], [("w", [0, 2 ** 62, 4], 0, b"")]))
    write(t, "long_name", gguf([], [("n" * 65, [1], 0, b"\0" * 4)]))
    one = [("a", [2], 0, b"\0" * 8)]
    write(t, "misaligned_offset", gguf([], one, offsets={"a": 4}))
    write(t, "offset_past_end", gguf([], one, offsets={"a": 2 ** 40}))
    two = [("a", [8], 0, b"\0" * 32), ("b", [8], 0, b"\0" * 32)]
    write(t, "overlapping_tensors", gguf([], two, offsets={"b": 0}))
    write(t, "empty", b"")


if __name__ == "__main__":
    for target in ("fuzz_npy", "fuzz_safetensors", "fuzz_gguf", "fuzz_attend_cli"):
        shutil.rmtree(os.path.join(ROOT, target), ignore_errors=True)
    npy_corpus()
    safetensors_corpus()
    gguf_corpus()
    cli_corpus()
