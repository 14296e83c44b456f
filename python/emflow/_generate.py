"""Decoding through a stack of layers, one decode cache per layer (emflow/generate.hpp)."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence, Union

import numpy as np

from . import _emflow


class Decoded(NamedTuple):
    """What ``DecodingStack.forward(..., trace=True)`` returns: tokens (n, d) after the last
    layer; paths (n, L + 1, d), each token at the input of every layer and after the last;
    entropy (n, L), each token's attention entropy per layer (the mean over heads)."""

    tokens: np.ndarray
    paths: np.ndarray
    entropy: np.ndarray


class Generation(NamedTuple):
    """What ``generate`` returns. paths (B, K, L + 1, d) (without B for prompts (N, d)): each
    new token at the input of every layer and after the last; entropy (B, K, L) likewise: each
    new token's attention entropy per layer; seconds (K,): the wall-clock time of each step."""

    paths: np.ndarray
    entropy: np.ndarray
    seconds: np.ndarray


def _operator(a: Any) -> Any:
    return a if isinstance(a, str) else np.ascontiguousarray(a, dtype=np.float32)


class DecodingStack:
    """A stack of ``layers`` layers in R^dim decoding one cloud causally, one decode cache per
    layer (emflow::DecodingStack). Layer l moves a token x by x <- N(x + Delta_l(x)) (post-norm)
    or x <- x + Delta_l(N(x)) (``pre_norm``), Delta_l its attention under the causal mask at
    inverse temperature ``beta`` against every token it has seen, N the normalisation ``norm``
    ("none", "layernorm", "rmsnorm", "sphere"; eps ``norm_eps``).

    relevance / content: M and F as for ``flow``: an operator kind ("identity",
    "minus-identity", "random": seeded by ``seed``) or an array (d, d), (H, d, d) or
    (L, H, d, d). float32 throughout.

    A prompt, then new tokens one by one::

        stack = emflow.DecodingStack(64, layers=4, relevance=m, content=f)
        out = stack.forward(prompt)          # (N, 64): the prompt through the stack
        for _ in range(k):
            out = stack.forward(choose(out[-1]))   # one new token against all before it
    """

    def __init__(self, dim: int, *, layers: int = 1, relevance: Any = "identity",
                 content: Any = "identity", beta: float = 1.0, seed: int = 0, norm: str = "none",
                 pre_norm: bool = False, norm_eps: float = 1e-5, threads: int = 0) -> None:
        self._stack = _emflow.DecodingStack(dim, _operator(relevance), _operator(content), layers,
                                            seed, beta, norm, pre_norm, norm_eps, threads)

    @property
    def size(self) -> int:
        """Tokens moved so far: the position of the next token."""
        return self._stack.size

    @property
    def layers(self) -> int:
        return self._stack.layers

    @property
    def dim(self) -> int:
        return self._stack.dim

    def forward(self, tokens: Any, *, trace: bool = False) -> Any:
        """Moves new tokens (n, d) (or one token (d,)) through every layer, against every token
        before them and causally among themselves, and returns them after the last layer as a
        new float32 array of the same shape (``tokens`` is not changed). trace=True returns a
        ``Decoded`` (tokens, paths, entropy) instead."""
        moved = np.array(tokens, dtype=np.float32, order="C", copy=True)
        rows = moved.reshape(-1, moved.shape[-1]) if moved.ndim == 1 else moved
        paths = entropy = None
        if trace:
            paths = np.empty((rows.shape[0], self.layers + 1, rows.shape[-1]), dtype=np.float32)
            entropy = np.empty((rows.shape[0], self.layers), dtype=np.float64)
        self._stack.forward(rows, paths, entropy)
        return Decoded(moved, paths, entropy) if trace else moved

    def clear(self) -> None:
        """Drops every token of every cache (the layers stay)."""
        self._stack.clear()


def generate(prompts: Any, steps: int, *, layers: int = 1, beta: Union[float, Sequence[float]] = 1.0,
             relevance: Any = "identity", content: Any = "identity", seed: int = 0,
             norm: str = "none", pre_norm: bool = False, norm_eps: float = 1e-5,
             threads: int = 0) -> Generation:
    """The flow's generation (emflow::generate, ``emflow flow --layers L --generate K``): each
    prompt through a ``DecodingStack`` (arguments as there), then ``steps`` times its last
    output fed back as the next token. prompts: (B, N, d) or (N, d), float32; beta: one, or
    one per cloud. Sizes that cannot fit in memory raise MemoryError before any work."""
    prompts = np.asarray(prompts)
    single = prompts.ndim == 2
    prompts = np.ascontiguousarray(prompts[None] if single else prompts, dtype=np.float32)
    betas = [float(b) for b in np.atleast_1d(np.asarray(beta, dtype=np.float64))]
    paths, entropy, seconds = _emflow.generate(prompts, betas, _operator(relevance),
                                               _operator(content), layers, seed, norm, pre_norm,
                                               norm_eps, steps, threads)
    if single:
        paths, entropy = paths[0], entropy[0]
    return Generation(paths, entropy, seconds)
