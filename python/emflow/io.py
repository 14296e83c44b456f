"""Array files through the library (emflow/io.hpp): NumPy .npy, float32 / float64 / int64, C
order, little endian, rank 1 to 4. Writes are atomic: a temporary file beside the target is
renamed into place, so a failed write leaves no partial file. Errors: RuntimeError (io) or
ValueError with the library's message."""
from __future__ import annotations

import os
from typing import Any, Union

import numpy as np

from . import _emflow

PathLike = Union[str, "os.PathLike[str]"]


def read_npy(path: PathLike) -> np.ndarray:
    """Reads a .npy file (float32, float64, int32 or int64) as a NumPy array of its dtype
    (int32 as int64); Fortran order, big endian, other dtypes or ranks are refused."""
    return _emflow.read_npy(os.fspath(path))


def write_npy(path: PathLike, array: Any) -> None:
    """Writes a float32, float64 or int64 array of rank 1 to 4 as .npy, atomically."""
    array = np.asarray(array)
    if array.dtype == np.int32:
        array = array.astype(np.int64)
    _emflow.write_npy(os.fspath(path), np.ascontiguousarray(array))
