"""GGUF files through the library (emflow/gguf.hpp): the single-file format of llama.cpp, in
which most quantized LLMs are distributed. Versions 2 and 3, little endian, read strictly: a
malformed file is refused with a RuntimeError naming the file and the key or tensor at fault
(MemoryError for what cannot fit). Tensors of type F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are
dequantized to float32 exactly as the ``gguf`` package's ``gguf.quants.dequantize`` computes
them, bit for bit; reading a tensor of another type is refused naming it.

    model = emflow.gguf.File("SmolLM2-135M-Instruct.Q4_1.gguf")
    model.metadata["llama.block_count"]         # 30
    model.tokens[504]                            # a token string as stored, e.g. "The"
    model.detokenize([504, 3575])                # "The capital"
    embedding = model.read("token_embd.weight")  # float32, shape (49152, 576)

Metadata values: integers int, float32 and float64 float, bools bool, strings str (bytes that
are not UTF-8 kept as surrogates: ``s.encode("utf-8", "surrogateescape")`` gives them back),
arrays of numbers or bools a NumPy array of their type, arrays of strings or of arrays a list.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Union

import numpy as np

from . import _emflow

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["File", "TensorInfo", "dequantize", "types"]


class TensorInfo(NamedTuple):
    """One tensor as the file declares it. shape is row-major (the file's extents reversed, as
    numpy and the gguf package's ``tensor.data`` have it); offset is in bytes from the start of
    the data section; nbytes the bytes of its data."""

    name: str
    type: str
    shape: tuple
    offset: int
    nbytes: int


class File:
    """A GGUF file: its metadata and tensor infos are read and checked when it is opened, its
    tensors on demand (``read``)."""

    def __init__(self, path: PathLike) -> None:
        self._file = _emflow.GgufFile(os.fspath(path))
        entries = self._file.metadata()
        #: key -> value, in file order.
        self.metadata: dict[str, Any] = {key: value for key, _, _, value in entries}
        #: key -> (type, element type or None): "uint32", ("array", "string"), ...
        self.types: dict[str, tuple] = {key: (kind, element) for key, kind, element, _ in entries}
        #: The tensors, in file order.
        self.tensors: list[TensorInfo] = [TensorInfo(*t) for t in self._file.tensors()]
        self._index = {t.name: t for t in self.tensors}

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def version(self) -> int:
        """2 or 3."""
        return self._file.version

    @property
    def alignment(self) -> int:
        """general.alignment, or 32."""
        return self._file.alignment

    @property
    def data_offset(self) -> int:
        """Bytes from the start of the file to the data section."""
        return self._file.data_offset

    @property
    def tokens(self) -> list:
        """The vocabulary (tokenizer.ggml.tokens: token id i is element i), the token strings as
        stored; an empty list when the file has none."""
        return list(self.metadata.get("tokenizer.ggml.tokens", []))

    def detokenize(self, ids: Any) -> str:
        """The text of token ids as the vocabulary's tokenizer spells its tokens (GPT-2's
        byte-level "Ġ" a space, SentencePiece's "▁" a space and "<0xNN>" a byte); bytes that do
        not form UTF-8 (a token may hold part of a character) become U+FFFD."""
        ids = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        return self._file.detokenize(ids).decode("utf-8", errors="replace")

    def tensor(self, name: str) -> TensorInfo:
        """The info of tensor `name` (KeyError when absent)."""
        return self._index[name]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to a float32 array of its row-major shape."""
        return self._file.read(name)


def dequantize(type: str, blocks: Any, count: int) -> np.ndarray:
    """`count` elements of the tensor type named `type` ("Q4_1", "F16", ...) from their stored
    bytes (a uint8 array or bytes), dequantized to float32 as ``File.read`` does."""
    data = np.frombuffer(blocks, dtype=np.uint8) if isinstance(blocks, (bytes, bytearray)) \
        else np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    return _emflow.gguf_dequantize(type, data, int(count))


def types() -> list:
    """[(code, name, block size, block bytes, dequantized)] for every tensor type emflow knows
    (ggml's numbers and sizes)."""
    return _emflow.gguf_types()
