"""emflow as PyTorch operators: ``emflow::attend`` and ``emflow::attend_factored``, registered
with torch.library.custom_op and fake (meta) implementations, so they run under torch.compile
and in traced graphs without graph breaks. Forward only: asking for a gradient through them
raises a RuntimeError.

CPU tensors run on the CPU backend, CUDA tensors through emflow::cuda::attend_async on the
current torch stream. Inputs are made contiguous first (a no-op for contiguous tensors) and
must share the dtype of x (float32 or float64).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

import emflow as _emflow

__all__ = ["attend", "attend_factored"]

Tensor = torch.Tensor
_NO_GRADIENT = ("emflow.torch.{} is forward only: it has no gradient. Detach its inputs, or "
                "use torch.nn.functional.scaled_dot_product_attention where a gradient is "
                "needed")


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
    # Detached: the forward computes values only (register_autograd refuses the backward), and
    # emflow.attend refuses tensors that require grad.
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


def _refuse_attend(ctx, *grads):
    raise RuntimeError(_NO_GRADIENT.format("attend"))


def _refuse_factored(ctx, *grads):
    raise RuntimeError(_NO_GRADIENT.format("attend_factored"))


torch.library.register_autograd("emflow::attend", _refuse_attend)
torch.library.register_autograd("emflow::attend_factored", _refuse_factored)


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
    key_lengths may be a tensor or a sequence of ints."""
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
    V = W_V,h, U = W_O,h."""
    outputs = torch.ops.emflow.attend_factored(
        x, query_factor, key_factor, content_up, content_down, key_bias, offset,
        _key_lengths(key_lengths, x, "attend_factored"), float(beta), _emflow._mask(mask), lse,
        entropy, weights, device, threads)
    return _result(outputs, lse, entropy, weights)
