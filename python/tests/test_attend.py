"""emflow.attend and emflow.attend_factored on NumPy arrays, against the double reference."""
import threading

import numpy as np
import pytest

import emflow


def problem(batch=2, tokens=9, dim=4, heads=3, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, tokens, dim)).astype(dtype)
    m = (rng.standard_normal((heads, dim, dim)) / np.sqrt(dim)).astype(dtype)
    f = (rng.standard_normal((heads, dim, dim)) / np.sqrt(dim)).astype(dtype)
    u = rng.standard_normal((heads, dim)).astype(dtype)
    c = rng.standard_normal(dim).astype(dtype)
    return x, m, f, u, c


@pytest.mark.parametrize("mask", [None, "causal", ("window", 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_matches_reference(mask, dtype):
    x, m, f, u, c = problem(dtype=dtype)
    lengths = [9, 5]
    got = emflow.attend(x, m, f, key_bias=u, offset=c, beta=0.7, mask=mask, key_lengths=lengths,
                        lse=True, entropy=True, weights=True, device="cpu")
    ref_update, ref_lse, ref_entropy, ref_weights = emflow.reference.attend(
        x, m, f, u, c, beta=0.7, mask=mask, key_lengths=lengths, weights=True)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert got.update.dtype == dtype and got.update.shape == x.shape
    np.testing.assert_allclose(got.update, ref_update, rtol=tol, atol=tol)
    real = np.isfinite(ref_lse)
    assert (~real).sum() == 3 * 4  # the padding queries of cloud 1, every head
    np.testing.assert_allclose(got.lse[real], ref_lse[real], rtol=tol, atol=tol)
    assert np.all(got.lse[~real] == -np.inf)
    np.testing.assert_allclose(got.entropy, ref_entropy, rtol=tol, atol=tol)
    np.testing.assert_allclose(got.weights, ref_weights, rtol=tol, atol=tol)
    assert np.abs(got.update[1, :5]).min() > 0 and np.all(got.update[1, 5:] == 0)


def test_one_head_one_cloud_shapes():
    x, m, f, u, c = problem(batch=1, heads=1)
    got = emflow.attend(x[0], m[0], f[0], key_bias=u[0], offset=c, lse=True)
    assert got.update.shape == (9, 4) and got.lse.shape == (9,) and got.entropy is None
    ref = emflow.reference.attend(x, m, f, u, c)
    np.testing.assert_allclose(got.update, ref[0][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got.lse, ref[1][0, 0], rtol=2e-5, atol=2e-5)


def test_devices_agree():
    x, m, f, u, c = problem(dtype=np.float64)
    cpu = emflow.attend(x, m, f, mask="causal", device="cpu")
    reference = emflow.attend(x, m, f, mask="causal", device="reference")
    np.testing.assert_allclose(cpu, reference, rtol=1e-12, atol=1e-12)


def test_factored_matches_dense():
    rng = np.random.default_rng(1)
    heads, rank, dim = 2, 3, 8
    x = rng.standard_normal((2, 16, dim)).astype(np.float32)
    a, b, v = (rng.standard_normal((heads, rank, dim)).astype(np.float32) / 3 for _ in range(3))
    u = rng.standard_normal((heads, dim, rank)).astype(np.float32) / 3
    m = np.einsum("hrd,hre->hde", a, b)  # M_h = A_h^T B_h
    f = np.einsum("hdr,hre->hde", u, v)  # F_h = U_h V_h
    for mask in (None, "causal"):
        got = emflow.attend_factored(x, a, b, u, v, mask=mask, key_lengths=[16, 11], lse=True)
        ref = emflow.reference.attend(x, m, f, mask=mask, key_lengths=[16, 11])
        np.testing.assert_allclose(got.update, ref[0], rtol=1e-4, atol=1e-5)
        real = np.isfinite(ref[1])
        np.testing.assert_allclose(got.lse[real], ref[1][real], rtol=1e-5, atol=1e-5)


def test_out_is_written_in_place():
    x, m, f, _, _ = problem()
    out = np.full_like(x, np.nan)
    address = out.ctypes.data
    result = emflow.attend(x, m, f, out=out)
    assert result is out and out.ctypes.data == address
    np.testing.assert_allclose(out, emflow.reference.attend(x, m, f)[0], rtol=2e-5, atol=2e-5)


def test_wrong_arrays_are_refused_naming_the_argument():
    x, m, f, u, _ = problem()
    with pytest.raises(ValueError, match=r"'relevance' has dtype float64, expected float32"):
        emflow.attend(x, m.astype(np.float64), f)
    with pytest.raises(ValueError, match=r"'content' of shape \(3, 4, 4\) is not C-contiguous"):
        emflow.attend(x, m, f.transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"'key_bias' has shape \(4,\), expected \(3, 4\)"):
        emflow.attend(x, m, f, key_bias=u[0])
    with pytest.raises(ValueError, match=r"'out' has shape \(9, 4\), expected \(2, 9, 4\)"):
        emflow.attend(x, m, f, out=np.empty((9, 4), np.float32))
    with pytest.raises(ValueError, match=r"'x' has dtype int64"):
        emflow.attend(np.zeros((2, 3), np.int64), m[0], f[0])
    with pytest.raises(ValueError, match="mask"):
        emflow.attend(x, m, f, mask="sideways")
    # The library's own checks come through as ValueError with its message.
    with pytest.raises(ValueError, match="key_lengths"):
        emflow.attend(x, m, f, key_lengths=[9, 10])


def test_copy_converts_instead_of_refusing():
    x, m, f, _, _ = problem()
    got = emflow.attend(x.astype(np.float64), m.transpose(0, 2, 1), f, copy=True)
    assert got.dtype == np.float64
    ref = emflow.reference.attend(x, m.transpose(0, 2, 1), f)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_missing_cuda_is_not_implemented():
    if emflow.cuda_available()[0]:
        pytest.skip("a CUDA device is present")
    x, m, f, _, _ = problem()
    with pytest.raises(NotImplementedError):
        emflow.attend(x, m, f, device="cuda")
    assert emflow.resolve_device("auto") == "cpu"


def test_gil_is_released_during_compute():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 700, 16))
    m = rng.standard_normal((1, 16, 16)) / 4
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        before = count[0]
        emflow.attend(x, m, m, device="reference")  # double reference: about 0.1 s or more
        during = count[0] - before
    finally:
        stop.set()
        thread.join()
    assert during > 1000


def test_mha_conversion_matches_mha_reference():
    rng = np.random.default_rng(3)
    heads, dim, head_dim = 2, 6, 3
    wq, wk, wv = (rng.standard_normal((heads * head_dim, dim)) / 2 for _ in range(3))
    wo = rng.standard_normal((dim, heads * head_dim)) / 2
    bq, bk, bv = (rng.standard_normal(heads * head_dim) for _ in range(3))
    bo = rng.standard_normal(dim)
    x = rng.standard_normal((2, 7, dim))
    weights = dict(query_bias=bq, key_bias=bk, value_bias=bv, output_bias=bo)
    m, f, u, c = emflow.mha_to_emf(wq, wk, wv, wo, heads=heads, **weights)
    assert m.shape == (heads, dim, dim) and u.shape == (heads, dim) and c.shape == (dim,)
    mha = emflow.mha_reference(x, wq, wk, wv, wo, heads=heads, mask="causal", **weights)
    emf = emflow.attend(x, m, f, key_bias=u, offset=c, mask="causal")
    np.testing.assert_allclose(emf, mha, rtol=1e-10, atol=1e-10)
    assert np.abs(mha).max() > 0.1


def test_reference_pieces_compose_to_attend():
    x, m, f, u, c = problem(batch=1, heads=1, dtype=np.float64)
    r = emflow.reference.relevance_gradients(x, m[0])
    s = emflow.reference.scores(r, x, u[0], beta=1.0, mask="causal")
    p, lse, entropy = emflow.reference.masked_softmax(s)
    delta = emflow.reference.contextual_update(p, emflow.reference.content(x, f[0]), c)
    full = emflow.reference.attend(x, m, f, u, c, mask="causal")
    np.testing.assert_allclose(delta, full[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, full[1][:, 0], rtol=1e-12)
    np.testing.assert_allclose(emflow.reference.residual_update(x, delta), x + delta)
    with pytest.raises(ValueError, match="relevance"):
        emflow.reference.relevance_gradients(x, np.eye(3))


def test_machine_names_the_cpu_path_and_every_path_computes_the_same():
    """emflow.machine(): the CPU engine's paths and the one taken; a process made to take each
    lower path (EMFLOW_CPU_PATH) computes the update that the reference does."""
    import json
    import os
    import platform
    import subprocess
    import sys

    info = emflow.machine()
    for key in ("cpu", "cpu_features", "cpu_paths", "cpu_path", "cpu_path_uses", "cpu_missing",
                "avx512_bf16", "cuda_built", "cuda_device", "cuda_reason"):
        assert key in info, key
    if info["cpu_missing"]:
        pytest.skip("no path of the CPU engine runs here: " + info["cpu_missing"])
    assert info["cpu_path"] in info["cpu_paths"]
    assert info["avx512_bf16"] == (info["cpu_path"] == "avx512bf16")
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    assert info["cpu_paths"] == ["avx2", "avx512", "avx512bf16"]
    script = ("import json, numpy as np, emflow\n"
              "rng = np.random.default_rng(3)\n"
              "x = rng.standard_normal((2, 40, 8)).astype(np.float32)\n"
              "m = (rng.standard_normal((2, 8, 8)) / 3).astype(np.float32)\n"
              "f = (rng.standard_normal((2, 8, 8)) / 3).astype(np.float32)\n"
              "got = emflow.attend(x, m, f, mask='causal', device='cpu')\n"
              "ref = emflow.reference.attend(x, m, f, mask='causal')[0]\n"
              "print(json.dumps([emflow.machine()['cpu_path'],"
              " float(np.abs(got - ref).max() / np.abs(ref).max())]))\n")
    for path in info["cpu_paths"][:info["cpu_paths"].index(info["cpu_path"]) + 1]:
        env = dict(os.environ, EMFLOW_CPU_PATH=path)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True)
        taken, error = json.loads(run.stdout.strip().splitlines()[-1])
        assert taken == path
        assert 0 < error < 1e-5
    refused = subprocess.run([sys.executable, "-c", "import emflow; emflow.machine()"],
                             env=dict(os.environ, EMFLOW_CPU_PATH="sse9"), capture_output=True,
                             text=True)
    assert refused.returncode != 0
    assert "EMFLOW_CPU_PATH names 'sse9'" in refused.stderr
