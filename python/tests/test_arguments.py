"""The argument layer of emflow.attend / attend_factored and the run functions: every argument
that is not what the call needs is refused with a ValueError naming it (never read as something
else, never truncated, never nanobind's "incompatible function arguments"), and the capability
function emflow.route answers where a call runs."""
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import emflow


def problem(batch=2, tokens=9, dim=4, heads=3, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, tokens, dim)).astype(dtype)
    m = (rng.standard_normal((heads, dim, dim)) / np.sqrt(dim)).astype(dtype)
    f = (rng.standard_normal((heads, dim, dim)) / np.sqrt(dim)).astype(dtype)
    return x, m, f


def reference(x, m, f, **kwargs):
    return emflow.reference.attend(np.ascontiguousarray(x), m, f, **kwargs)[0]


# A view that is not C-contiguous must never be read as if it were: strided, reversed,
# Fortran order, transposed.
VIEWS = {
    "strided": lambda x: x[:, ::2],
    "reversed": lambda x: x[:, ::-1],
    "fortran": np.asfortranarray,
    "transposed": lambda x: np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_a_non_contiguous_x_is_refused_naming_it(view, device):
    x, m, f = problem(tokens=10)
    v = VIEWS[view](x)
    assert not v.flags.c_contiguous
    with pytest.raises(ValueError, match=r"attend: argument 'x' .* is not C-contiguous"):
        emflow.attend(v, m, f, device=device)
    got = emflow.attend(v, m, f, device=device, copy=True)
    np.testing.assert_allclose(got, reference(v, m, f), rtol=2e-5, atol=2e-5)


def test_a_non_contiguous_x_is_refused_by_attend_factored():
    x, _, _ = problem(tokens=10)
    rng = np.random.default_rng(1)
    a, b, v = (rng.standard_normal((3, 2, 4)).astype(np.float32) for _ in range(3))
    u = rng.standard_normal((3, 4, 2)).astype(np.float32)
    with pytest.raises(ValueError, match=r"attend_factored: argument 'x' .* not C-contiguous"):
        emflow.attend_factored(x[:, ::2], a, b, u, v)
    got = emflow.attend_factored(x[:, ::2], a, b, u, v, copy=True)
    m = np.einsum("hrd,hre->hde", a, b)
    f = np.einsum("hdr,hre->hde", u, v)
    np.testing.assert_allclose(got, reference(x[:, ::2], m, f), rtol=1e-4, atol=1e-5)


def test_torch_views_of_x_are_refused():
    torch = pytest.importorskip("torch")
    x, m, f = problem()
    t = torch.from_numpy(x)
    for view in (t.transpose(1, 2).contiguous().transpose(1, 2), t[:, ::2],
                 t[:1].expand(3, 9, 4)):
        with pytest.raises(ValueError, match=r"argument 'x' .* not C-contiguous"):
            emflow.attend(view, torch.from_numpy(m), torch.from_numpy(f))


@pytest.mark.parametrize("mask, shown", [
    (("window", 2.7), "window:2.7"), (("window", "3"), "window:'3'"),
    (("window", 2**70), f"window:{2**70}"), (("window", 0), "window:0"),
    (("window", True), "window:True"), ("window:-1", "window:-1"), ("sideways", "sideways"),
])
def test_masks_are_parsed_by_the_library(mask, shown):
    x, m, f = problem()
    with pytest.raises(ValueError, match=r"argument 'mask' .*got '" + shown.replace("(", r"\(")
                       .replace(")", r"\)") + "'"):
        emflow.attend(x, m, f, mask=mask)
    with pytest.raises(ValueError, match="argument 'mask'"):
        emflow.reference.attend(x, m, f, mask=mask)


def test_mask_forms_agree():
    x, m, f = problem(tokens=12)
    expected = reference(x, m, f, mask="window:3")
    for mask in (("window", 3), ("window", np.int64(3)), "window:3", " window:3 "):
        np.testing.assert_allclose(emflow.attend(x, m, f, mask=mask), expected, rtol=2e-5,
                                   atol=2e-5)


@pytest.mark.parametrize("lengths", [[9, 2.7], [9.0, 2.0], [True, 2], ["9", "2"], [9, 2**70]])
def test_key_lengths_are_integers_or_refused(lengths):
    x, m, f = problem()
    with pytest.raises(ValueError, match="argument 'key_lengths'"):
        emflow.attend(x, m, f, key_lengths=lengths)
    with pytest.raises(ValueError, match="argument 'key_lengths'"):
        emflow.reference.attend(x, m, f, key_lengths=lengths)


def test_key_lengths_of_any_integer_type_are_taken():
    x, m, f = problem()
    expected = reference(x, m, f, key_lengths=[9, 4])
    for lengths in ([9, 4], (9, 4), np.array([9, 4], np.int32), np.array([9, 4], np.uint8)):
        np.testing.assert_allclose(emflow.attend(x, m, f, key_lengths=lengths), expected,
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [100000, 2**40, 2**70, -1])
def test_thread_counts_are_bounded(threads):
    x, m, f = problem()
    limit = emflow.max_threads()
    assert limit >= 4
    with pytest.raises(ValueError, match="argument 'threads'"):
        emflow.attend(x, m, f, threads=threads, device="cpu")
    with pytest.raises(ValueError, match="argument 'threads'"):
        emflow.flow(x[:1].astype(np.float64), time=0.2, threads=threads)
    with pytest.raises(ValueError, match="argument 'threads'"):
        emflow.phase(tokens=4, clouds=2, beta_count=2, time=0.2, threads=threads)


def test_the_largest_thread_count_runs():
    x, m, f = problem()
    got = emflow.attend(x, m, f, threads=emflow.max_threads(), device="cpu")
    np.testing.assert_allclose(got, reference(x, m, f), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match=f"at most {emflow.max_threads()}"):
        emflow.attend(x, m, f, threads=emflow.max_threads() + 1, device="cpu")
    with pytest.raises(ValueError, match="must be an integer, got 2.5"):
        emflow.attend(x, m, f, threads=2.5)


def test_arrays_the_array_layer_cannot_take_are_refused_by_name():
    x, m, f = problem()
    with pytest.raises(ValueError, match=r"'x' has dtype >f4 \(not the machine's byte order\)"):
        emflow.attend(x.astype(">f4"), m, f)
    with pytest.raises(ValueError, match=r"'content' has dtype >f4"):
        emflow.attend(x, m, f.astype(">f4"))
    with pytest.raises(ValueError, match=r"'x' has dtype object"):
        emflow.attend(x.astype(object), m, f)
    with pytest.raises(ValueError, match=r"'relevance' has dtype <U"):
        emflow.attend(x, m.astype(str), f)
    out = np.empty_like(x)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"'out' is read-only"):
        emflow.attend(x, m, f, out=out)
    with pytest.raises(ValueError, match=r"'out' is a list"):
        emflow.attend(x, m, f, out=[0.0])
    # With copy=True the byte order and the object dtype are converted.
    np.testing.assert_allclose(emflow.attend(x.astype(">f4"), m.astype(">f4"), f, copy=True),
                               reference(x, m, f), rtol=2e-5, atol=2e-5)


def test_empty_arrays_get_the_library_s_message():
    _, m, f = problem()
    with pytest.raises(ValueError, match=r"argument 'tokens' must be >= 1, got 0"):
        emflow.attend(np.zeros((2, 0, 4), np.float32), m, f)
    empty = np.zeros((0, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"argument 'heads' must be >= 1, got 0"):
        emflow.attend(np.zeros((2, 3, 4), np.float32), empty, empty)


def test_torch_tensors_the_array_layer_cannot_take_are_refused_by_name():
    torch = pytest.importorskip("torch")
    x, m, f = (torch.from_numpy(a) for a in problem())
    with pytest.raises(ValueError, match=r"'x' is a meta tensor"):
        emflow.attend(torch.empty(2, 9, 4, device="meta"), m, f)
    with pytest.raises(ValueError, match=r"'relevance' requires grad"):
        emflow.attend(x, m.clone().requires_grad_(), f)
    with pytest.raises(ValueError, match=r"'x' has layout torch.sparse_coo"):
        emflow.attend(x[0].to_sparse(), m[0], f[0])


def test_route_answers_from_shapes_alone():
    x, m, f = problem()
    r = emflow.route(x, m, f)
    assert r.supported and r.reason == "" and r.device in ("cpu", "cuda")
    if r.device == "cpu":
        assert (r.kernel, r.computes, r.products) == ("cpu_fused", "float32", "fp32")
        assert str(r) == "cpu cpu_fused fp32"
    double = emflow.route(x.astype(np.float64), m, f, device="cpu")
    assert (double.kernel, double.computes) == ("reference", "float64")
    assert str(double) == "cpu reference fp64"
    ref = emflow.route(x, m, f, device="reference")
    assert (ref.device, ref.kernel) == ("reference", "reference")
    factored = emflow.route_factored(x, np.zeros((3, 2, 4)), np.zeros((3, 2, 4)),
                                     np.zeros((3, 4, 2)), np.zeros((3, 2, 4)), device="reference")
    assert factored.expanded and factored.device == "reference"
    half = emflow.route(x.astype(np.float16), m, f)
    assert not half.supported and "float16" in half.reason and "'x'" in half.reason
    with pytest.raises(ValueError, match="argument 'mask'"):
        emflow.route(x, m, f, mask=("window", 2.5))


def test_route_names_a_missing_gpu_and_agrees_with_attend():
    x, m, f = problem()
    r = emflow.route(x, m, f, weights=True, device="cuda")
    available, reason = emflow.cuda_available()
    if available:
        assert r.supported and r.device == "cuda" and r.kernel == "cuda_unfused"
        return
    assert not r.supported and r.device_missing and r.device == "cuda"
    with pytest.raises(NotImplementedError) as refused:
        emflow.attend(x, m, f, device="cuda")
    assert "unavailable" in r.reason and "unavailable" in str(refused.value)
    assert emflow.resolve_device("auto") == emflow.route(x, m, f).device == "cpu"


def test_route_takes_torch_meta_tensors():
    torch = pytest.importorskip("torch")
    x = torch.empty(2, 9, 4, device="meta")
    m = torch.empty(3, 4, 4, device="meta")
    r = emflow.route(x, m, m, lse=True, device="cpu")
    assert r.supported and (r.device, r.kernel) == ("cpu", "cpu_fused")


def test_integer_arguments_of_the_run_functions_are_checked():
    with pytest.raises(ValueError, match="argument 'tokens' must be an integer, got 2.5"):
        emflow.initial_clouds(tokens=2.5)
    with pytest.raises(ValueError, match=r"argument 'seed' must be in \[0, "):
        emflow.initial_clouds(seed=-1)
    with pytest.raises(ValueError, match="argument 'layers' must be an integer"):
        emflow.flow(np.ones((1, 3, 2)), layers=1.5)


def test_sizes_that_cannot_fit_are_refused_before_allocating():
    start = time.monotonic()
    with pytest.raises(MemoryError, match=r"phase: argument 'tokens' is too large: .* bytes"):
        emflow.phase(tokens=10**9, clouds=1, beta_count=1, dim=2, time=0.1)
    with pytest.raises(ValueError, match=r"phase: argument 'tokens' is too large: clouds 2048"):
        emflow.phase(tokens=10**9)
    with pytest.raises(MemoryError, match=r"initial_clouds: argument 'tokens' .* bytes"):
        emflow.initial_clouds(tokens=10**12, dim=100)
    with pytest.raises(ValueError, match=r"initial_clouds: argument 'batch' is too large"):
        emflow.initial_clouds(batch=2**62, tokens=4, dim=4)
    assert time.monotonic() - start < 5


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("run", ["flow", "phase"])
def test_ctrl_c_stops_a_run_without_a_callback(run):
    def interrupt():
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    if run == "flow":
        x0 = emflow.initial_clouds("sphere", tokens=48, dim=3, seed=1)
        call = lambda: emflow.flow(x0, time=1e5, dt=0.1, record_every=10**7, device="cpu")
    else:
        # The sweep reports (and so checks) after each block of 16 clouds: the default sweep
        # has 11520 of them.
        call = lambda: emflow.phase(tokens=32, dim=2, clouds=2048, beta_count=90, time=30.0,
                                    dt=0.1, device="cpu", threads=1)
    killer = threading.Thread(target=interrupt)
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        killer.join()
    # The whole run takes minutes; the interrupt ends it at the step it arrives in.
    assert time.monotonic() - start < 10
