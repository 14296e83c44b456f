"""emflow.sdpa_attend on NumPy arrays against a plain NumPy softmax attention in float64: grouped
heads, Nq != Nk, every mask with both alignments, key and query lengths; the refusals by name."""
import numpy as np
import pytest

import emflow


def naive(q, k, v, scale, visible):
    """softmax(scale q k^T) v per head, over the keys visible(b, i, j); 0 and -inf without keys."""
    batch, heads, nq, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full(q.shape[:-1], -np.inf)
    for b in range(batch):
        for h in range(heads):
            s = scale * q[b, h] @ k[b, h // group].T
            for i in range(nq):
                keys = [j for j in range(k.shape[2]) if visible(b, i, j)]
                if keys:
                    m = s[i, keys].max()
                    w = np.exp(s[i, keys] - m)
                    lse[b, h, i] = m + np.log(w.sum())
                    out[b, h, i] = (w / w.sum()) @ v[b, h // group, keys]
    return out, lse


def problem(dtype=np.float64):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 5, 3)).astype(dtype)
    k = rng.standard_normal((2, 2, 7, 3)).astype(dtype)
    v = rng.standard_normal((2, 2, 7, 2)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", [None, "causal", ("window", 2)])
@pytest.mark.parametrize("top_left", [False, True])
def test_matches_naive(dtype, mask, top_left):
    q, k, v = problem(dtype)
    key_lengths, query_lengths = [7, 4], [5, 3]
    got = emflow.sdpa_attend(q, k, v, scale=0.6, mask=mask, key_lengths=key_lengths,
                             query_lengths=query_lengths, query_position=0 if top_left else None,
                             lse=True)
    width = {None: 10**9, "causal": 10**9}.get(mask, 2)

    def visible(b, i, j):
        if i >= query_lengths[b] or j >= key_lengths[b]:
            return False
        position = i if top_left else key_lengths[b] - query_lengths[b] + i
        return mask is None or (j <= position and j > position - width)

    want_out, want_lse = naive(*(a.astype(np.float64) for a in (q, k, v)), 0.6, visible)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert got.output.dtype == dtype and np.abs(want_out).max() > 0.1
    np.testing.assert_allclose(got.output, want_out, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isfinite(got.lse), np.isfinite(want_lse))
    real = np.isfinite(want_lse)
    np.testing.assert_allclose(got.lse[real], want_lse[real], rtol=tol, atol=tol)


def test_float16_returns_float32_statistics():
    # NumPy's float16 in, float16 out; lse and entropy are float32 (emflow::Stat<T>), and the
    # output is the float64 result rounded once, to float16's precision.
    q, k, v = problem()
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    got = emflow.sdpa_attend(q16, k16, v16, mask="causal", lse=True, entropy=True)
    assert got.output.dtype == np.float16
    assert got.lse.dtype == np.float32 and got.entropy.dtype == np.float32
    want = emflow.sdpa_attend(*(a.astype(np.float64) for a in (q16, k16, v16)), mask="causal",
                              lse=True)
    np.testing.assert_allclose(got.output, want.output, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="argument 'lse' has dtype float16, expected float32 "
                                         "\\(float32 for 16-bit storage\\)"):
        emflow._emflow.sdpa_attend(q16, k16, v16, 1.0, "none", None, None, 0, None,
                                   np.empty(q16.shape[:-1] + (v16.shape[-1],), np.float16),
                                   np.empty(q16.shape[:-1], np.float16), None, "cpu", 0)


def test_refuses_by_name():
    q, k, v = problem()
    with pytest.raises(ValueError, match="sdpa_attend: argument 'value' has dtype float32, "
                                         "expected float64 \\(the dtype of 'query'\\)$"):
        emflow.sdpa_attend(q, k, v.astype(np.float32))
    with pytest.raises(ValueError, match="argument 'key' has shape \\(2, 2, 7, 4\\), expected "
                                         "\\(2, 2, 7, 3\\)"):
        emflow.sdpa_attend(q, np.zeros((2, 2, 7, 4)), v)
    with pytest.raises(ValueError, match="argument 'query_heads' must be a multiple of"):
        emflow.sdpa_attend(q[:, :3].copy(), k, v)
    with pytest.raises(ValueError, match="argument 'query' has shape \\(4, 5, 3\\), expected 4"):
        emflow.sdpa_attend(q[0], k, v)
    with pytest.raises(ValueError, match="argument 'key' of shape .* is not C-contiguous"):
        emflow.sdpa_attend(q, np.swapaxes(np.swapaxes(k, 2, 3).copy(), 2, 3), v)
    with pytest.raises(ValueError, match="'key_lengths' entry 0 is 2.5"):
        emflow.sdpa_attend(q, k, v, key_lengths=[2.5, 3])
