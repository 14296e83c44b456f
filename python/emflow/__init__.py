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
files), ``emflow.gguf`` (GGUF files), ``emflow.model`` (pretrained models: load, run, logits,
greedy generation), ``emflow.torch`` (the PyTorch operators and their gradients, and a drop-in
for torch's scaled_dot_product_attention; imported on demand).
"""
from __future__ import annotations

import numbers
import sys
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _emflow
from ._emflow import cuda_available, machine, max_threads, resolve_device

__version__ = _emflow.__version__
#: True when the extension was built with the CUDA backend.
with_cuda: bool = _emflow.built_with_cuda()

__all__ = [
    "Attention", "Decoded", "DecodingStack", "FlowResult", "Generation", "PhaseDiagram", "Rotary",
    "Route", "attend", "attend_factored", "cuda_available", "flow", "generate", "initial_clouds",
    "machine", "max_threads", "mha_reference", "mha_to_emf", "phase", "resolve_device", "route",
    "route_factored", "Sdpa", "sdpa_attend", "with_cuda",
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


class Sdpa(NamedTuple):
    """What ``sdpa_attend(..., lse=True / entropy=True)`` returns; None where not requested:
    output (B, Hq, Nq, rv), lse and entropy (B, Hq, Nq)."""

    output: Any
    lse: Any = None
    entropy: Any = None


class Route(NamedTuple):
    """Where a call runs, or why it cannot (emflow::route, include/emflow/capability.hpp): what
    ``route`` and ``route_factored`` return. device: "cpu", "cuda" or "reference"; kernel:
    "reference", "cpu_fused", "cpu_bf16", "cuda_fused", "cuda_unfused" or "cuda_tensor_cores";
    computes: "float32" or "float64"; products: "fp32", "tf32", "bf16" or "fp16"; expanded: the
    factored form is first expanded to dense M_h, F_h; reason: why not, when not supported;
    device_missing: not supported only because the device is absent."""

    supported: bool
    device: str
    kernel: str
    computes: str
    products: str
    expanded: bool
    reason: str
    device_missing: bool

    def __str__(self) -> str:
        if not self.supported:
            return "unsupported: " + self.reason
        products = "fp64" if self.computes == "float64" else self.products
        return f"{self.device} {self.kernel} {products}" + (" (expanded)" if self.expanded else "")


def _mask(mask: Mask) -> str:
    """A mask as the library's text, which emflow::parse_mask parses and checks (one parser, its
    errors naming the argument): None, "none", "causal", "window:W", or ("window", W) for
    "window:W" (an integer W; anything else is written as its repr, which the parser refuses)."""
    if mask is None:
        return "none"
    if isinstance(mask, str):
        return mask
    if isinstance(mask, tuple) and len(mask) == 2 and mask[0] == "window":
        width = mask[1]
        if isinstance(width, numbers.Integral) and not isinstance(width, bool):
            return f"window:{int(width)}"
        return f"window:{width!r}"
    raise ValueError(f"argument 'mask' is {mask!r}, expected None, 'causal', 'window:W' or "
                     "('window', W)")


def _integer(operation: str, name: str, value: Any, low: int = -2**63,
             high: int = 2**63 - 1) -> int:
    """An integer argument as a Python int in [low, high] (by default what fits in 64 bits);
    floats, strings and bools are refused rather than truncated or coerced."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{operation}: argument '{name}' must be an integer, got {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{operation}: argument '{name}' must be in [{low}, {high}], got {value}")
    return value


def _length_values(operation: str, key_lengths: Any) -> np.ndarray:
    """Key lengths (a sequence, NumPy array or CPU tensor of integers) as a dense int64 array;
    a float, bool or object entry is refused rather than truncated."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(key_lengths, torch.Tensor):
        key_lengths = key_lengths.detach().cpu().numpy()
    if isinstance(key_lengths, (list, tuple)):
        for i, value in enumerate(key_lengths):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{operation}: argument 'key_lengths' entry {i} is {value!r}, "
                                 "expected an integer (one length per cloud)")
    array = np.asarray(key_lengths)
    if array.size == 0:
        return np.zeros(array.shape, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{operation}: argument 'key_lengths' holds {array.dtype} values "
                         f"({key_lengths!r}), expected integers (one length per cloud)")
    if array.dtype.kind == "u" and int(array.max()) > 2**63 - 1:
        raise ValueError(f"{operation}: argument 'key_lengths' holds {int(array.max())}, which "
                         "does not fit in 64 bits")
    return np.ascontiguousarray(array, dtype=np.int64)


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


def _lengths(operation: str, key_lengths: Any, x: Any, cuda: bool) -> Any:
    """Key lengths as a dense int64 array on the device of 'x' (always converted: it is small)."""
    if key_lengths is None:
        return None
    lengths = _length_values(operation, key_lengths)
    if cuda:
        import torch

        return torch.as_tensor(lengths).to(x.device)
    return lengths


def _dtype_name(a: Any) -> str:
    """"float32", "bfloat16", ...: the dtype of a NumPy array or a torch tensor."""
    return str(a.dtype).replace("torch.", "") if _torch_tensor(a) else np.dtype(a.dtype).name


def _as_array(a: Any) -> Any:
    """An argument that is neither a NumPy array, a torch tensor nor a DLPack object, as a NumPy
    array (a view of anything with the buffer protocol; a list becomes a new array, whose dtype
    is then checked like any other)."""
    if a is None or isinstance(a, np.ndarray) or _torch_tensor(a) or hasattr(a, "__dlpack__"):
        return a
    return np.asarray(a)


def _check_passable(operation: str, name: str, a: Any, expected: str, output: bool = False):
    """Refuses, naming the argument, what the array layer cannot even take (so it would only
    say "incompatible function arguments"): a dtype without a fixed numeric layout (object,
    strings), a byte order that is not the machine's, a read-only output, a torch meta or
    sparse tensor, a tensor that requires grad, and an output that is not an array."""
    if a is None:
        return
    if isinstance(a, np.ndarray):
        if a.dtype.kind not in "biufc":
            raise ValueError(f"{operation}: argument '{name}' has dtype {a.dtype}, expected "
                             f"{expected}; pass copy=True to convert")
        if not a.dtype.isnative:
            raise ValueError(f"{operation}: argument '{name}' has dtype {a.dtype.str} (not the "
                             f"machine's byte order), expected {expected}; pass copy=True to "
                             "convert")
        if output and not a.flags.writeable:
            raise ValueError(f"{operation}: argument '{name}' is read-only; expected a writable "
                             "array")
        return
    if _torch_tensor(a):
        import torch

        if a.device.type == "meta":
            raise ValueError(f"{operation}: argument '{name}' is a meta tensor (it holds no "
                             "data); expected a CPU or CUDA tensor (emflow.route answers from "
                             "shapes alone)")
        if a.layout != torch.strided:
            raise ValueError(f"{operation}: argument '{name}' has layout {a.layout}, expected "
                             "a dense (strided) tensor; pass copy=True to convert")
        if a.requires_grad:
            raise ValueError(f"{operation}: argument '{name}' requires grad, but emflow."
                             f"{operation} has no gradient: pass it detached (emflow.torch."
                             f"{operation} is the operator for autograd graphs)")
        return
    if output:
        raise ValueError(f"{operation}: argument '{name}' is a {type(a).__name__}, expected a "
                         "NumPy array or a torch tensor to write into")


def _route(factored: bool, x: Any, operators: tuple, key_bias: Any, offset: Any, mask: Mask,
           key_lengths: Any, lse: bool, entropy: bool, weights: bool, device: str,
           operation: str) -> Route:
    """emflow::route of the call these arguments describe, from their shapes and dtypes alone."""
    shape = tuple(getattr(x, "shape", np.shape(x)))
    if len(shape) not in (2, 3):
        raise ValueError(f"{operation}: argument 'x' has shape {shape}, expected (N, d) or "
                         "(B, N, d)")
    first = operators[0]
    first_shape = tuple(getattr(first, "shape", np.shape(first)))
    if len(first_shape) not in (2, 3):
        name = "query_factor" if factored else "relevance"
        raise ValueError(f"{operation}: argument '{name}' has shape {first_shape}, expected 2 "
                         "axes, or 3 with the heads first")
    requested = device
    if _torch_tensor(x) and x.device.type == "cuda":
        if device not in ("auto", "cuda"):
            raise ValueError(f"{operation}: argument 'device' is '{device}' but the arrays are "
                             "CUDA arrays")
        requested = "cuda"  # CUDA tensors run on their device, through cuda::attend_async
    storage = _dtype_name(x) if hasattr(x, "dtype") else np.asarray(x).dtype.name
    if storage not in ("float32", "float64"):
        return Route(False, "cpu" if requested == "auto" else requested, "", "", "", False,
                     f"{operation}: argument 'x' has dtype {storage}, expected float32 or "
                     f"float64 (emflow.{operation} computes in the dtype of 'x')", False)
    answer = _emflow.route(factored, storage, "fp32", shape[0] if len(shape) == 3 else 1,
                           shape[-2], shape[-1], first_shape[0] if len(first_shape) == 3 else 1,
                           first_shape[-2] if factored else 0, _mask(mask),
                           key_lengths is not None, key_bias is not None, offset is not None,
                           bool(lse), bool(entropy), bool(weights), requested, operation)
    return Route(*answer)


class Rotary(NamedTuple):
    """Rotary positions of a factored layer (emflow::Rotary, docs/MATH.md §2.4): the first
    ``dim`` coordinates of every projected query and key rotated by its position (key j at j,
    query i at its mask position). pairing: "half_split" (Hugging Face's rotate_half) or
    "interleaved" (GPT-J); scaling: a transformers rope_type, "default", "linear", "dynamic" or
    "llama3" (others are refused by name), with factor, low_freq_factor, high_freq_factor and
    original_max_positions as the config names them; inverse_frequencies: the dim / 2
    frequencies themselves (float64), replacing base and scaling."""
    dim: int
    base: float = 10000.0
    pairing: str = "half_split"
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 0
    inverse_frequencies: Any = None


def _rotary_arguments(kv_heads: int, rotary: Optional[Rotary]) -> tuple:
    """The trailing arguments of _emflow.attend_factored."""
    r = rotary if rotary is not None else Rotary(0)
    frequencies = r.inverse_frequencies
    if frequencies is not None:
        frequencies = np.ascontiguousarray(np.asarray(frequencies, dtype=np.float64))
    return (_integer("attend_factored", "kv_heads", kv_heads),
            _integer("attend_factored", "rotary.dim", r.dim), float(r.base), str(r.pairing),
            str(r.scaling), float(r.factor), float(r.low_freq_factor), float(r.high_freq_factor),
            _integer("attend_factored", "rotary.original_max_positions",
                     r.original_max_positions), frequencies)


def _run(dense: bool, x: Any, operators: tuple, key_bias: Any, offset: Any, beta: float,
         mask: Mask, key_lengths: Any, lse: bool, entropy: bool, weights: bool, device: str,
         threads: int, out: Any, copy: bool, stream: Any, rotary_arguments: tuple = ()) -> Any:
    operation = "attend" if dense else "attend_factored"
    mask_text = _mask(mask)
    threads = _integer(operation, "threads", threads)
    is_torch = type(x) is not np.ndarray and _torch_tensor(x)
    if not is_torch and type(x) is not np.ndarray:
        x = np.asarray(x)
    operators = tuple(_as_array(a) for a in operators)
    key_bias, offset = _as_array(key_bias), _as_array(offset)
    if copy:
        if not is_torch and x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float64)
        x = _converted(x, x, is_torch)
        operators = tuple(_converted(a, x, is_torch) for a in operators)
        key_bias = _converted(key_bias, x, is_torch)
        offset = _converted(offset, x, is_torch)
    _check_passable(operation, "x", x, "float32 or float64")
    names = ("relevance", "content") if dense else ("query_factor", "key_factor", "content_up",
                                                    "content_down")
    like = f"{_dtype_name(x)} (the dtype of 'x')"
    for name, a in zip(names + ("key_bias", "offset"), operators + (key_bias, offset)):
        _check_passable(operation, name, a, like)
    _check_passable(operation, "out", out, like, output=True)
    cuda = is_torch and x.is_cuda
    lengths = _lengths(operation, key_lengths, x, cuda)
    stream_handle = 0
    allocate = None
    if is_torch:
        import torch

        if cuda:
            # Where the call runs on the GPU, asked of the library before any output exists.
            where = _route(not dense, x, operators, key_bias, offset, mask, key_lengths, lse,
                           entropy, weights, device, operation)
            if not where.supported:
                raise NotImplementedError(where.reason)
            if not dense and rotary_arguments and (rotary_arguments[0] or rotary_arguments[1]):
                raise NotImplementedError(f"{operation}: rotary positions and grouped kv heads "
                                          "run on the GPU's tensor cores through the C++ API "
                                          "(cuda::attend_factored_async), which the Python "
                                          "package does not call yet; run on the host")
            if not dense:
                if not where.expanded:
                    raise NotImplementedError(f"{operation}: {where} runs through "
                                              "cuda::attend_factored_async, which the Python "
                                              "package does not call yet")
                # The route expands the layer to dense M_h = A_h^T B_h and F_h = U_h V_h: done
                # on the stream, then the dense update.
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
        _emflow.attend(x, operators[0], operators[1], key_bias, offset, beta, mask_text, lengths,
                       update, lse_out, entropy_out, weights_out, device, threads, stream_handle,
                       allocate)
    else:
        _emflow.attend_factored(x, *operators, key_bias, offset, beta, mask_text, lengths, update,
                                lse_out, entropy_out, weights_out, device, threads,
                                *rotary_arguments)
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
                    stream: Any = None, kv_heads: int = 0, rotary: Optional[Rotary] = None) -> Any:
    """The update of a layer in factored form (emflow::attend_factored, docs/MATH.md §2).

    Per head h with rank r: M_h = A_h^T B_h and F_h = U_h V_h, i.e. s_ij = beta (<A_h x_i,
    B_h x_j> + u_h^T x_j) and F_h x_j = U_h (V_h x_j): QKV attention with queries A x, keys B x,
    values V x and output projection U. query_factor A, key_factor B: (H, r, d) (or (r, d));
    content_up U: (H, d, r); content_down V: (H, r, d). Everything else as for ``attend``.

    On the CPU, float32 input is computed in float32 in the factored form (2 N^2 r per head
    instead of 2 N^2 d); float64 input is expanded and computed by the double reference. torch
    CUDA tensors are expanded to dense M_h, F_h on the stream and run by the CUDA backend.

    kv_heads (grouped-query heads, §2.4): key_factor and content_down hold (kv_heads, r, d)
    and query head h reads kv head h // (H // kv_heads); 0 means H. rotary: a ``Rotary``.
    Both run on the host (float32 in the factored engine, float64 in the double reference of
    the factored form); CUDA tensors with either are refused (the GPU's tensor-core path for them
    is C++ only).
    """
    return _run(False, x, (query_factor, key_factor, content_up, content_down), key_bias,
                offset, beta, mask, key_lengths, lse, entropy, weights, device, threads, out,
                copy, stream, _rotary_arguments(kv_heads, rotary))


def route(x: Any, relevance: Any, content: Any, *, key_bias: Any = None, offset: Any = None,
          mask: Mask = None, key_lengths: Any = None, lse: bool = False, entropy: bool = False,
          weights: bool = False, device: str = "auto") -> Route:
    """Where ``attend`` with these arguments runs (device, kernel, the precision of its
    products), or why it cannot: the library's capability function, emflow::route
    (include/emflow/capability.hpp), which every entry point asks.

    The arguments are those of ``attend``, read for their shapes and dtypes only (no data is
    touched: torch meta tensors and anything with ``shape`` and ``dtype`` do); the arrays are
    still checked by ``attend`` itself. torch CUDA tensors are asked about on "cuda", as
    ``attend`` runs them. Non-finite values, which send a CPU call to the reference, are not
    looked for. Returns a ``Route``; ``str(route)`` reads e.g. "cpu cpu_fused fp32"::

        r = emflow.route(x, m, f, weights=True, device="cuda")
        if not r.supported:
            print(r.reason)
    """
    return _route(False, x, (relevance, content), key_bias, offset, mask, key_lengths, lse,
                  entropy, weights, device, "attend")


def route_factored(x: Any, query_factor: Any, key_factor: Any, content_up: Any,
                   content_down: Any, *, key_bias: Any = None, offset: Any = None,
                   mask: Mask = None, key_lengths: Any = None, lse: bool = False,
                   entropy: bool = False, weights: bool = False, device: str = "auto") -> Route:
    """``route`` for ``attend_factored`` (rank r from query_factor's shape (H, r, d))."""
    return _route(True, x, (query_factor, key_factor, content_up, content_down), key_bias,
                  offset, mask, key_lengths, lse, entropy, weights, device, "attend_factored")


def sdpa_attend(query: Any, key: Any, value: Any, *, scale: Optional[float] = None,
                mask: Mask = None, key_lengths: Any = None, query_lengths: Any = None,
                key_position: int = 0, query_position: Optional[int] = None, lse: bool = False,
                entropy: bool = False, device: str = "auto", threads: int = 0,
                precision: str = "fp32", stream: Any = None) -> Any:
    """The SDPA-shaped operator (emflow::sdpa_attend, include/emflow/sdpa.hpp, docs/MATH.md
    §8.1): queries, keys and values already projected, the shape of torch's
    scaled_dot_product_attention::

        s_ij = scale <q_i, k_j>   (j visible to i)     o_i = sum_j softmax_j(s_ij) v_j

    query (B, Hq, Nq, r), key (B, Hkv, Nk, r), value (B, Hkv, Nk, rv): NumPy arrays (or CPU
    torch tensors) of float32, float64, float16 or (torch) bfloat16, read without a copy (the
    16-bit types accumulate in float32 and return lse and entropy in float32); Hq a multiple of Hkv (grouped
    heads: query head h reads key and value head h // (Hq // Hkv)). scale: 1 / sqrt(r) by
    default. mask: None, "causal" or ("window", w) on sequence positions: key j at
    ``key_position + j``, query i at ``query_position + i``, or by default (None) aligned
    bottom-right, at key_position + Lk_b - Lq_b + i (torch's is_causal is query_position=0).
    key_lengths, query_lengths: one length per cloud (keys j >= Lk_b hidden, queries i >= Lq_b
    padding). A query that sees no key gets output 0, lse -inf and entropy 0.

    Returns the output, or an ``Sdpa`` (output, lse, entropy) when lse or entropy is requested.
    CUDA torch tensors run on the GPU (emflow::cuda::sdpa_attend_async on ``stream``, the
    current torch stream by default, without synchronising): bfloat16 and float16, or float32
    with ``precision="tf32"`` (TF32 products), on the tensor cores with value rank equal to the
    rank, at most 256; float32 with ``precision="fp32"`` on the float32 kernel (float products,
    rank and value rank at most 128). No GPU has run this path yet (docs/CUDA.md). Gradients:
    ``emflow.torch.sdpa_attend``.
    """
    operation = "sdpa_attend"
    arrays = [_as_array(a) for a in (query, key, value)]
    for name, a in zip(("query", "key", "value"), arrays):
        _check_passable(operation, name, a, "float32, float64, bfloat16 or float16")
        if getattr(a, "ndim", None) != 4:
            raise ValueError(f"{operation}: argument '{name}' has shape "
                             f"{tuple(np.shape(a))}, expected 4 axes (B, H, N, E)")
    query, key, value = arrays
    if scale is None:
        scale = 1.0 / float(np.sqrt(query.shape[-1]))
    is_torch = _torch_tensor(query)
    cuda = is_torch and query.is_cuda
    stream_handle, allocate = 0, None
    if is_torch:
        import torch

        empty = partial(torch.empty, dtype=query.dtype, device=query.device)
        if cuda:
            stream_handle, allocate = _cuda_stream(torch, query, stream)
    else:
        empty = partial(np.empty, dtype=query.dtype)
    output = empty(tuple(query.shape[:-1]) + (value.shape[-1],))
    stats = tuple(query.shape[:-1])
    if _dtype_name(query) in ("bfloat16", "float16"):  # emflow::Stat<T>: float32
        stats_dtype = torch.float32 if is_torch else np.float32
        empty = partial(empty, dtype=stats_dtype)
    lse_out = empty(stats) if lse else None
    entropy_out = empty(stats) if entropy else None
    position = None if query_position is None else _integer(operation, "query_position",
                                                            query_position)
    _emflow.sdpa_attend(query, key, value, float(scale), _mask(mask),
                        _lengths(operation, key_lengths, query, cuda),
                        _lengths(operation, query_lengths, query, cuda),
                        _integer(operation, "key_position", key_position), position, output,
                        lse_out, entropy_out, device, _integer(operation, "threads", threads),
                        precision, stream_handle, allocate)
    return Sdpa(output, lse_out, entropy_out) if lse or entropy else output


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
    return _emflow.mha_to_emf(_integer("mha_to_emf", "heads", heads), _double(query),
                              _double(key), _double(value), _double(output), _double(query_bias),
                              _double(key_bias), _double(value_bias), _double(output_bias))


def mha_reference(cloud: Any, query: Any, key: Any, value: Any, output: Any, *, heads: int,
                  query_bias: Any = None, key_bias: Any = None, value_bias: Any = None,
                  output_bias: Any = None, mask: Mask = None,
                  key_lengths: Optional[Sequence[int]] = None) -> np.ndarray:
    """Plain multi-head attention computed the usual way, in float64 (emflow::mha_reference):
    the sub-layer's output without the residual, the cloud's shape. A query that sees no key
    gets 0 (not b_O), the EMF convention. Weights as for ``mha_to_emf``."""
    lengths = [] if key_lengths is None else _length_values("mha_reference", key_lengths).tolist()
    return _emflow.mha_reference(_integer("mha_reference", "heads", heads), _double(query),
                                 _double(key), _double(value), _double(output),
                                 _double(query_bias), _double(key_bias), _double(value_bias),
                                 _double(output_bias), _double(cloud), _mask(mask), lengths)


from ._flow import FlowResult, PhaseDiagram, flow, initial_clouds, phase  # noqa: E402
from ._generate import Decoded, DecodingStack, Generation, generate  # noqa: E402
from . import io, reference  # noqa: E402
from . import gguf  # noqa: E402
