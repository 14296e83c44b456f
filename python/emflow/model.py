"""Pretrained transformers as EMF operators (emflow/model.hpp, docs/MODELS.md): load a model,
run its layers on token clouds, take the next-token logits, and generate greedily.

    from emflow.model import Model
    m = Model("SmolLM2-135M-Instruct.Q4_1.gguf")    # or an operator folder, or a model folder
    out = m.generate([[504, 3575, 282, 4649, 314]], new_tokens=8)
    m.detokenize(out.ids[0])                         # " Paris.\\n\\nThe answer is"
    run = m.run(m.embed([504, 3575, 282, 4649, 314]))
    run.trajectory.shape                             # (31, 1, 5, 576): the cloud, then each layer

A path is an operator folder written by ``emflow convert`` (its manifest.json), a GGUF file of
the llama architecture, or a model folder (config.json and model.safetensors: BERT, GPT-2 and
llama layouts). Loading converts the model exactly as ``emflow convert`` does; a file it cannot
read is refused with a RuntimeError naming the file and the tensor or key, a model it cannot
represent with NotImplementedError. Everything runs on the CPU with the GIL released; in float32
on a processor the CPU engine runs on, the products are float32 as torch's (docs/MODELS.md).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _emflow

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Generated", "Model", "Run"]


class Run(NamedTuple):
    """What ``Model.run`` returns, in the clouds' dtype: trajectory (L + 1, B, N, d), the clouds
    entering the first layer and after every layer (a llama model's last is before the final
    norm); attention (L, B, N, d), each layer's attention update; entropy (L + 1, B) float64,
    the mean attention entropy of each layer over the heads and the real tokens (row L is 0)."""

    trajectory: np.ndarray
    attention: np.ndarray
    entropy: np.ndarray


class Generated(NamedTuple):
    """What ``Model.generate`` returns: ids (B, K) int64, the new tokens of each prompt; logits
    (B, K, vocab) of every step when asked, else None; prefill_seconds (B) and step_seconds
    (B, K), the time of each prompt's prefill and of each new token."""

    ids: np.ndarray
    logits: Optional[np.ndarray]
    prefill_seconds: np.ndarray
    step_seconds: np.ndarray


def _clouds(clouds: Any) -> tuple:
    """clouds as a C-contiguous (B, N, d) float32 or float64 array, and whether it had no B."""
    array = np.asarray(clouds)
    if array.dtype != np.float64:
        array = array.astype(np.float32, copy=False)
    single = array.ndim == 2
    if single:
        array = array[None]
    return np.ascontiguousarray(array), single


def _lengths(lengths: Any) -> Optional[list]:
    return None if lengths is None else [int(n) for n in np.asarray(lengths).reshape(-1)]


class Model:
    """A pretrained transformer: per layer its attention as EMF operators (dense M_h, F_h for
    BERT and GPT-2; the factored form with rotary positions and grouped kv heads for llama),
    its norms and feed-forward block, and for llama the embedding, unembedding and vocabulary."""

    def __init__(self, path: PathLike) -> None:
        self._model = _emflow.Model(os.fspath(path))

    @property
    def layout(self) -> str:
        """"bert", "gpt2" or "llama"."""
        return self._model.layout

    @property
    def layers(self) -> int:
        return self._model.layers

    @property
    def dim(self) -> int:
        """d, the dimension of the token space."""
        return self._model.dim

    @property
    def heads(self) -> int:
        return self._model.heads

    @property
    def kv_heads(self) -> int:
        """The key/value heads (heads where they are not grouped)."""
        return self._model.kv_heads

    @property
    def head_dim(self) -> int:
        return self._model.head_dim

    @property
    def vocab_size(self) -> int:
        """The rows of the embedding; 0 for a model without one (BERT, GPT-2 here)."""
        return self._model.vocab_size

    @property
    def causal(self) -> bool:
        return self._model.causal

    @property
    def vocabulary(self) -> list:
        """The token strings as stored (id i is element i); empty when the source had none."""
        return self._model.vocabulary

    def embed(self, ids: Any) -> np.ndarray:
        """The embedding rows of token ids (N) or (B, N): the cloud entering the first layer,
        float32 (N, d) or (B, N, d). A llama model's positions enter inside every layer."""
        array = np.asarray(ids, dtype=np.int64)
        rows = self._model.embed([int(i) for i in array.reshape(-1)])
        return rows.reshape(array.shape + (self.dim,))

    def run(self, clouds: Any, key_lengths: Any = None, *, full_layer: bool = True,
            factored: Optional[bool] = None, threads: int = 0, positions: Any = None) -> Run:
        """The model's layers on token clouds (N, d) or (B, N, d), float32 (float64 kept as
        float64), as ``emflow flow --model`` runs them; key_lengths (B): each cloud's real
        tokens (right padding). full_layer=False runs attention and norms only (the EMF flow).
        factored: the attention in the factored form (None: as the model needs, the factored
        form for llama, the dense operators otherwise). positions (llama): the rotary position
        of every token, integers shaped as the clouds' tokens, (N) or (B, N) (None: 0..N-1; the
        masks stay by index, as transformers' position_ids). Without B in, none in the arrays
        out."""
        array, single = _clouds(clouds)
        if factored is None:
            factored = self.layout == "llama"
        turned = None
        if positions is not None:
            given = np.asarray(positions)
            expected = array.shape[1:2] if single else array.shape[:2]
            if given.dtype.kind not in "iu" or given.shape != expected:
                raise ValueError(f"Model.run: positions must be integers of shape {expected} "
                                 f"(one per token), got {given.dtype} {given.shape}")
            turned = [int(p) for p in given.reshape(-1)]
        trajectory, attention, entropy = self._model.run(array, _lengths(key_lengths),
                                                         bool(full_layer), bool(factored),
                                                         int(threads), turned)
        if single:
            return Run(trajectory[:, 0], attention[:, 0], entropy[:, 0])
        return Run(trajectory, attention, entropy)

    def logits(self, clouds: Any, key_lengths: Any = None) -> np.ndarray:
        """The next-token logits of each cloud's last real token (llama: the final RMSNorm,
        then the unembedding), from clouds after the last layer (``run(...).trajectory[-1]``):
        (vocab) for one cloud (N, d), (B, vocab) for (B, N, d)."""
        array, single = _clouds(clouds)
        out = self._model.logits(array, _lengths(key_lengths))
        return out[0] if single else out

    def generate(self, ids: Any, new_tokens: int, *, lengths: Any = None,
                 precision: str = "float32", products: str = "fp32", logits: bool = False,
                 threads: int = 0) -> Generated:
        """Greedy generation (llama): the prompts' ids (N) or right-padded (B, N), lengths (B)
        their real tokens; each prompt once through every layer with a decode cache per layer,
        then new_tokens greedy steps, as ``emflow generate`` runs them. precision: "float32" or
        "float64" (the state and the caches' element type). products: "fp32", or "bf16" for the
        feed-forward blocks and the unembedding of a float32 run in bfloat16 (weights stored in
        bfloat16, float32 sums; AVX512-BF16 only, NotImplementedError elsewhere).
        logits=True keeps every step's."""
        if precision not in ("float32", "float64"):
            raise ValueError(f"Model.generate: 'precision' must be 'float32' or 'float64', "
                             f"got {precision!r}")
        if products not in ("fp32", "bf16"):
            raise ValueError(f"Model.generate: 'products' must be 'fp32' or 'bf16', "
                             f"got {products!r}")
        array = np.asarray(ids, dtype=np.int64)
        single = array.ndim == 1
        if single:
            array = array[None]
        out = Generated(*self._model.generate(np.ascontiguousarray(array), _lengths(lengths),
                                              int(new_tokens), precision == "float64",
                                              products == "bf16", bool(logits), int(threads)))
        if single:
            return Generated(out.ids[0], None if out.logits is None else out.logits[0],
                             out.prefill_seconds, out.step_seconds[0])
        return out

    def detokenize(self, ids: Any) -> str:
        """The text of token ids through the model's vocabulary (as emflow.gguf.File's
        detokenize); a ValueError names an id outside the vocabulary."""
        ids = [int(i) for i in np.asarray(ids, dtype=np.int64).reshape(-1)]
        return self._model.detokenize(ids).decode("utf-8", errors="replace")
