"""emflow.reference: every operation of the EMF model (docs/MATH.md §1) in double precision,
written for clarity rather than speed, the ground truth the fast backends are measured against
(emflow/reference.hpp)::

    R         = X M                             relevance_gradients
    S         = beta (R X^T + 1 u^T X^T)        scores          (-inf where masked)
    P, lse, H = softmax_j(S), log-sum-exp       masked_softmax
    C         = X F^T                           content
    Delta     = P C + 1 c^T                     contextual_update (0 for masked queries)
    X*        = X + Delta                       residual_update

A cloud is (N, d) or a batch (B, N, d); results keep the caller's rank. Arguments are converted
to float64 (copied); results are float64 NumPy arrays. Invalid arguments raise ValueError
naming the operation, the argument and the expected and actual shape.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import _emflow
from . import _length_values, _mask

Lengths = Optional[Sequence[int]]


def _d(a: Any) -> Any:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float64)


def _lengths(operation: str, key_lengths: Lengths) -> list:
    return [] if key_lengths is None else _length_values(operation, key_lengths).tolist()


def relevance_gradients(cloud: Any, relevance: Any) -> np.ndarray:
    """R = X M: row i is r_{x_i}^T. relevance: M, (d, d). Returns the cloud's shape."""
    return _emflow.ref_relevance_gradients(_d(cloud), _d(relevance))


def scores(relevance_gradients: Any, cloud: Any, key_bias: Any = None, beta: float = 1.0,
           mask: Any = None, key_lengths: Lengths = None) -> np.ndarray:
    """S = beta (R X^T + 1 u^T X^T), -inf where key j is hidden from query i: (N, N) or
    (B, N, N). key_bias: u, (d) or None; mask as for emflow.attend; key_lengths: one per cloud."""
    return _emflow.ref_scores(_d(relevance_gradients), _d(cloud), _d(key_bias), beta, _mask(mask),
                              _lengths("scores", key_lengths))


def masked_softmax(scores: Any) -> tuple:
    """(weights, lse, entropy) of the softmax over the last axis; a row of only -inf gives
    weights 0, lse -inf and entropy 0. scores: rank 1 to 4, finite or -inf."""
    return _emflow.ref_masked_softmax(_d(scores))


def content(cloud: Any, content: Any) -> np.ndarray:
    """C = X F^T: row j is (F x_j)^T. content: F, (d, d)."""
    return _emflow.ref_content(_d(cloud), _d(content))


def contextual_update(weights: Any, content: Any, offset: Any = None) -> np.ndarray:
    """Delta = P C + 1 c^T on the queries that see a key (an all-zero weight row gives 0)."""
    return _emflow.ref_contextual_update(_d(weights), _d(content), _d(offset))


def residual_update(cloud: Any, update: Any) -> np.ndarray:
    """X* = X + Delta."""
    return _emflow.ref_residual_update(_d(cloud), _d(update))


def attend(cloud: Any, relevance: Any, content: Any, key_bias: Any = None, offset: Any = None,
           *, beta: float = 1.0, mask: Any = None, key_lengths: Lengths = None,
           weights: bool = False) -> tuple:
    """The multi-head update composed from the functions above (emflow::reference::attend):
    (update, lse (B, H, N), entropy (B, H, N), weights (B, H, N, N) or None). relevance,
    content: (H, d, d) or (d, d); key_bias (H, d) or (d); offset (d). Equals
    emflow.attend(..., device="reference") up to rounding."""
    return _emflow.ref_attend(_d(cloud), _d(relevance), _d(content), _d(key_bias), _d(offset),
                              beta, _mask(mask), _lengths("attend", key_lengths), weights)
