"""Gradients through emflow.torch: the SDPA drop-in against torch's own scaled_dot_product_attention
(forward and gradients, float32 and float64, causal or not, grouped heads, Nq != Nk), gradcheck in
float64 of every operator under every mask, zero gradients for queries that see no key, the
refusals by name, a compiled training step (torch.compile fullgraph, aot_eager) whose graphs
hold the backward operators, and the example python/examples/fit_clustering.py run as a user runs
it (here rather than in a file of its own: a process of its own would import torch again)."""
import math
import os
import pathlib
import re
import runpy
import sys

import pytest

torch = pytest.importorskip("torch")

import emflow  # noqa: E402
import emflow.torch  # noqa: E402

sdpa = torch.nn.functional.scaled_dot_product_attention
drop_in = emflow.torch.scaled_dot_product_attention

MASKS = [None, "causal", ("window", 2)]


def randn(*shape, dtype=torch.float64, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_(True)


def qkv(batch, heads, kv_heads, nq, nk, rank=4, value_rank=3, dtype=torch.float64):
    return (randn(batch, heads, nq, rank, dtype=dtype, seed=1),
            randn(batch, kv_heads, nk, rank, dtype=dtype, seed=2),
            randn(batch, kv_heads, nk, value_rank, dtype=dtype, seed=3))


def gradients(out, inputs, seed=4):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


# shapes (batch, Hq, Hkv, Nq, Nk, E): plain heads, grouped heads with Nq < Nk, multi-query with
# Nq > Nk, and one long enough to span several blocks of the fused engine
SHAPES = [(2, 2, 2, 6, 6, 4), (2, 4, 2, 3, 7, 4), (1, 3, 1, 7, 4, 4), (1, 4, 2, 70, 133, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_drop_in_matches_torch(dtype, is_causal, shape):
    batch, heads, kv_heads, nq, nk, rank = shape
    inputs = qkv(batch, heads, kv_heads, nq, nk, rank=rank, dtype=dtype)
    gqa = heads != kv_heads
    got = drop_in(*inputs, is_causal=is_causal, enable_gqa=gqa)
    want = sdpa(*inputs, is_causal=is_causal, enable_gqa=gqa)
    # float32: the same sums in another order, a few ulps of values of order 1
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(gradients(got, inputs), gradients(want, inputs)):
        assert w.abs().max() > 0.05  # the gradient is not vacuous
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_drop_in_in_16_bits_is_as_accurate_as_torch(dtype, is_causal, shape):
    # Output and gradients in bfloat16 and float16 (the bfloat16 backward on AVX512-BF16 where
    # the processor has it, docs/MATH.md §8.8) against the float64 result of the same stored
    # inputs and upstream gradient: within twice torch's own 16-bit error, or a floor of two
    # ulps of the largest entry where torch's is smaller (a few entries round alike).
    batch, heads, kv_heads, nq, nk, rank = shape
    exact_inputs = [a.detach().to(dtype).double().requires_grad_(True)
                    for a in qkv(batch, heads, kv_heads, nq, nk, rank=rank)]
    inputs = [a.detach().to(dtype).requires_grad_(True) for a in exact_inputs]
    gqa = heads != kv_heads
    exact = sdpa(*exact_inputs, is_causal=is_causal, enable_gqa=gqa)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    results = {}
    for name, function in (("emflow", drop_in), ("torch", sdpa)):
        out = function(*inputs, is_causal=is_causal, enable_gqa=gqa)
        assert out.dtype == dtype
        results[name] = [out] + list(gradients(out, inputs))
    wanted = [exact] + list(gradients(exact, exact_inputs))
    for what, got, theirs, want in zip(("output", "dQ", "dK", "dV"), results["emflow"],
                                       results["torch"], wanted):
        assert want.abs().max() > 0.05  # not vacuous
        error = (got.double() - want).abs().max().item()
        bound = max(2 * (theirs.double() - want).abs().max().item(),
                    2 * ulp * want.abs().max().item())
        assert error <= bound, f"{what}: error {error} > {bound}"


def test_drop_in_scale_and_unbatched():
    q, k, v = (a.detach()[0] for a in qkv(1, 2, 2, 5, 6))  # (H, N, E)
    torch.testing.assert_close(drop_in(q, k, v, scale=0.3, is_causal=True),
                               sdpa(q, k, v, scale=0.3, is_causal=True), rtol=1e-12, atol=1e-13)


def test_drop_in_refuses_by_name():
    q, k, v = (a.detach() for a in qkv(1, 2, 1, 4, 4, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match="'dropout_p' is 0.1"):
        drop_in(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="'attn_mask' is given"):
        drop_in(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(ValueError, match="'query' has 2 heads and 'key' 1.*enable_gqa"):
        drop_in(q, k, v)
    with pytest.raises(ValueError, match="'query' has 3 heads, expected a multiple of the 2"):
        drop_in(torch.zeros(1, 3, 4, 4), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4),
                enable_gqa=True)
    with pytest.raises(ValueError, match="argument 'key' is \\(4, 4\\)"):
        drop_in(q, k[0, 0], v)
    with pytest.raises(ValueError, match="sdpa_attend: argument 'query' has dtype int32, "
                                         "expected float32, float64, bfloat16 or float16"):
        drop_in(q.int(), k.int(), v.int(), enable_gqa=True)
    with pytest.raises(ValueError, match="argument 'key' has dtype float64"):
        drop_in(q, k.double(), v, enable_gqa=True)
    with pytest.raises(NotImplementedError, match="'query' is on meta, expected a CPU or CUDA tensor"):
        drop_in(*(a.to("meta") for a in (q, k, v)), enable_gqa=True)


def finite(lse):
    # lse is -inf for a query that sees no key: a loss reads it where it is finite
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lengths", [None, [5, 0]])
def test_gradcheck_sdpa(mask, lengths):
    inputs = qkv(2, 2, 1, 4, 5)

    def f(q, k, v):
        out, lse = emflow.torch.sdpa_attend(q, k, v, scale=0.7, mask=mask, key_lengths=lengths,
                                            lse=True)
        return out, finite(lse)

    assert torch.autograd.gradcheck(f, inputs)


def dense_layer(seed=0, batch=2, tokens=5, dim=3, heads=2):
    return (randn(batch, tokens, dim, seed=seed), randn(heads, dim, dim, seed=seed + 1, scale=0.6),
            randn(heads, dim, dim, seed=seed + 2, scale=0.6), randn(heads, dim, seed=seed + 3),
            randn(dim, seed=seed + 4))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lengths", [None, [5, 2]])
def test_gradcheck_attend(mask, lengths):
    def f(x, m, c, u, offset):
        r = emflow.torch.attend(x, m, c, key_bias=u, offset=offset, beta=0.8, mask=mask,
                                key_lengths=lengths, lse=True, entropy=True)
        return r.update, finite(r.lse), r.entropy

    assert torch.autograd.gradcheck(f, dense_layer())


def factored_layer(seed=0, batch=2, tokens=5, dim=3, heads=2, rank=2):
    return (randn(batch, tokens, dim, seed=seed), randn(heads, rank, dim, seed=seed + 1),
            randn(heads, rank, dim, seed=seed + 2), randn(heads, dim, rank, seed=seed + 3),
            randn(heads, rank, dim, seed=seed + 4), randn(heads, dim, seed=seed + 5),
            randn(dim, seed=seed + 6))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("lengths", [None, [5, 2]])
def test_gradcheck_attend_factored(mask, lengths):
    def f(x, a, b, u, v, bias, offset):
        r = emflow.torch.attend_factored(x, a, b, u, v, key_bias=bias, offset=offset, beta=0.8,
                                         mask=mask, key_lengths=lengths, lse=True)
        return r.update, finite(r.lse)

    assert torch.autograd.gradcheck(f, factored_layer())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_queries_without_keys_get_zero_gradient(dtype):
    q, k, v = qkv(2, 2, 2, 4, 5, dtype=dtype)
    out, lse = emflow.torch.sdpa_attend(q, k, v, key_lengths=[3, 0], lse=True)
    loss = out.sum() + finite(lse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
        assert torch.all(g[1] == 0)  # cloud 1 has no key
        assert g[0].abs().max() > 0.05
    assert torch.all(dk[0, :, 3:] == 0) and torch.all(dv[0, :, 3:] == 0)  # hidden keys
    # a layer whose padding tokens are neither queries nor visible keys
    x, m, f, _, _ = (a.to(dtype).detach().requires_grad_(True) for a in dense_layer())
    r = emflow.torch.attend(x, m, f, mask="causal", key_lengths=[5, 2], lse=True)
    dx, = torch.autograd.grad(r.update.sum() + finite(r.lse).sum(), (x,))
    assert torch.isfinite(dx).all() and torch.all(dx[1, 2:] == 0) and dx[1, :2].abs().max() > 0
    # NaN in the padding tokens reaches nothing (they are never read), in either form
    x_nan = x.detach().clone()
    x_nan[1, 2:] = float("nan")
    x_nan.requires_grad_(True)
    factored = [a.to(dtype).detach().requires_grad_(True) for a in factored_layer()[1:5]]
    for y, operators in ((emflow.torch.attend(x_nan, m, f, key_lengths=[5, 2]), (m, f)),
                         (emflow.torch.attend_factored(x_nan, *factored, key_lengths=[5, 2]),
                          factored)):
        grads = torch.autograd.grad(y.sum(), (x_nan, *operators))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[0][1, 2:] == 0) and grads[0][1, :2].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_factored_gradients_match_torch_attention(dtype, is_causal):
    """The factored layer is multi-head attention with A = W_Q / sqrt(d_k), B = W_K, V = W_V and
    U = W_O: its gradients against those of the same layer written with torch's SDPA."""
    x = randn(2, 9, 6, dtype=dtype, seed=5)
    wq, wk, wv = (randn(2, 3, 6, dtype=dtype, seed=6 + i, scale=0.5) for i in range(3))
    wo = randn(2, 6, 3, dtype=dtype, seed=9, scale=0.5)
    inputs = (x, wq, wk, wv, wo)
    project = lambda w: torch.einsum("bnd,hkd->bhnk", x, w)
    o = sdpa(project(wq), project(wk), project(wv), is_causal=is_causal)
    want = torch.einsum("bhnk,hdk->bnd", o, wo)
    got = emflow.torch.attend_factored(x, wq / math.sqrt(3), wk, wo, wv,
                                       mask="causal" if is_causal else None)
    # float32: the chain rule through the projections sums a few hundred products per entry
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(gradients(got, inputs), gradients(want, inputs)):
        assert w.abs().max() > 0.05
        torch.testing.assert_close(g, w, **tol)


def test_float32_layer_gradient_matches_float64():
    inputs64 = dense_layer(seed=3)
    inputs32 = [a.detach().float().requires_grad_(True) for a in inputs64]

    def grads(inputs):
        y = emflow.torch.attend(*inputs[:3], key_bias=inputs[3], offset=inputs[4],
                                mask="causal")
        return gradients(y, inputs)

    for g32, g64 in zip(grads(inputs32), grads(inputs64)):
        torch.testing.assert_close(g32.double(), g64, rtol=1e-5, atol=1e-5)


def test_weights_gradient_is_refused():
    x, m, f, _, _ = dense_layer()
    r = emflow.torch.attend(x, m, f, weights=True)
    with pytest.raises(NotImplementedError, match="gradient through 'weights'"):
        r.weights.sum().backward()
    r = emflow.torch.attend(x, m, f, weights=True)
    r.update.sum().backward()  # weights returned but not in the loss: fine
    assert m.grad is not None and m.grad.abs().max() > 0


def test_backward_on_cuda_device_is_refused():
    q, k, v = (a.detach() for a in qkv(1, 1, 1, 3, 3))
    out, lse = torch.empty(1, 1, 3, 3, dtype=q.dtype), torch.empty(1, 1, 3, dtype=q.dtype)
    emflow._emflow.sdpa_attend(q, k, v, 1.0, "none", None, None, 0, None, out, lse, None, "cpu",
                               0)
    grads = [torch.empty_like(a) for a in (q, k, v)]
    with pytest.raises(NotImplementedError, match="sdpa_backward"):
        emflow._emflow.sdpa_backward(q, k, v, 1.0, "none", None, None, 0, None, out, lse, None,
                                     torch.ones_like(out), None, None, *grads, "cuda", 0)
    with pytest.raises(ValueError, match="sdpa_backward: argument 'd_key' has shape"):
        emflow._emflow.sdpa_backward(q, k, v, 1.0, "none", None, None, 0, None, out, lse, None,
                                     torch.ones_like(out), None, None, grads[0], grads[2],
                                     grads[1], "cpu", 0)


def cuda_ready():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    available, reason = emflow.cuda_available()
    return None if available else f"emflow cannot use CUDA: {reason}"


@pytest.mark.skipif(cuda_ready() is not None, reason=str(cuda_ready()))
def test_gradient_through_cuda_tensors_is_refused():
    x, m, f, _, _ = (a.detach().float().cuda().requires_grad_(True) for a in dense_layer())
    y = emflow.torch.attend(x, m, f)  # the forward pass runs on the GPU
    with pytest.raises(NotImplementedError, match="attend_backward: CUDA arrays: no GPU path"):
        y.sum().backward()


class Model(torch.nn.Module):
    """One layer of each kind: a dense EMF layer, a factored one and the SDPA drop-in."""

    def __init__(self, dim=4, heads=2, rank=2):
        super().__init__()
        p = lambda *shape, seed: torch.nn.Parameter(randn(*shape, seed=seed, scale=0.5).detach())
        self.m, self.f = p(heads, dim, dim, seed=1), p(heads, dim, dim, seed=2)
        self.a, self.b = p(heads, rank, dim, seed=3), p(heads, rank, dim, seed=4)
        self.u, self.v = p(heads, dim, rank, seed=5), p(heads, rank, dim, seed=6)
        self.w = p(3, heads * rank, dim, seed=7)

    def forward(self, x):
        x = x + emflow.torch.attend(x, self.m, self.f, mask="causal")
        x = x + emflow.torch.attend_factored(x, self.a, self.b, self.u, self.v, mask="causal")
        batch, tokens, _ = x.shape
        q, k, v = (torch.einsum("bnd,ed->bne", x, w).reshape(batch, tokens, 2, -1).transpose(1, 2)
                   for w in self.w)
        return drop_in(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, tokens, -1)


def train_step(model, x, target, lr=0.05):
    loss = ((model(x) - target) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)
            p.grad = None
    return loss.detach()


def test_compiled_training_step_has_no_graph_break(monkeypatch):
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    # Dynamo traces Tensor.backward() into the graph only with this option.
    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", True)
    torch._dynamo.reset()
    graphs = []

    def keep(gm, _):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)  # aot_eager, graphs kept
    x, target = randn(2, 6, 4, seed=8).detach(), randn(2, 6, 4, seed=9).detach()
    eager, compiled = Model(), Model()
    step = torch.compile(train_step, fullgraph=True, backend=backend)
    losses = []
    for _ in range(3):
        losses.append(step(compiled, x, target))
        torch.testing.assert_close(losses[-1], train_step(eager, x, target), rtol=1e-12,
                                   atol=1e-14)
    assert losses[-1] < losses[0]
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    text = "\n".join(graphs)
    for op in ("attend_backward", "attend_factored_backward", "sdpa_backward"):
        assert f"emflow.{op}" in text, op
    assert math.isfinite(float(losses[-1]))


EXAMPLES = pathlib.Path(os.environ.get("EMFLOW_SOURCE_DIR",
                                       pathlib.Path(__file__).resolve().parents[2]))
EXAMPLES = EXAMPLES / "python" / "examples"


def test_example_fit_clustering(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fit_clustering.py", "30"])
    runpy.run_path(str(EXAMPLES / "fit_clustering.py"), run_name="__main__")
    printed = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", printed)]
    assert len(losses) == 7  # steps 0, 5, ..., 25 and 29
    # M = F = I pulls every cloud towards one cluster, far from the target; the fit separates it
    assert losses[0] > 0.3 and losses[-1] < 0.1 * losses[0]
    reached = int(re.search(r"within 30 degrees of their target: (\d+)%", printed).group(1))
    assert reached >= 90
