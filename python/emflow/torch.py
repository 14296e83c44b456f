"""emflow as PyTorch operators, with their gradients.

* ``scaled_dot_product_attention``: a drop-in for torch.nn.functional.scaled_dot_product_attention
  (torch's names, layout (B, H, N, E) and semantics) over the operator ``emflow::sdpa``;
  ``sdpa_attend`` is the same operator with emflow's own options (key lengths, windows, query
  positions) and its lse.
* ``attend`` and ``attend_factored``: the operators ``emflow::attend`` and
  ``emflow::attend_factored``.

Each is registered with torch.library.custom_op, a fake (meta) implementation and
torch.library.register_autograd, so it trains and runs under torch.compile (fullgraph) and in
traced graphs without graph breaks. The forward pass saves its inputs (and, for the SDPA-shaped
operator, its output and lse), never the N x N weights; the backward pass is the C++ backward
(include/emflow/sdpa.hpp, include/emflow/backward.hpp) behind its own custom operators
(``emflow::sdpa_backward``, ``emflow::attend_backward``, ``emflow::attend_factored_backward``),
also with fake implementations. beta and scale are Python floats: they take no gradient. The
gradient through ``weights`` is not computed (a loss that depends on them is refused by name).

CUDA tensors: the SDPA-shaped operator runs forward and backward on the GPU (through
emflow::cuda::sdpa_attend_async and sdpa_backward_async on the current torch stream, the backward
adding dQ by atomics unless torch.use_deterministic_algorithms(True) asks for the kernels that
give the same bits run to run; float32's
forward has TF32 products on the tensor cores where torch.backends.cuda.matmul.allow_tf32 allows
them, else float products on the float32 kernel, rank and value rank at most 128), ``attend`` and
``attend_factored`` their forward pass only (emflow::cuda::attend_async), a gradient through them
raising NotImplementedError. No GPU has run these paths yet (docs/CUDA.md). Inputs
are made contiguous first (a no-op for contiguous tensors) and must share the dtype of x (or of
query): float32 or float64. Queries that see no key get a zero gradient.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch

import emflow as _emflow

__all__ = ["attend", "attend_factored", "scaled_dot_product_attention", "sdpa_attend"]

Tensor = torch.Tensor


def _per_head(x: Tensor, operator: Tensor) -> list:
    shape = [x.shape[0]] if x.dim() == 3 else []
    if operator.dim() == 3:
        shape.append(operator.shape[0])
    return shape + [x.shape[-2]]


def _outputs(result: Any, x: Tensor, want_lse: bool, want_entropy: bool,
             want_weights: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # Distinct empty tensors: the outputs of a custom operator may not alias one another.
    if not (want_lse or want_entropy or want_weights):
        return result, x.new_empty(0), x.new_empty(0), x.new_empty(0)
    return (result.update, result.lse if want_lse else x.new_empty(0),
            result.entropy if want_entropy else x.new_empty(0),
            result.weights if want_weights else x.new_empty(0))


def _fake(x: Tensor, operator: Tensor, want_lse: bool, want_entropy: bool,
          want_weights: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    per_head = _per_head(x, operator)
    return (x.new_empty(x.shape), x.new_empty(per_head if want_lse else [0]),
            x.new_empty(per_head if want_entropy else [0]),
            x.new_empty(per_head + [x.shape[-2]] if want_weights else [0]))


def _lengths(key_lengths: Optional[Tensor]) -> Optional[Tensor]:
    # Integer lengths of any width become int64; a float tensor is left for emflow.attend to
    # refuse (never truncated).
    if key_lengths is None or key_lengths.dtype.is_floating_point:
        return key_lengths
    return key_lengths.to(torch.int64).contiguous()


def _dense(a: Optional[Tensor]) -> Optional[Tensor]:
    # Detached: the operators compute values only (their gradients are the backward operators'),
    # and emflow.attend refuses tensors that require grad.
    return None if a is None else a.detach().contiguous()


@torch.library.custom_op("emflow::attend", mutates_args=())
def _attend_op(x: Tensor, relevance: Tensor, content: Tensor, key_bias: Optional[Tensor],
               offset: Optional[Tensor], key_lengths: Optional[Tensor], beta: float, mask: str,
               want_lse: bool, want_entropy: bool, want_weights: bool, device: str, threads: int
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    result = _emflow.attend(_dense(x), _dense(relevance), _dense(content),
                            key_bias=_dense(key_bias), offset=_dense(offset), beta=beta,
                            mask=mask, key_lengths=_lengths(key_lengths),
                            lse=want_lse, entropy=want_entropy, weights=want_weights,
                            device=device, threads=threads)
    return _outputs(result, x, want_lse, want_entropy, want_weights)


@_attend_op.register_fake
def _attend_fake(x, relevance, content, key_bias, offset, key_lengths, beta, mask, want_lse,
                 want_entropy, want_weights, device, threads):
    return _fake(x, relevance, want_lse, want_entropy, want_weights)


@torch.library.custom_op("emflow::attend_factored", mutates_args=())
def _attend_factored_op(x: Tensor, query_factor: Tensor, key_factor: Tensor, content_up: Tensor,
                        content_down: Tensor, key_bias: Optional[Tensor],
                        offset: Optional[Tensor], key_lengths: Optional[Tensor], beta: float,
                        mask: str, want_lse: bool, want_entropy: bool, want_weights: bool,
                        device: str, threads: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    result = _emflow.attend_factored(
        _dense(x), _dense(query_factor), _dense(key_factor), _dense(content_up),
        _dense(content_down), key_bias=_dense(key_bias),
        offset=_dense(offset), beta=beta, mask=mask,
        key_lengths=_lengths(key_lengths), lse=want_lse, entropy=want_entropy,
        weights=want_weights, device=device, threads=threads)
    return _outputs(result, x, want_lse, want_entropy, want_weights)


@_attend_factored_op.register_fake
def _attend_factored_fake(x, query_factor, key_factor, content_up, content_down, key_bias,
                          offset, key_lengths, beta, mask, want_lse, want_entropy, want_weights,
                          device, threads):
    return _fake(x, query_factor, want_lse, want_entropy, want_weights)


# The backward passes, each a custom operator of its own so that a compiled training step holds
# it as one node (its fake implementation gives the shapes). Gradients of absent optional inputs
# come back as empty tensors (an operator's outputs cannot be None) and are dropped again below.


def _new(a: Tensor) -> Tensor:
    # Dense row-major whatever the layout of `a` (torch.empty_like keeps a transposed layout).
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


def _or_none(a: Optional[Tensor], wanted: bool = True) -> Optional[Tensor]:
    return None if a is None or not wanted else a.detach().contiguous()


def _empty_or(a: Optional[Tensor], like: Optional[Tensor], x: Tensor) -> Tensor:
    return x.new_empty(0) if like is None else a


def _refuse_weights(operation: str, d_weights: Optional[Tensor]) -> None:
    # The forward pass may return the weights, but no backward pass reads their gradient: a loss
    # that depends on them would get a silently wrong gradient, so it is refused (d_weights is
    # given only when the weights were requested; torch passes zeros when the loss ignores them).
    if d_weights is not None and bool(torch.any(d_weights != 0)):
        raise NotImplementedError(f"emflow.torch.{operation}: the gradient through 'weights' is "
                                  "not computed; use the update, lse or entropy in the loss")


@torch.library.custom_op("emflow::attend_backward", mutates_args=())
def _attend_backward_op(d_update: Optional[Tensor], d_lse: Optional[Tensor],
                        d_entropy: Optional[Tensor], d_weights: Optional[Tensor], x: Tensor,
                        relevance: Tensor, content: Tensor, key_bias: Optional[Tensor],
                        offset: Optional[Tensor], key_lengths: Optional[Tensor], beta: float,
                        mask: str, device: str, threads: int
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _refuse_weights("attend", d_weights)
    d_x, d_m, d_f = _new(x), _new(relevance), _new(content)
    d_u = None if key_bias is None else _new(key_bias)
    d_c = None if offset is None else _new(offset)
    _emflow._emflow.attend_backward(
        _dense(x), _dense(relevance), _dense(content), _dense(key_bias), _dense(offset), beta,
        mask, _lengths(key_lengths), _or_none(d_update), _or_none(d_lse), _or_none(d_entropy),
        d_x, d_m, d_f, d_u, d_c, device, threads)
    return d_x, d_m, d_f, _empty_or(d_u, key_bias, x), _empty_or(d_c, offset, x)


@_attend_backward_op.register_fake
def _attend_backward_fake(d_update, d_lse, d_entropy, d_weights, x, relevance, content, key_bias,
                          offset, key_lengths, beta, mask, device, threads):
    return (_new(x), _new(relevance), _new(content),
            x.new_empty(0) if key_bias is None else _new(key_bias),
            x.new_empty(0) if offset is None else _new(offset))


@torch.library.custom_op("emflow::attend_factored_backward", mutates_args=())
def _attend_factored_backward_op(d_update: Optional[Tensor], d_lse: Optional[Tensor],
                                 d_entropy: Optional[Tensor], d_weights: Optional[Tensor],
                                 x: Tensor, query_factor: Tensor, key_factor: Tensor,
                                 content_up: Tensor, content_down: Tensor,
                                 key_bias: Optional[Tensor], offset: Optional[Tensor],
                                 key_lengths: Optional[Tensor], beta: float, mask: str,
                                 device: str, threads: int
                                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                            Tensor]:
    _refuse_weights("attend_factored", d_weights)
    grads = [_new(a) for a in (x, query_factor, key_factor, content_up, content_down)]
    d_u = None if key_bias is None else _new(key_bias)
    d_c = None if offset is None else _new(offset)
    _emflow._emflow.attend_factored_backward(
        _dense(x), _dense(query_factor), _dense(key_factor), _dense(content_up),
        _dense(content_down), _dense(key_bias), _dense(offset), beta, mask,
        _lengths(key_lengths), _or_none(d_update), _or_none(d_lse), _or_none(d_entropy), *grads,
        d_u, d_c, device, threads)
    return (*grads, _empty_or(d_u, key_bias, x), _empty_or(d_c, offset, x))


@_attend_factored_backward_op.register_fake
def _attend_factored_backward_fake(d_update, d_lse, d_entropy, d_weights, x, query_factor,
                                   key_factor, content_up, content_down, key_bias, offset,
                                   key_lengths, beta, mask, device, threads):
    return (_new(x), _new(query_factor), _new(key_factor),
            _new(content_up), _new(content_down),
            x.new_empty(0) if key_bias is None else _new(key_bias),
            x.new_empty(0) if offset is None else _new(offset))


def _setup_dense(ctx, inputs, output):
    # The layer's backward pass recomputes the heads' averages from the inputs (docs/MATH.md
    # §8.4): the inputs are all it keeps; beta, the mask and the flags travel as attributes.
    ctx.factored = False
    ctx.save_for_backward(*inputs[:6])  # x, relevance, content, key_bias, offset, key_lengths
    ctx.options = inputs[6:]


def _setup_factored(ctx, inputs, output):
    ctx.factored = True
    ctx.save_for_backward(*inputs[:8])  # x, A, B, U, V, key_bias, offset, key_lengths
    ctx.options = inputs[8:]


def _layer_backward(ctx, d_update, d_lse, d_entropy, d_weights):
    saved = ctx.saved_tensors
    beta, mask, want_lse, want_entropy, want_weights, device, threads = ctx.options
    grads = (d_update, _or_none(d_lse, want_lse), _or_none(d_entropy, want_entropy),
             _or_none(d_weights, want_weights))
    if ctx.factored:
        result = torch.ops.emflow.attend_factored_backward(*grads, *saved, beta, mask, device,
                                                           threads)
        *operators, d_u, d_c = result
        key_bias, offset = saved[5], saved[6]
    else:
        result = torch.ops.emflow.attend_backward(*grads, *saved, beta, mask, device, threads)
        *operators, d_u, d_c = result
        key_bias, offset = saved[3], saved[4]
    return (*operators, None if key_bias is None else d_u, None if offset is None else d_c,
            *([None] * 8))


torch.library.register_autograd("emflow::attend", _layer_backward, setup_context=_setup_dense)
torch.library.register_autograd("emflow::attend_factored", _layer_backward,
                                setup_context=_setup_factored)


# The SDPA-shaped operator: queries (B, Hq, Nq, r), keys (B, Hkv, Nk, r), values (B, Hkv, Nk, rv).
def _statistics(query: Tensor) -> Tensor:
    # lse (and its gradient) is float32 for the 16-bit storage types, as emflow::Stat<T> is.
    dtype = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
    return query.new_empty(query.shape[:-1], dtype=dtype)


def _gpu(query: Tensor) -> dict:
    """The keyword arguments of a call on CUDA tensors: the current torch stream and a workspace
    allocator on it, and for float32 the TF32 products of the tensor cores where torch allows them
    (torch.backends.cuda.matmul.allow_tf32), else the float32 kernel's float products."""
    if not query.is_cuda:
        return {}
    stream, allocate = _emflow._cuda_stream(torch, query, None)
    tf32 = query.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return {"stream": stream, "allocate": allocate, "precision": "tf32" if tf32 else "fp32"}


def _gpu_backward(query: Tensor) -> dict:
    """The keyword arguments of the SDPA backward on CUDA tensors: _gpu's stream and allocator,
    and dQ by atomics (FlashAttention-2's form, as torch's own fused backward) unless torch is
    asked for deterministic algorithms (torch.use_deterministic_algorithms(True)), which gets
    the kernels that give the same bits run to run."""
    if not query.is_cuda:
        return {}
    keywords = {k: v for k, v in _gpu(query).items() if k != "precision"}
    keywords["deterministic"] = torch.are_deterministic_algorithms_enabled()
    return keywords


@torch.library.custom_op("emflow::sdpa", mutates_args=())
def _sdpa_op(query: Tensor, key: Tensor, value: Tensor, key_lengths: Optional[Tensor],
             scale: float, mask: str, query_position: Optional[int], device: str, threads: int
             ) -> Tuple[Tensor, Tensor]:
    output = query.new_empty(query.shape[:-1] + value.shape[-1:])
    lse = _statistics(query)
    _emflow._emflow.sdpa_attend(_dense(query), _dense(key), _dense(value), scale, mask,
                                _lengths(key_lengths), None, 0, query_position, output, lse, None,
                                device, threads, **_gpu(query))
    return output, lse


@_sdpa_op.register_fake
def _sdpa_fake(query, key, value, key_lengths, scale, mask, query_position, device, threads):
    return query.new_empty(query.shape[:-1] + value.shape[-1:]), _statistics(query)


@torch.library.custom_op("emflow::sdpa_backward", mutates_args=())
def _sdpa_backward_op(d_output: Optional[Tensor], d_lse: Optional[Tensor], query: Tensor,
                      key: Tensor, value: Tensor, output: Tensor, lse: Tensor,
                      key_lengths: Optional[Tensor], scale: float, mask: str,
                      query_position: Optional[int], device: str, threads: int
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    d_query, d_key, d_value = (_new(a) for a in (query, key, value))
    _emflow._emflow.sdpa_backward(_dense(query), _dense(key), _dense(value), scale, mask,
                                  _lengths(key_lengths), None, 0, query_position, _dense(output),
                                  _dense(lse), None, _or_none(d_output), _or_none(d_lse), None,
                                  d_query, d_key, d_value, device, threads,
                                  **_gpu_backward(query))
    return d_query, d_key, d_value


@_sdpa_backward_op.register_fake
def _sdpa_backward_fake(d_output, d_lse, query, key, value, output, lse, key_lengths, scale, mask,
                        query_position, device, threads):
    return _new(query), _new(key), _new(value)


def _setup_sdpa(ctx, inputs, output):
    query, key, value, key_lengths = inputs[:4]
    # O enters D_i = <dO_i, O_i> and lse recomputes the weights: the N x N matrix is never kept.
    ctx.save_for_backward(query, key, value, key_lengths, *output)
    ctx.options = inputs[4:]


def _sdpa_backward(ctx, d_output, d_lse):
    query, key, value, key_lengths, output, lse = ctx.saved_tensors
    d_query, d_key, d_value = torch.ops.emflow.sdpa_backward(
        d_output, d_lse, query, key, value, output, lse, key_lengths, *ctx.options)
    return d_query, d_key, d_value, None, None, None, None, None, None


torch.library.register_autograd("emflow::sdpa", _sdpa_backward, setup_context=_setup_sdpa)


def _key_lengths(key_lengths: Any, x: Tensor, operation: str) -> Optional[Tensor]:
    if key_lengths is None or isinstance(key_lengths, torch.Tensor):
        return key_lengths  # an integer tensor, checked by emflow.attend inside the operator
    return torch.as_tensor(_emflow._length_values(operation, key_lengths), device=x.device)


def _result(outputs: Tuple[Tensor, ...], lse: bool, entropy: bool, weights: bool) -> Any:
    if not (lse or entropy or weights):
        return outputs[0]
    return _emflow.Attention(outputs[0], outputs[1] if lse else None,
                             outputs[2] if entropy else None, outputs[3] if weights else None)


def attend(x: Tensor, relevance: Tensor, content: Tensor, *, key_bias: Optional[Tensor] = None,
           offset: Optional[Tensor] = None, beta: float = 1.0, mask: Any = None,
           key_lengths: Any = None, lse: bool = False, entropy: bool = False,
           weights: bool = False, device: str = "auto", threads: int = 0) -> Any:
    """emflow.attend as the operator torch.ops.emflow.attend (see emflow.attend for the
    arguments and the result). Works under torch.compile (fullgraph) and in traced graphs;
    key_lengths may be a tensor or a sequence of ints. Differentiable on the CPU in x,
    relevance, content, key_bias and offset, through the update, lse and entropy
    (emflow::attend_backward, docs/MATH.md §8.4); beta takes no gradient."""
    outputs = torch.ops.emflow.attend(x, relevance, content, key_bias, offset,
                                      _key_lengths(key_lengths, x, "attend"), float(beta),
                                      _emflow._mask(mask), lse, entropy, weights, device, threads)
    return _result(outputs, lse, entropy, weights)


def attend_factored(x: Tensor, query_factor: Tensor, key_factor: Tensor, content_up: Tensor,
                    content_down: Tensor, *, key_bias: Optional[Tensor] = None,
                    offset: Optional[Tensor] = None, beta: float = 1.0, mask: Any = None,
                    key_lengths: Any = None, lse: bool = False, entropy: bool = False,
                    weights: bool = False, device: str = "auto", threads: int = 0) -> Any:
    """emflow.attend_factored as the operator torch.ops.emflow.attend_factored (see
    emflow.attend_factored). QKV attention with per-head projections A (queries), B (keys),
    V (values) and U (output), rank r = head dimension: A = W_Q,h / sqrt(d_k), B = W_K,h,
    V = W_V,h, U = W_O,h. Differentiable on the CPU in x, the four factors, key_bias and
    offset (emflow::attend_factored_backward, docs/MATH.md §8.5)."""
    outputs = torch.ops.emflow.attend_factored(
        x, query_factor, key_factor, content_up, content_down, key_bias, offset,
        _key_lengths(key_lengths, x, "attend_factored"), float(beta), _emflow._mask(mask), lse,
        entropy, weights, device, threads)
    return _result(outputs, lse, entropy, weights)


def sdpa_attend(query: Tensor, key: Tensor, value: Tensor, *, scale: Optional[float] = None,
                mask: Any = None, key_lengths: Any = None, query_position: Optional[int] = None,
                lse: bool = False, device: str = "auto", threads: int = 0) -> Any:
    """The SDPA-shaped operator emflow::sdpa_attend (include/emflow/sdpa.hpp, docs/MATH.md §8)
    as the differentiable operator torch.ops.emflow.sdpa, with emflow's own options.

    query (B, Hq, Nq, r), key (B, Hkv, Nk, r), value (B, Hkv, Nk, rv), float32, float64,
    bfloat16 or float16 tensors of one dtype (16-bit: float32 accumulation, lse in float32;
    the bfloat16 backward runs on AVX512-BF16 where the processor has it, docs/MATH.md §8.8);
    CUDA tensors run on the GPU (bfloat16, float16, float32 with TF32 allowed; value rank equal to
    the rank, at most 256, and at most 128 for the gradients; the current torch stream);
    Hq a multiple of Hkv (grouped heads: query head h reads key and value head
    h // (Hq // Hkv)). scale: multiplies every score, 1 / sqrt(r) by default. mask: None,
    "causal" or ("window", w), on sequence positions: key j at position j, query i at
    ``query_position + i``, or by default (None) aligned bottom-right, at Lk_b - Nq + i (torch's
    is_causal is query_position=0). key_lengths: one length per cloud (keys j >= L_b hidden).
    A query that sees no key gets output 0, lse -inf and zero gradients.

    Returns the output (B, Hq, Nq, rv), or (output, lse) with lse (B, Hq, Nq) when ``lse``:
    gradients flow through both (dQ, dK, dV; scale takes none).
    """
    for name, a in (("query", query), ("key", key), ("value", value)):
        if not isinstance(a, torch.Tensor) or a.dim() != 4:
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"sdpa_attend: argument '{name}' is {shape}, expected a tensor of "
                             "4 axes (B, H, N, E)")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if query_position is not None:
        query_position = _emflow._integer("sdpa_attend", "query_position", query_position)
    output, lse_out = torch.ops.emflow.sdpa(query, key, value,
                                            _key_lengths(key_lengths, query, "sdpa_attend"),
                                            float(scale), _emflow._mask(mask), query_position,
                                            device, threads)
    return (output, lse_out) if lse else output


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """A drop-in for torch.nn.functional.scaled_dot_product_attention on the CPU, with its
    gradients: torch's names, layout and semantics, computed by emflow's SDPA-shaped operator.

    query (B, Hq, L, E) or (Hq, L, E); key (B, Hkv, S, E); value (B, Hkv, S, Ev), float32,
    float64, bfloat16 or float16 CPU tensors of one dtype. Hkv = Hq unless enable_gqa (then Hq a multiple of Hkv).
    is_causal: torch's top-left causal mask (query i sees keys j <= i, also when L != S).
    scale: 1 / sqrt(E) by default.

    Refused by name (NotImplementedError): dropout_p != 0 and any attn_mask (an arbitrary dense
    mask is not computed; emflow's key lengths and windows are ``sdpa_attend``'s); leading batch
    axes that differ or broadcast (ValueError). CUDA tensors run on the GPU as ``sdpa_attend``
    says (float32 only where torch allows TF32: the GPU's float32 path has TF32 products).
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"scaled_dot_product_attention: argument 'dropout_p' is "
                                  f"{dropout_p}, but emflow computes no dropout: expected 0.0")
    if attn_mask is not None:
        raise NotImplementedError("scaled_dot_product_attention: argument 'attn_mask' is given, "
                                  "but emflow computes no arbitrary dense mask: expected None "
                                  "(is_causal for the causal mask; emflow.torch.sdpa_attend takes "
                                  "key lengths and sliding windows)")
    dims = []
    for name, a in (("query", query), ("key", key), ("value", value)):
        if not isinstance(a, torch.Tensor) or a.dim() not in (3, 4):
            shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"scaled_dot_product_attention: argument '{name}' is {shape}, "
                             "expected a tensor (B, H, N, E) or (H, N, E)")
        dims.append(a.dim())
    if len(set(dims)) != 1:
        raise ValueError("scaled_dot_product_attention: arguments 'query', 'key' and 'value' "
                         f"have {dims[0]}, {dims[1]} and {dims[2]} axes, expected the same")
    if query.device.type not in ("cpu", "cuda"):
        raise NotImplementedError("scaled_dot_product_attention: argument 'query' is on "
                                  f"{query.device}, expected a CPU or CUDA tensor")
    if query.dim() == 4 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError("scaled_dot_product_attention: the batch axes of 'query', 'key' and "
                         f"'value' are {query.shape[0]}, {key.shape[0]} and {value.shape[0]}, "
                         "expected one size (emflow does not broadcast them)")
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if enable_gqa:
        if heads % kv_heads != 0:
            raise ValueError(f"scaled_dot_product_attention: 'query' has {heads} heads, "
                             f"expected a multiple of the {kv_heads} heads of 'key'")
    elif heads != kv_heads:
        raise ValueError(f"scaled_dot_product_attention: 'query' has {heads} heads and 'key' "
                         f"{kv_heads}, expected the same (or enable_gqa=True)")
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    # Top-left alignment: query i sits at position i, as key j does.
    output = sdpa_attend(query, key, value, scale=scale, mask="causal" if is_causal else None,
                         query_position=0)
    return output.squeeze(0) if unbatched else output
