"""emflow: EMF attention and the flow of token clouds, from Python.

A thin layer over the C++ library's public API (include/emflow). Array arguments are NumPy
arrays, anything with the buffer protocol, or torch tensors (CPU, and CUDA for ``attend``):
emflow reads and writes their memory in place, without a copy. An argument of the wrong dtype,
shape, device or layout is refused with a ValueError naming it, unless ``copy=True`` asks for
the copy. Computation runs with the GIL released.

Errors of the library (emflow::Error) become Python exceptions with the library's message:

* invalid_argument: ValueError
* out_of_memory: MemoryError
* unsupported (e.g. no CUDA device): NotImplementedError
* io, device, internal: RuntimeError

Submodules: ``emflow.reference`` (the double-precision ground truth), ``emflow.io`` (.npy
files), ``emflow.gguf`` (GGUF files), ``emflow.torch`` (the PyTorch operator, imported on
demand).
"""
from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _emflow
from ._emflow import cuda_available, resolve_device

__version__ = _emflow.__version__
#: True when the extension was built with the CUDA backend.
with_cuda: bool = _emflow.built_with_cuda()

__all__ = [
    "Attention", "Decoded", "DecodingStack", "FlowResult", "Generation", "PhaseDiagram", "attend",
    "attend_factored", "cuda_available", "flow", "generate", "initial_clouds", "mha_reference",
    "mha_to_emf", "phase", "resolve_device", "with_cuda",
]

Mask = Union[None, str, tuple]


class Attention(NamedTuple):
    """What ``attend(..., lse=True / entropy=True / weights=True)`` returns; None where not
    requested. Shapes (with B and H dropped when 'x' / the operators have no such axis):
    update (B, N, d), lse and entropy (B, H, N), weights (B, H, N, N)."""

    update: Any
    lse: Any = None
    entropy: Any = None
    weights: Any = None


def _mask(mask: Mask) -> tuple[int, int]:
    """(kind, window) of a mask: None / "none", "causal", ("window", w) or "window:w"."""
    if mask is None or mask == "none":
        return 0, 0
    if mask == "causal":
        return 1, 0
    if isinstance(mask, tuple) and len(mask) == 2 and mask[0] == "window":
        return 2, int(mask[1])
    if isinstance(mask, str) and mask.startswith("window:") and mask[7:].isdigit():
        return 2, int(mask[7:])
    raise ValueError(f"argument 'mask' is {mask!r}, expected None, 'causal' or ('window', w)")


def _torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _converted(a: Any, like: Any, is_torch: bool) -> Any:
    """`a` as a dense array of the dtype of `like` (the copy=True path)."""
    if a is None:
        return None
    if is_torch:
        import torch

        if not isinstance(a, torch.Tensor):
            a = torch.as_tensor(np.asarray(a), device=like.device)
        return a.to(dtype=like.dtype).contiguous()
    return np.ascontiguousarray(a, dtype=like.dtype)


def _lengths(key_lengths: Any, x: Any, is_torch: bool, cuda: bool) -> Any:
    """Key lengths as a dense int64 array on the device of 'x' (always converted: it is small)."""
    if key_lengths is None:
        return None
    if cuda:
        import torch

        return torch.as_tensor(key_lengths, dtype=torch.int64).to(x.device)
    if is_torch and isinstance(key_lengths, sys.modules["torch"].Tensor):
        key_lengths = key_lengths.cpu()
    return np.ascontiguousarray(key_lengths, dtype=np.int64)


def _run(dense: bool, x: Any, operators: tuple, key_bias: Any, offset: Any, beta: float,
         mask: Mask, key_lengths: Any, lse: bool, entropy: bool, weights: bool, device: str,
         threads: int, out: Any, copy: bool, stream: Any) -> Any:
    kind, window = (0, 0) if mask is None else _mask(mask)
    is_torch = type(x) is not np.ndarray and _torch_tensor(x)
    if not is_torch and type(x) is not np.ndarray:
        x = np.asarray(x)
    if copy:
        if not is_torch and x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        x = _converted(x, x, is_torch)
        operators = tuple(_converted(a, x, is_torch) for a in operators)
        key_bias = _converted(key_bias, x, is_torch)
        offset = _converted(offset, x, is_torch)
    cuda = is_torch and x.is_cuda
    lengths = None if key_lengths is None else _lengths(key_lengths, x, is_torch, cuda)
    stream_handle = 0
    allocate = None
    if is_torch:
        import torch

        if cuda:
            if not dense:
                # No stream-ordered factored form in the C++ API: expand to dense M_h = A_h^T B_h
                # and F_h = U_h V_h on the stream, then the dense update.
                a, b, u, v = operators
                with torch.cuda.stream(_external_stream(torch, x, stream)):
                    operators = (a.transpose(-1, -2) @ b, u @ v)
                dense = True
            stream_handle, allocate = _cuda_stream(torch, x, stream)
        empty = partial(torch.empty, dtype=x.dtype, device=x.device)
    else:
        empty = partial(np.empty, dtype=x.dtype)
    update = empty(x.shape) if out is None else out
    lse_out = entropy_out = weights_out = None
    extras = lse or entropy or weights
    if extras:
        shape = x.shape
        per_head = [] if len(shape) != 3 else [shape[0]]
        if getattr(operators[0], "ndim", 0) == 3:
            per_head.append(operators[0].shape[0])
        per_head.append(shape[-2] if len(shape) >= 2 else 0)
        lse_out = empty(per_head) if lse else None
        entropy_out = empty(per_head) if entropy else None
        weights_out = empty(per_head + [shape[-2]]) if weights else None
    if dense:
        _emflow.attend(x, operators[0], operators[1], key_bias, offset, beta, kind, window,
                       lengths, update, lse_out, entropy_out, weights_out, device, threads,
                       stream_handle, allocate)
    else:
        _emflow.attend_factored(x, *operators, key_bias, offset, beta, kind, window, lengths,
                                update, lse_out, entropy_out, weights_out, device, threads)
    if extras:
        return Attention(update, lse_out, entropy_out, weights_out)
    return update


def _external_stream(torch: Any, x: Any, stream: Any) -> Any:
    if stream is None:
        return torch.cuda.current_stream(x.device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(int(stream), device=x.device)


def _cuda_stream(torch: Any, x: Any, stream: Any) -> tuple[int, Callable[[int], Any]]:
    """The stream handle to enqueue on and a workspace allocator (torch's caching allocator,
    the block tied to that stream so it is not reused before the work is done)."""
    current = torch.cuda.current_stream(x.device)
    target = _external_stream(torch, x, stream)

    def allocate(nbytes: int) -> Any:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        if target.cuda_stream != current.cuda_stream:
            workspace.record_stream(target)
        return workspace

    return target.cuda_stream, allocate


def attend(x: Any, relevance: Any, content: Any, *, key_bias: Any = None, offset: Any = None,
           beta: float = 1.0, mask: Mask = None, key_lengths: Any = None, lse: bool = False,
           entropy: bool = False, weights: bool = False, device: str = "auto", threads: int = 0,
           out: Any = None, copy: bool = False, stream: Any = None) -> Any:
    """The EMF contextual update (emflow::attend, docs/MATH.md §1).

    For clouds X_b (N x d) and H heads (M_h, F_h, u_h) plus one offset c::

        s_ij    = beta * (x_i^T M_h x_j + u_h^T x_j)          (-inf where masked)
        p_ij    = softmax_j(s_ij)                             lse_i = log sum_j exp(s_ij)
        H_i     = lse_i - sum_j p_ij s_ij                     (attention entropy, nats)
        delta_i = sum_h sum_j p^h_ij F_h x_j + c              (0 for a query with no visible key)

    x: (N, d) or (B, N, d), float32 or float64. relevance, content: M and F, (H, d, d) or (d, d)
    for one head. key_bias: u, (H, d) (or (d)); offset: c, (d); both optional, the dtype of x.
    mask: None, "causal" or ("window", w) (keys i - w < j <= i). key_lengths: one length L_b
    in [0, N] per cloud; keys j >= L_b are hidden and queries i >= L_b are padding (update 0,
    lse -inf). device: "auto", "cpu", "cuda" or "reference"; threads: CPU threads, 0 chooses.

    Returns the update (the type of x: NumPy array or torch tensor), or an ``Attention``
    (update, lse, entropy, weights) when any of lse / entropy / weights is requested.
    out: an array of the update's shape and dtype to write into (returned). copy=True converts
    arguments of another dtype or a non-contiguous layout instead of refusing them.

    torch CUDA tensors run through emflow::cuda::attend_async on the caller's current torch
    stream (or ``stream``: a torch.cuda.Stream or a cudaStream_t as an int), with the workspace
    from torch's caching allocator; nothing synchronises the device. float32 on the CPU and
    CUDA backends, float64 in double; Device "reference" computes in double. Host arrays with
    device="cuda" are copied to the GPU and back by the blocking emflow::attend.
    """
    return _run(True, x, (relevance, content), key_bias, offset, beta, mask, key_lengths, lse,
                entropy, weights, device, threads, out, copy, stream)


def attend_factored(x: Any, query_factor: Any, key_factor: Any, content_up: Any,
                    content_down: Any, *, key_bias: Any = None, offset: Any = None,
                    beta: float = 1.0, mask: Mask = None, key_lengths: Any = None,
                    lse: bool = False, entropy: bool = False, weights: bool = False,
                    device: str = "auto", threads: int = 0, out: Any = None, copy: bool = False,
                    stream: Any = None) -> Any:
    """The update of a layer in factored form (emflow::attend_factored, docs/MATH.md §2).

    Per head h with rank r: M_h = A_h^T B_h and F_h = U_h V_h, i.e. s_ij = beta (<A_h x_i,
    B_h x_j> + u_h^T x_j) and F_h x_j = U_h (V_h x_j): QKV attention with queries A x, keys B x,
    values V x and output projection U. query_factor A, key_factor B: (H, r, d) (or (r, d));
    content_up U: (H, d, r); content_down V: (H, r, d). Everything else as for ``attend``.

    On the CPU, float32 input is computed in float32 in the factored form (2 N^2 r per head
    instead of 2 N^2 d); float64 input is expanded and computed by the double reference. torch
    CUDA tensors are expanded to dense M_h, F_h on the stream and run by the CUDA backend.
    """
    return _run(False, x, (query_factor, key_factor, content_up, content_down), key_bias,
                offset, beta, mask, key_lengths, lse, entropy, weights, device, threads, out,
                copy, stream)


def _double(a: Any) -> Any:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float64)


def mha_to_emf(query: Any, key: Any, value: Any, output: Any, *, heads: int,
               query_bias: Any = None, key_bias: Any = None, value_bias: Any = None,
               output_bias: Any = None) -> tuple:
    """The EMF layer equal to a multi-head attention sub-layer (emflow::to_emf,
    docs/MATH.md §3), in float64: (relevance (H, d, d), content (H, d, d), key_bias (H, d),
    offset (d)), always present (zero where the biases are absent)::

        M_h = W_Q,h^T W_K,h / sqrt(d_k)     u_h = W_K,h^T b_Q,h / sqrt(d_k)
        F_h = W_O,h W_V,h                   c   = sum_h W_O,h b_V,h + b_O

    query, key: W_Q, W_K (H*d_k, d); value: W_V (H*d_v, d); output: W_O (d, H*d_v), heads
    stacked along the rows as torch.nn.MultiheadAttention stores them. Biases optional.
    With beta = 1, ``reference.attend(x, *mha_to_emf(...))`` equals ``mha_reference``.
    """
    return _emflow.mha_to_emf(heads, _double(query), _double(key), _double(value),
                              _double(output), _double(query_bias), _double(key_bias),
                              _double(value_bias), _double(output_bias))


def mha_reference(cloud: Any, query: Any, key: Any, value: Any, output: Any, *, heads: int,
                  query_bias: Any = None, key_bias: Any = None, value_bias: Any = None,
                  output_bias: Any = None, mask: Mask = None,
                  key_lengths: Optional[Sequence[int]] = None) -> np.ndarray:
    """Plain multi-head attention computed the usual way, in float64 (emflow::mha_reference):
    the sub-layer's output without the residual, the cloud's shape. A query that sees no key
    gets 0 (not b_O), the EMF convention. Weights as for ``mha_to_emf``."""
    kind, window = _mask(mask)
    return _emflow.mha_reference(heads, _double(query), _double(key), _double(value),
                                 _double(output), _double(query_bias), _double(key_bias),
                                 _double(value_bias), _double(output_bias), _double(cloud),
                                 kind, window, list(key_lengths or []))


from ._flow import FlowResult, PhaseDiagram, flow, initial_clouds, phase  # noqa: E402
from ._generate import Decoded, DecodingStack, Generation, generate  # noqa: E402
from . import io, reference  # noqa: E402
from . import gguf  # noqa: E402
