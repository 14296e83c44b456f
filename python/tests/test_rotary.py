"""emflow.attend_factored with rotary positions and grouped kv heads against a small torch
implementation of Hugging Face's Llama attention (rotate_half / apply_rotary_pos_emb, repeat_kv)
and of GPT-J's interleaved rotation, in float64 with the float32 inv_freq transformers uses."""
import math

import numpy as np
import pytest

import emflow

torch = pytest.importorskip("torch")


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def repeat_kv(hidden, n_rep):
    batch, kv, tokens, head_dim = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(batch, kv, n_rep, tokens, head_dim)
    return hidden.reshape(batch, kv * n_rep, tokens, head_dim)


def llama_attention(x, wq, wk, wv, wo, heads, kv_heads, inv_freq, positions, interleaved):
    """The attention block of transformers' Llama (no biases), causal, in x's dtype."""
    batch, tokens, _ = x.shape
    head_dim = wq.shape[0] // heads
    q = (x @ wq.T).view(batch, tokens, heads, head_dim).transpose(1, 2)
    k = (x @ wk.T).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    v = (x @ wv.T).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)
    freqs = positions[:, None].to(x.dtype) * inv_freq[None, :].to(x.dtype)
    if interleaved:  # GPT-J: sin and cos repeated per pair
        cos, sin = freqs.cos().repeat_interleave(2, -1), freqs.sin().repeat_interleave(2, -1)
        q, k = q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin
    else:  # LlamaRotaryEmbedding + apply_rotary_pos_emb
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim) @ wo.T


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_transformers_rotary_and_repeat_kv(interleaved, kv_heads, dtype):
    rng = np.random.default_rng(7 + kv_heads)
    batch, tokens, dim, heads, head_dim, theta = 2, 11, 16, 4, 6, 100.0
    x = rng.standard_normal((batch, tokens, dim))
    s = 1 / np.sqrt(dim)
    wq = rng.standard_normal((heads * head_dim, dim)) * s
    wk = rng.standard_normal((kv_heads * head_dim, dim)) * s
    wv = rng.standard_normal((kv_heads * head_dim, dim)) * s
    wo = rng.standard_normal((dim, heads * head_dim)) * s
    # transformers' _compute_default_rope_parameters, in float32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(tokens)
    t = {name: torch.from_numpy(a) for name, a in dict(x=x, wq=wq, wk=wk, wv=wv, wo=wo).items()}
    want = llama_attention(t["x"], t["wq"], t["wk"], t["wv"], t["wo"], heads, kv_heads,
                           inv_freq.double(), positions, interleaved).numpy()
    # The same layer in factored form: A_h = W_Q,h / sqrt(d_k), B_g = W_K,g, V_g = W_V,g,
    # U_h = W_O,h.
    a = (wq / np.sqrt(head_dim)).reshape(heads, head_dim, dim)
    b = wk.reshape(kv_heads, head_dim, dim)
    v = wv.reshape(kv_heads, head_dim, dim)
    u = np.ascontiguousarray(wo.reshape(dim, heads, head_dim).transpose(1, 0, 2))
    rotary = emflow.Rotary(head_dim, pairing="interleaved" if interleaved else "half_split",
                           inverse_frequencies=inv_freq.double().numpy())
    arrays = [np.ascontiguousarray(m.astype(dtype)) for m in (x, a, b, u, v)]
    got = emflow.attend_factored(*arrays, mask="causal", kv_heads=kv_heads, rotary=rotary,
                                 device="cpu")
    tol = 1e-10 if dtype == np.float64 else 2e-5
    assert np.abs(got - want).max() <= tol * (1 + np.abs(want).max())
    # The rotation matters: the same layer without it is far off.
    plain = emflow.attend_factored(*arrays, mask="causal", kv_heads=kv_heads, device="cpu")
    assert np.abs(plain - want).max() > 1e-3
    # And the base gives the same frequencies (computed in double, so to float32 rounding).
    by_base = emflow.attend_factored(*arrays, mask="causal", kv_heads=kv_heads, device="cpu",
                                     rotary=emflow.Rotary(head_dim, base=theta,
                                                          pairing=rotary.pairing))
    assert np.abs(by_base - want).max() <= 1e-5 * (1 + np.abs(want).max())


def test_refusals_name_what_is_wrong():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4))
    a, b, v = (rng.standard_normal((2, 4, 4)) for _ in range(3))
    u = rng.standard_normal((2, 4, 4))
    with pytest.raises(ValueError, match="rotary.dim"):
        emflow.attend_factored(x, a, b, u, v, rotary=emflow.Rotary(3))
    with pytest.raises(ValueError, match="kv_heads"):
        three = np.concatenate([b, b[:1]])  # (3, r, d): the shape kv_heads=3 asks for
        emflow.attend_factored(x, a, three, u, three, kv_heads=3)
    with pytest.raises(NotImplementedError, match="'yarn'"):
        emflow.attend_factored(x, a, b, u, v, rotary=emflow.Rotary(4, scaling="yarn"))
    # B and V of kv heads must have kv_heads heads: a (H, r, d) key factor is refused.
    with pytest.raises(ValueError, match="key_factor"):
        emflow.attend_factored(x, a, b, u, v, kv_heads=1)
