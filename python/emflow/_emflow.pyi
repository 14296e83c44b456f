"""
emflow: EMF attention and the flow of token clouds (the C++ extension; use the package emflow)
"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray


def built_with_cuda() -> bool:
    """True when emflow was built with the CUDA backend."""

def cuda_available() -> tuple:
    """(available, reason): whether a CUDA device can be used, and why not."""

def resolve_device(device: str) -> str:
    """
    The device 'auto' / 'cpu' / 'cuda' / 'reference' resolves to in this process: 'auto' is 'cuda' when a device is present and emflow was built with CUDA, else 'cpu'.
    """

def attend(x: Annotated[NDArray, dict(writable=False)], relevance: Annotated[NDArray, dict(writable=False)], content: Annotated[NDArray, dict(writable=False)], key_bias: Annotated[NDArray, dict(writable=False)] | None, offset: Annotated[NDArray, dict(writable=False)] | None, beta: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, update: NDArray, lse: NDArray | None, entropy: NDArray | None, weights: NDArray | None, device: str, threads: int, stream: int, allocate: object | None) -> None:
    """
    emflow::attend (or emflow::cuda::attend_async for CUDA arrays) on the given arrays, written into the given outputs. Use emflow.attend.
    """

def attend_factored(x: Annotated[NDArray, dict(writable=False)], query_factor: Annotated[NDArray, dict(writable=False)], key_factor: Annotated[NDArray, dict(writable=False)], content_up: Annotated[NDArray, dict(writable=False)], content_down: Annotated[NDArray, dict(writable=False)], key_bias: Annotated[NDArray, dict(writable=False)] | None, offset: Annotated[NDArray, dict(writable=False)] | None, beta: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, update: NDArray, lse: NDArray | None, entropy: NDArray | None, weights: NDArray | None, device: str, threads: int, kv_heads: int = 0, rotary_dim: int = 0, rotary_base: float = 10000.0, rotary_pairing: str = 'half_split', rotary_scaling: str = 'default', rotary_factor: float = 1.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, original_max_positions: int = 0, inverse_frequencies: Annotated[NDArray, dict(writable=False)] | None = None) -> None:
    """
    emflow::attend_factored on the given host arrays, written into the given outputs. Use emflow.attend_factored.
    """

def attend_backward(x: Annotated[NDArray, dict(writable=False)], relevance: Annotated[NDArray, dict(writable=False)], content: Annotated[NDArray, dict(writable=False)], key_bias: Annotated[NDArray, dict(writable=False)] | None, offset: Annotated[NDArray, dict(writable=False)] | None, beta: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, d_update: Annotated[NDArray, dict(writable=False)] | None, d_lse: Annotated[NDArray, dict(writable=False)] | None, d_entropy: Annotated[NDArray, dict(writable=False)] | None, d_x: NDArray | None, d_relevance: NDArray | None, d_content: NDArray | None, d_key_bias: NDArray | None, d_offset: NDArray | None, device: str, threads: int) -> float:
    """
    emflow::attend_backward on the given host arrays: the gradients asked for (each output optional) from the upstream gradients of the update, lse and entropy (each optional); returns dL/dbeta.
    """

def attend_factored_backward(x: Annotated[NDArray, dict(writable=False)], query_factor: Annotated[NDArray, dict(writable=False)], key_factor: Annotated[NDArray, dict(writable=False)], content_up: Annotated[NDArray, dict(writable=False)], content_down: Annotated[NDArray, dict(writable=False)], key_bias: Annotated[NDArray, dict(writable=False)] | None, offset: Annotated[NDArray, dict(writable=False)] | None, beta: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, d_update: Annotated[NDArray, dict(writable=False)] | None, d_lse: Annotated[NDArray, dict(writable=False)] | None, d_entropy: Annotated[NDArray, dict(writable=False)] | None, d_x: NDArray | None, d_query_factor: NDArray | None, d_key_factor: NDArray | None, d_content_up: NDArray | None, d_content_down: NDArray | None, d_key_bias: NDArray | None, d_offset: NDArray | None, device: str, threads: int) -> float:
    """
    emflow::attend_factored_backward on the given host arrays, as attend_backward; returns dL/dbeta.
    """

def time_attend(x: Annotated[NDArray, dict(writable=False)], relevance: Annotated[NDArray, dict(writable=False)], content: Annotated[NDArray, dict(writable=False)], update: NDArray, threads: int = 0, repeats: int = 1) -> float:
    """
    Seconds per emflow::attend call (Device::cpu, float32), timed in C++: the baseline that bench/python_overhead.py compares emflow.attend with.
    """

def sdpa_attend(query: Annotated[NDArray, dict(writable=False)], key: Annotated[NDArray, dict(writable=False)], value: Annotated[NDArray, dict(writable=False)], scale: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, query_lengths: Annotated[NDArray, dict(writable=False)] | None, key_position: int, query_position: int | None, output: NDArray, lse: NDArray | None, entropy: NDArray | None, device: str, threads: int, precision: str = 'fp32', stream: int = 0, allocate: object | None = None) -> None:
    """
    emflow::sdpa_attend on the given host arrays, written into the given outputs (query_position None: aligned to the end of the real keys); CUDA arrays through cuda::sdpa_attend_async on `stream` with a workspace from `allocate(nbytes)`. Use emflow.sdpa_attend.
    """

def sdpa_backward(query: Annotated[NDArray, dict(writable=False)], key: Annotated[NDArray, dict(writable=False)], value: Annotated[NDArray, dict(writable=False)], scale: float, mask: str, key_lengths: Annotated[NDArray, dict(writable=False)] | None, query_lengths: Annotated[NDArray, dict(writable=False)] | None, key_position: int, query_position: int | None, output: Annotated[NDArray, dict(writable=False)] | None, lse: Annotated[NDArray, dict(writable=False)], entropy: Annotated[NDArray, dict(writable=False)] | None, d_output: Annotated[NDArray, dict(writable=False)] | None, d_lse: Annotated[NDArray, dict(writable=False)] | None, d_entropy: Annotated[NDArray, dict(writable=False)] | None, d_query: NDArray, d_key: NDArray, d_value: NDArray, device: str, threads: int, stream: int = 0, allocate: object | None = None, deterministic: bool = True) -> float | None:
    """
    emflow::sdpa_backward on the given host arrays: dQ, dK and dV written into d_query, d_key and d_value from the saved output, lse (and entropy) and the upstream gradients (each optional); returns dL/dscale. CUDA arrays through cuda::sdpa_backward_async on `stream` (workspace from `allocate(nbytes)`), returning None (dL/dscale not computed); deterministic=False adds dQ by atomics there (cuda::SdpaBackwardOptions).
    """

def ref_relevance_gradients(cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], relevance: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)]) -> object: ...

def ref_scores(relevance_gradients: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], key_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, beta: float, mask: str, key_lengths: Sequence[int]) -> object: ...

def ref_masked_softmax(scores: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)]) -> tuple: ...

def ref_content(cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], content: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)]) -> object: ...

def ref_contextual_update(weights: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], content: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], offset: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None) -> object: ...

def ref_residual_update(cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], update: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)]) -> object: ...

def ref_attend(cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], relevance: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], content: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], key_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, offset: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, beta: float, mask: str, key_lengths: Sequence[int], with_weights: bool) -> tuple: ...

def mha_to_emf(heads: int, query: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], key: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], value: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], output: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], query_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, key_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, value_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, output_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None) -> tuple: ...

def mha_reference(heads: int, query: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], key: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], value: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], output: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], query_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, key_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, value_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, output_bias: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)] | None, cloud: Annotated[NDArray[numpy.float64], dict(order='C', device='cpu', writable=False)], mask: str, key_lengths: Sequence[int]) -> object: ...

def flow(initial: Annotated[NDArray, dict(writable=False)], betas: Sequence[float], relevance: object, content: object, layers: int, seed: int, norm: str, pre_norm: bool, time: float, dt: float, integrator: str, unnormalized: bool, record_every: int, cluster_eps: float, device: str, threads: int, callback: object | None) -> tuple:
    """
    emflow::flow::run_flow: (trajectory, times, steps, observables). Use emflow.flow.
    """

def initial_clouds(kind: str, batch: int, tokens: int, dim: int, seed: int, single: bool) -> object:
    """emflow::flow::initial_clouds. Use emflow.initial_clouds."""

def phase(tokens: int, dim: int, beta_start: float, beta_stop: float, beta_count: int, time: float, dt: float, clouds: int, seed: int, cluster_eps: float, device: str, threads: int, generic: bool, callback: object | None) -> tuple:
    """
    emflow::flow::phase_diagram: (times, betas, clustered). Use emflow.phase.
    """

def read_npy(path: str) -> object:
    """
    emflow::read_npy: a .npy file (float32, float64, int32 or int64; C order, little endian, rank 1 to 4) as a NumPy array (int32 files come back as int64).
    """

def write_npy(path: str, array: Annotated[NDArray, dict(writable=False)]) -> None:
    """
    emflow::write_npy: writes a float32, float64 or int64 array (rank 1 to 4) as .npy, atomically (a temporary file beside the target, renamed into place).
    """

class DecodingStack:
    """
    emflow::DecodingStack: L layers, one decode cache each. Use emflow.DecodingStack.
    """

    def __init__(self, dim: int, relevance: object, content: object, layers: int, seed: int, beta: float, norm: str, pre_norm: bool, norm_eps: float, threads: int) -> None: ...

    def forward(self, tokens: NDArray, paths: NDArray | None, entropy: NDArray | None) -> None:
        """
        Moves the float32 tokens (n, dim) through the stack in place; paths (n, L + 1, dim) float32 and entropy (n, L) float64 are written when given.
        """

    def clear(self) -> None:
        """Drops every token of every cache."""

    @property
    def size(self) -> int:
        """Tokens moved so far: the next position."""

    @property
    def layers(self) -> int: ...

    @property
    def dim(self) -> int: ...

def generate(prompts: Annotated[NDArray, dict(writable=False)], betas: Sequence[float], relevance: object, content: object, layers: int, seed: int, norm: str, pre_norm: bool, norm_eps: float, steps: int, threads: int) -> tuple:
    """emflow::generate: (paths, entropy, seconds). Use emflow.generate."""

class GgufFile:
    """
    emflow::gguf::File: a GGUF file, its metadata and tensor infos read and checked once. Use emflow.gguf.File.
    """

    def __init__(self, path: str) -> None: ...

    @property
    def path(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def alignment(self) -> int: ...

    @property
    def data_offset(self) -> int: ...

    @property
    def file_size(self) -> int: ...

    def metadata(self) -> list:
        """[(key, type, element type or None, value)] in file order."""

    def tensors(self) -> list:
        """[(name, type, shape, offset, nbytes)] in file order; shape row-major."""

    def detokenize(self, ids: Sequence[int]) -> bytes:
        """emflow::gguf::File::detokenize: the text of token ids, as UTF-8 bytes."""

    def read(self, name: str) -> object:
        """emflow::gguf::File::read: the tensor dequantized to float32."""

def gguf_dequantize(type: str, blocks: Annotated[NDArray[numpy.uint8], dict(order='C', device='cpu', writable=False)], count: int) -> object:
    """
    emflow::gguf::dequantize: `count` elements of the type named `type` ("Q4_1", ...) from their bytes, as float32.
    """

def gguf_types() -> list:
    """
    [(code, name, block size, block bytes, dequantized)] for every tensor type emflow knows.
    """

class Model:
    """
    emflow::model::Model: a pretrained transformer as EMF operators. Use emflow.model.Model.
    """

    def __init__(self, path: str) -> None: ...

    @property
    def layout(self) -> str: ...

    @property
    def layers(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def heads(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def causal(self) -> bool: ...

    @property
    def vocabulary(self) -> list[str]: ...

    def embed(self, ids: Sequence[int]) -> object: ...

    def run(self, clouds: Annotated[NDArray, dict(writable=False)], key_lengths: Sequence[int] | None, full_layer: bool, factored: bool, threads: int, positions: Sequence[int] | None = None) -> object: ...

    def logits(self, clouds: Annotated[NDArray, dict(writable=False)], key_lengths: Sequence[int] | None) -> object: ...

    def generate(self, ids: Annotated[NDArray, dict(writable=False)], lengths: Sequence[int] | None, new_tokens: int, float64: bool, bf16_products: bool, keep_logits: bool, threads: int) -> object: ...

    def detokenize(self, ids: Sequence[int]) -> bytes: ...

def route(factored: bool, storage: str, precision: str, batch: int, tokens: int, dim: int, heads: int, rank: int, mask: str, key_lengths: bool, key_bias: bool, offset: bool, lse: bool, entropy: bool, weights: bool, device: str, operation: str) -> tuple:
    """
    emflow::route of the Problem these fields describe: (supported, device, kernel, computes, products, expanded, reason, device_missing). Use emflow.route.
    """

def machine() -> dict:
    """
    emflow::this_machine(): the processor (cpu, cpu_features), the CPU engine's paths built and the one taken (cpu_paths, cpu_path and the extensions it uses; cpu_missing where none runs), and the CUDA device (cuda_built, cuda_device, cuda_reason), as a dict.
    """

def max_threads() -> int:
    """
    emflow::max_threads: the most CPU threads a call may ask for (4 per core).
    """
