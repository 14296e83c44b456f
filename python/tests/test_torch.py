"""emflow on torch tensors: zero copy on the CPU, the custom operator, torch.compile, and the
factored form against torch's own scaled_dot_product_attention. CUDA cases need a device.
Gradients: test_autograd.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import emflow  # noqa: E402
import emflow.torch  # noqa: E402

sdpa = torch.nn.functional.scaled_dot_product_attention


def dense_problem(dtype=torch.float32, device="cpu", batch=2, tokens=10, dim=4, heads=2):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(batch, tokens, dim, generator=gen, dtype=dtype)
    m = torch.randn(heads, dim, dim, generator=gen, dtype=dtype) / dim**0.5
    f = torch.randn(heads, dim, dim, generator=gen, dtype=dtype) / dim**0.5
    return x.to(device), m.to(device), f.to(device)


def qkv_problem(batch=2, tokens=12, dim=16, heads=2, head_dim=4):
    """x and per-head projections W_Q, W_K, W_V (H, d_k, d) and W_O (H, d, d_k)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, tokens, dim, generator=gen)
    wq, wk, wv = (torch.randn(heads, head_dim, dim, generator=gen) / dim**0.5 for _ in range(3))
    wo = torch.randn(heads, dim, head_dim, generator=gen) / head_dim**0.5
    return x, wq, wk, wv, wo


def sdpa_update(x, wq, wk, wv, wo, causal=False, lengths=None):
    """sum_h W_O,h SDPA(x W_Q,h^T, x W_K,h^T, x W_V,h^T): multi-head attention without biases."""
    q = torch.einsum("bnd,hkd->bhnk", x, wq)
    k = torch.einsum("bnd,hkd->bhnk", x, wk)
    v = torch.einsum("bnd,hkd->bhnk", x, wv)
    mask = None
    if lengths is not None:
        n = x.shape[1]
        keys = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, N)
        mask = keys[:, None, None, :].expand(-1, 1, n, n)
        if causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        causal = False
    o = sdpa(q, k, v, attn_mask=mask, is_causal=causal)
    return torch.einsum("bhnk,hdk->bnd", o, wo)


def test_cpu_tensors_without_copy():
    x, m, f = dense_problem()
    out = torch.full_like(x, float("nan"))
    address = out.data_ptr()
    result = emflow.attend(x, m, f, out=out, mask="causal")
    assert result is out and out.data_ptr() == address
    ref = emflow.reference.attend(x.numpy(), m.numpy(), f.numpy(), mask="causal")[0]
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-5, atol=2e-5)
    fresh = emflow.attend(x, m, f, lse=True)
    assert isinstance(fresh.update, torch.Tensor) and fresh.lse.shape == (2, 2, 10)


def test_non_contiguous_tensor_is_refused_unless_copy():
    x, m, f = dense_problem()
    with pytest.raises(ValueError, match="'relevance' of shape .* is not C-contiguous"):
        emflow.attend(x, m.transpose(1, 2), f)
    with pytest.raises(ValueError, match="'content' has dtype float64"):
        emflow.attend(x, m, f.double())
    got = emflow.attend(x, m.transpose(1, 2), f.double(), copy=True)
    ref = emflow.attend(x, m.transpose(1, 2).contiguous(), f)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_operator_dense_matches_reference(dtype):
    x, m, f = dense_problem(dtype)
    got = emflow.torch.attend(x, m, f, beta=0.5, mask=("window", 4), key_lengths=[10, 6],
                              lse=True)
    ref = emflow.reference.attend(x.numpy(), m.numpy(), f.numpy(), beta=0.5, mask=("window", 4),
                                  key_lengths=[10, 6])
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(got.update.numpy(), ref[0], rtol=tol, atol=tol)
    real = np.isfinite(ref[1])
    np.testing.assert_allclose(got.lse.numpy()[real], ref[1][real], rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [None, [12, 7]])
def test_factored_matches_sdpa(causal, lengths):
    x, wq, wk, wv, wo = qkv_problem()
    expected = sdpa_update(x, wq, wk, wv, wo, causal, lengths)
    got = emflow.torch.attend_factored(x, wq / wq.shape[1] ** 0.5, wk, wo, wv,
                                       mask="causal" if causal else None, key_lengths=lengths)
    if lengths is not None:  # padding queries: emflow gives 0, SDPA attends to the real keys
        assert torch.all(got[1, lengths[1]:] == 0)
        expected, got = expected[1, : lengths[1]], got[1, : lengths[1]]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert expected.abs().max() > 0.1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _, wq, wk, wv, wo = qkv_problem()
        self.a, self.b, self.u, self.v = wq / 2, wk, wo, wv

    def forward(self, x):
        y = emflow.torch.attend_factored(x, self.a, self.b, self.u, self.v, mask="causal")
        return torch.nn.functional.layer_norm(x + y, x.shape[-1:])


def test_compiles_without_graph_break():
    import torch._dynamo

    torch._dynamo.reset()
    block = Block()
    x = qkv_problem()[0]
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x))


def test_traced_graph_holds_the_operator():
    x, m, f = dense_problem()
    graph = torch.fx.symbolic_trace(lambda x, m, f: torch.ops.emflow.attend(
        x, m, f, None, None, None, 1.0, "causal", False, False, False, "cpu", 0)[0])
    assert "emflow.attend" in str(graph.graph)
    torch.testing.assert_close(graph(x, m, f), emflow.attend(x, m, f, mask="causal"))


def cuda_ready():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    available, reason = emflow.cuda_available()
    return None if available else f"emflow cannot use CUDA: {reason}"


@pytest.mark.skipif(cuda_ready() is not None, reason=str(cuda_ready()))
def test_cuda_tensors_on_a_side_stream():
    x, m, f = dense_problem(device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = emflow.attend(x, m, f, mask="causal", key_lengths=[10, 6], out=out, lse=True)
    stream.synchronize()
    assert result.update is out
    ref = emflow.reference.attend(x.cpu().numpy(), m.cpu().numpy(), f.cpu().numpy(),
                                  mask="causal", key_lengths=[10, 6])
    np.testing.assert_allclose(out.cpu().numpy(), ref[0], rtol=1e-4, atol=1e-5)
    explicit = emflow.attend(x, m, f, stream=stream)
    stream.synchronize()
    torch.testing.assert_close(explicit.cpu(), emflow.attend(x.cpu(), m.cpu(), f.cpu()),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(cuda_ready() is not None, reason=str(cuda_ready()))
def test_cuda_operator_factored_matches_sdpa():
    x, wq, wk, wv, wo = (t.cuda() for t in qkv_problem())
    expected = sdpa_update(x.cpu(), wq.cpu(), wk.cpu(), wv.cpu(), wo.cpu(), True)
    got = emflow.torch.attend_factored(x, wq / 2, wk, wo, wv, mask="causal")
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cuda_ready() is not None, reason=str(cuda_ready()))
def test_cuda_sdpa_trains_on_the_gpu_as_on_the_cpu():
    """The SDPA drop-in on CUDA tensors (cuda::sdpa_attend_async and sdpa_backward_async on the
    current stream): bfloat16 output and gradients within bfloat16's rounding of the CPU's on the
    same stored values, grouped heads, torch's causal mask; float32 where torch does not allow
    TF32 runs the float32 kernel (float products), within float rounding of the CPU's."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, 40, 64, generator=generator).to(torch.bfloat16)
               for h in (4, 2, 2))
    grads = []
    for device in ("cuda", "cpu"):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = emflow.torch.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.float().square().sum().backward()
        grads.append([out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves])
    for got, want, name in zip(grads[0], grads[1], ("output", "dQ", "dK", "dV")):
        error = (got - want).norm() / want.norm()
        assert error < 2 ** -6, f"{name}: relative error {error:.3g}"
    # The default backward adds dQ by atomics (its last bits may vary); under
    # torch.use_deterministic_algorithms(True) the deterministic kernels give the same bits twice.
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        runs = []
        for _ in range(2):
            leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
            out = emflow.torch.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.float().square().sum().backward()
            runs.append([t.grad.cpu() for t in leaves])
        for first, second in zip(*runs):
            assert torch.equal(first, second)
        for got, want in zip(runs[0], grads[0][1:]):
            assert (got.float() - want).norm() / want.norm() < 2 ** -7
    finally:
        torch.use_deterministic_algorithms(previous)
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        wide = [t.float() for t in (q, k, v)]
        got = emflow.torch.scaled_dot_product_attention(*(t.cuda() for t in wide), is_causal=True,
                                                        enable_gqa=True)
        want = emflow.torch.scaled_dot_product_attention(*wide, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
