"""The flow of token clouds (emflow::flow, docs/MATH.md §4) and the phase diagram."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _emflow, _integer

_SEED = (0, 2**64 - 1)

Progress = Optional[Callable[[int, int], Any]]


class FlowResult(NamedTuple):
    """A recorded run: trajectory (R, B, N, d), the initial clouds first; times (R,) (the time,
    or the layer index of a stack); steps (R,) (the step of each record); observables: a dict
    of (R, B) arrays (docs/MATH.md §5) "min_inner", "mean_inner", "clustered_fraction",
    "clusters" (int64), "energy", "entropy", "diameter"."""

    trajectory: np.ndarray
    times: np.ndarray
    steps: np.ndarray
    observables: dict


class PhaseDiagram(NamedTuple):
    """times (S + 1,), betas (K,), clustered (S + 1, K): the mean over the clouds of the
    fraction of pairs with <x_i, x_j> > 1 - eps at each time and beta."""

    times: np.ndarray
    betas: np.ndarray
    clustered: np.ndarray


def initial_clouds(kind: str = "gaussian", batch: int = 1, tokens: int = 32, dim: int = 2,
                   seed: int = 0, dtype: Any = np.float64) -> np.ndarray:
    """B seeded clouds of N tokens in R^d, (B, N, d) (emflow::flow::initial_clouds). kind:
    "gaussian" (entries N(0, 1/d)), "sphere" (uniform on S^{d-1}), "cube" (uniform in
    [-1, 1]^d) or "orthonormal" (N <= d). Cloud b depends on (seed, b) only."""
    single = np.dtype(dtype) == np.float32
    if not single and np.dtype(dtype) != np.float64:
        raise ValueError(f"argument 'dtype' is {dtype!r}, expected float32 or float64")
    op = "initial_clouds"
    return _emflow.initial_clouds(kind, _integer(op, "batch", batch),
                                  _integer(op, "tokens", tokens), _integer(op, "dim", dim),
                                  _integer(op, "seed", seed, *_SEED), single)


def flow(initial: Any, *, beta: Union[float, Sequence[float]] = 1.0,
         relevance: Any = "identity", content: Any = "identity", layers: int = 0,
         seed: int = 0, norm: str = "none", pre_norm: bool = False, time: float = 10.0,
         dt: float = 0.1, integrator: str = "rk4", unnormalized: bool = False,
         record_every: int = 1, cluster_eps: float = 1e-3, device: str = "auto",
         threads: int = 0, callback: Progress = None) -> FlowResult:
    """Runs the flow from ``initial`` (emflow::flow::run_flow), as ``emflow flow`` does.

    initial: (B, N, d) or (N, d), float32 or float64 (the precision of the run).
    beta: one inverse temperature, or one per cloud. relevance / content: M and F, either an
    operator kind ("identity", "minus-identity", "random": entries N(0, 1/d), seeded by
    ``seed``) or an array (d, d), (H, d, d) or (L, H, d, d).
    layers > 0: a discrete stack of that many layers with normalisation ``norm`` ("none",
    "layernorm", "rmsnorm", "sphere"), post-norm unless ``pre_norm``; layers = 0: continuous
    time up to ``time`` with step ``dt`` ("euler" or "rk4"), on the sphere when norm is
    "sphere". unnormalized: USA instead of SA. The state is recorded every ``record_every``
    steps (and last). callback(done, total) is called after each step on the calling thread,
    e.g. with tqdm: ``callback=lambda done, total: bar.update(done - bar.n)``. Ctrl-C
    (KeyboardInterrupt) stops the run after the step it arrives in, with or without a callback.
    """
    initial = np.asarray(initial)
    if initial.ndim == 2:
        initial = initial[None]
    if initial.dtype not in (np.float32, np.float64):
        raise ValueError(f"flow: argument 'initial' has dtype {initial.dtype}, expected float32 "
                         "or float64")
    initial = np.ascontiguousarray(initial)
    betas = [float(b) for b in np.atleast_1d(np.asarray(beta, dtype=np.float64))]
    if not isinstance(relevance, str):
        relevance = np.ascontiguousarray(relevance, dtype=initial.dtype)
    if not isinstance(content, str):
        content = np.ascontiguousarray(content, dtype=initial.dtype)
    trajectory, times, steps, observables = _emflow.flow(
        initial, betas, relevance, content, _integer("flow", "layers", layers),
        _integer("flow", "seed", seed, *_SEED), norm, pre_norm, time, dt, integrator,
        unnormalized, _integer("flow", "record_every", record_every), cluster_eps, device,
        _integer("flow", "threads", threads), callback)
    return FlowResult(trajectory, times, steps, observables)


def phase(*, tokens: int = 32, dim: int = 2, beta_start: float = 0.1, beta_stop: float = 9.0,
          beta_count: int = 90, time: float = 30.0, dt: float = 0.1, clouds: int = 2048,
          seed: int = 0, cluster_eps: float = 1e-3, device: str = "auto", threads: int = 0,
          callback: Progress = None, generic: bool = False) -> PhaseDiagram:
    """The phase diagram of Geshkovski et al. (emflow::flow::phase_diagram): Q = K = V = I on
    the sphere S^{d-1} (SA), ``clouds`` clouds of ``tokens`` tokens uniform on the sphere (the
    same for every beta), integrated by RK4 up to ``time``, for ``beta_count`` betas from
    beta_start to beta_stop. generic=True takes the generic attention path
    (PhaseSettings::generic). callback(done, total) as for ``flow``."""
    op = "phase"
    times, betas, clustered = _emflow.phase(
        _integer(op, "tokens", tokens), _integer(op, "dim", dim), beta_start, beta_stop,
        _integer(op, "beta_count", beta_count), time, dt, _integer(op, "clouds", clouds),
        _integer(op, "seed", seed, *_SEED), cluster_eps, device, _integer(op, "threads", threads),
        generic, callback)
    return PhaseDiagram(times, betas, clustered)
