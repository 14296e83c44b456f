"""A seeded property test of the Python argument layer (the counterpart of fuzz_attend_cli for
`emflow attend`): random shapes, dtypes, strides and layouts (C order, strided, reversed,
Fortran order, transposed, broadcast, misaligned), NumPy or torch arrays, every device, masks,
key lengths, optional inputs and outputs, copy=True or not. For every case exactly one of:

* the call fails with a ValueError that names an argument the case made bad (the wrong dtype,
  a layout that is not C-contiguous without copy=True, a bad mask, key length or thread count),
* it fails with NotImplementedError because the device it names is missing,
* it returns what emflow.reference computes on contiguous float64 copies of the same values.

Anything else (another exception, nanobind's "incompatible function arguments", a crash, a
result that differs) fails the case, which is reported with its seed. EMFLOW_FUZZ_CASES and
EMFLOW_FUZZ_SEED change the count and the first seed."""
import os

import numpy as np
import pytest

import emflow

try:
    import torch
except ImportError:  # the torch cases are left out
    torch = None

CASES = int(os.environ.get("EMFLOW_FUZZ_CASES", "600"))
FIRST_SEED = int(os.environ.get("EMFLOW_FUZZ_SEED", "20240"))
CUDA = emflow.cuda_available()[0]
TORCH_CUDA = torch is not None and CUDA and torch.cuda.is_available()
LAYOUTS = ["c", "c", "c", "c", "strided", "reversed", "fortran", "transposed", "broadcast",
           "misaligned"]
WRONG_DTYPES = [np.int32, np.float16, ">f4", ">f8", np.int64]


class Case:
    """One random call: the logical values (float64), how each array is presented, and the set
    of argument names the case made bad."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.seed = seed
        self.bad = set()
        self.factored = rng.random() < 0.3
        self.dtype = np.float32 if rng.random() < 0.6 else np.float64
        frameworks = ["numpy"] * 3 + (["torch"] if torch is not None else [])
        frameworks += ["torch-cuda"] if TORCH_CUDA else []
        self.framework = rng.choice(frameworks)
        self.copy = rng.random() < 0.25
        # About half the cases present every array in C order (or misaligned) with the right
        # dtype, so that the calls that compute are as many as those that are refused.
        self.tidy = rng.random() < 0.5
        self.batched = rng.random() < 0.75
        self.multihead = rng.random() < 0.7
        self.B = int(rng.integers(1, 4)) if self.batched else 1
        self.N = int(rng.integers(1, 14))
        self.d = int(rng.integers(1, 7))
        self.H = int(rng.integers(1, 4)) if self.multihead else 1
        self.r = int(rng.integers(1, 5))
        self.beta = float(rng.uniform(-2, 2))
        self.mask, mask_ok = self.random_mask()
        if not mask_ok:
            self.bad.add("mask")
        self.lengths = None
        if rng.random() < 0.35:
            self.lengths = [int(v) for v in rng.integers(0, self.N + 1, size=self.B)]
            if rng.random() < 0.08:
                self.lengths[0] = self.N + 1  # out of range: the library's check
                self.bad.add("key_lengths")
            elif rng.random() < 0.05:
                self.lengths = [float(v) + 0.5 for v in self.lengths]  # never truncated
                self.bad.add("key_lengths")
        self.threads = int(rng.choice([0, 0, 0, 1, 2, emflow.max_threads()]))
        if rng.random() < 0.03:
            self.threads = emflow.max_threads() + int(rng.integers(1, 100000))
            self.bad.add("threads")
        devices = ["cpu", "cpu", "reference", "auto", "cuda"]
        self.device = "cuda" if self.framework == "torch-cuda" else str(rng.choice(devices))
        self.lse, self.entropy, self.weights = (bool(rng.random() < 0.4) for _ in range(3))
        self.values = self.random_values()
        self.out = rng.random() < 0.2

    def random_mask(self):
        rng = self.rng
        p = rng.random()
        if p < 0.3:
            return None, True
        if p < 0.5:
            return "causal", True
        if p < 0.7:
            return ("window", int(rng.integers(1, self.N + 3))), True
        if p < 0.9:
            return f"window:{int(rng.integers(1, self.N + 3))}", True
        return [("window", 0), ("window", 1.5), ("window", "2"), "window:-1", "sideways",
                ("window", 2**70)][int(rng.integers(0, 6))], False

    def random_values(self):
        rng, B, N, d, H, r = self.rng, self.B, self.N, self.d, self.H, self.r
        x_shape = (B, N, d) if self.batched else (N, d)
        head = (H,) if self.multihead else ()
        values = {"x": rng.standard_normal(x_shape)}
        if self.factored:
            values["query_factor"] = rng.standard_normal(head + (r, d)) / np.sqrt(d)
            values["key_factor"] = rng.standard_normal(head + (r, d)) / np.sqrt(d)
            values["content_up"] = rng.standard_normal(head + (d, r)) / np.sqrt(r)
            values["content_down"] = rng.standard_normal(head + (r, d)) / np.sqrt(d)
        else:
            values["relevance"] = rng.standard_normal(head + (d, d)) / np.sqrt(d)
            values["content"] = rng.standard_normal(head + (d, d)) / np.sqrt(d)
        if rng.random() < 0.5:
            values["key_bias"] = rng.standard_normal(head + (d,)) * 0.5
        if rng.random() < 0.5:
            values["offset"] = rng.standard_normal(d) * 0.5
        return values

    # -- presenting the values ----------------------------------------------------------------
    def present(self, name):
        """The argument `name` as the case hands it over; records it in self.bad when the call
        must refuse it."""
        rng = self.rng
        a = self.values[name]
        dtype = self.dtype
        wrong = not self.tidy and rng.random() < 0.1
        if wrong:
            dtype = WRONG_DTYPES[int(rng.integers(0, len(WRONG_DTYPES)))]
        layout = LAYOUTS[int(rng.integers(0, len(LAYOUTS)))]
        if self.tidy:
            layout = "misaligned" if rng.random() < 0.2 else "c"
        if layout == "broadcast" and a.ndim >= 2 and a.shape[0] > 1:
            a = np.broadcast_to(a[:1], a.shape).copy()
            self.values[name] = a  # the logical values are what the view shows
        if self.framework == "numpy":
            view = numpy_view(a, np.dtype(dtype), layout)
            contiguous = view.flags.c_contiguous
        else:
            if np.dtype(dtype).byteorder == ">" or np.dtype(dtype) == np.int32:
                dtype = np.int32  # torch has no big-endian tensors
            view = torch_view(a, np.dtype(dtype), layout, self.framework == "torch-cuda")
            contiguous = view.is_contiguous()
        # The reference sees exactly the values the call does (rounded or truncated to dtype).
        self.values[name] = a.astype(np.dtype(dtype)).astype(np.float64)
        if self.copy:
            # copy=True converts dtype and layout, except an x that is not float (torch) or an
            # x of an integer dtype converted to float64 (NumPy: then valid).
            if name == "x" and self.framework != "numpy" and wrong:
                self.bad.add("x")
            if name == "x" and wrong:
                self.x_dtype = np.float64 if self.framework == "numpy" else None
        else:
            if wrong or not contiguous:
                self.bad.add(name)
        return view

    def arguments(self):
        names = (["x", "query_factor", "key_factor", "content_up", "content_down"]
                 if self.factored else ["x", "relevance", "content"])
        self.x_dtype = self.dtype
        args = [self.present(n) for n in names]
        kwargs = {n: self.present(n) for n in ("key_bias", "offset") if n in self.values}
        kwargs.update(beta=self.beta, mask=self.mask, key_lengths=self.lengths, lse=self.lse,
                      entropy=self.entropy, weights=self.weights, device=self.device,
                      threads=self.threads, copy=self.copy)
        if self.out:
            out = np.full(self.values["x"].shape, np.nan, dtype=self.dtype)
            if self.framework != "numpy":
                out = torch.from_numpy(out)
                if self.framework == "torch-cuda":
                    out = out.cuda()
            kwargs["out"] = out
            if self.copy and self.x_dtype not in (None, self.dtype):
                self.bad.add("out")  # x converted to float64, out stays float32
        return args, kwargs

    def expected(self):
        """What emflow.reference gives on contiguous float64 copies, in the shapes of the call:
        (update, lse, entropy, weights)."""
        v = self.values
        x = v["x"] if self.batched else v["x"][None]
        if self.factored:
            m = np.einsum("...rd,...re->...de", v["query_factor"], v["key_factor"])
            f = np.einsum("...dr,...re->...de", v["content_up"], v["content_down"])
        else:
            m, f = v["relevance"], v["content"]
        if not self.multihead:
            m, f = m[None], f[None]
        u = v.get("key_bias")
        if u is not None and not self.multihead:
            u = u[None]
        update, lse, entropy, weights = emflow.reference.attend(
            x, m, f, u, v.get("offset"), beta=self.beta, mask=self.mask,
            key_lengths=self.lengths, weights=True)

        def shaped(a):  # drop B and H where the call has no such axis
            if not self.multihead:
                a = a[:, 0]
            return a if self.batched else a[0]

        return (update if self.batched else update[0]), shaped(lse), shaped(entropy), \
            shaped(weights)

    def __repr__(self):
        return (f"case seed={self.seed}: factored={self.factored} {np.dtype(self.dtype).name} "
                f"{self.framework} copy={self.copy} B={self.B if self.batched else None} "
                f"N={self.N} d={self.d} H={self.H if self.multihead else None} r={self.r} "
                f"mask={self.mask!r} lengths={self.lengths} device={self.device} "
                f"threads={self.threads} bad={sorted(self.bad)}")


def numpy_view(a, dtype, layout):
    """`a` (float64) as an array of `dtype` holding the same values in `layout`."""
    c = np.ascontiguousarray(a.astype(dtype))
    if layout == "strided" and a.ndim >= 1:
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=dtype)
        big[..., ::2] = c
        return big[..., ::2]
    if layout == "reversed":
        return np.ascontiguousarray(c[..., ::-1])[..., ::-1]
    if layout == "fortran":
        return np.asfortranarray(c)
    if layout == "transposed" and a.ndim >= 2:
        return np.ascontiguousarray(np.swapaxes(c, -1, -2)).swapaxes(-1, -2)
    if layout == "broadcast" and a.ndim >= 2:
        return np.broadcast_to(c[:1], c.shape)
    if layout == "misaligned" and c.size > 0:
        raw = np.zeros(c.nbytes + 1, dtype=np.uint8)
        view = raw[1:].view(dtype).reshape(c.shape)
        view[...] = c
        return view
    return c


def torch_view(a, dtype, layout, cuda):
    torch_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                   np.dtype(np.float16): torch.float16, np.dtype(np.int32): torch.int32,
                   np.dtype(np.int64): torch.int64}[dtype]
    t = torch.from_numpy(np.ascontiguousarray(a)).to(torch_dtype)
    if cuda:
        t = t.cuda()
    if layout == "strided":
        big = torch.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=torch_dtype, device=t.device)
        big[..., ::2] = t
        return big[..., ::2]
    if layout in ("transposed", "fortran") and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "broadcast" and t.dim() >= 2:
        return t[:1].expand(t.shape)
    return t


def to_numpy(a):
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def check(seed):
    case = Case(seed)
    args, kwargs = case.arguments()
    call = emflow.attend_factored if case.factored else emflow.attend
    try:
        result = call(*args, **kwargs)
    except ValueError as e:
        named = [n for n in case.bad if f"argument '{n}'" in str(e)]
        assert named, f"{case}: ValueError naming none of the bad arguments: {e}"
        return "refused"
    except NotImplementedError as e:
        assert not case.bad, f"{case}: NotImplementedError before the bad arguments: {e}"
        assert case.device == "cuda" and not CUDA, f"{case}: {e}"
        return "no device"
    assert not case.bad, f"{case}: accepted, but it had to be refused"
    assert not (case.device == "cuda" and not CUDA), f"{case}: ran on a missing device"
    extras = case.lse or case.entropy or case.weights
    update = result.update if extras else result
    if "out" in kwargs:
        assert update is kwargs["out"], f"{case}: the result is not the given out"
    want = case.expected()
    dtype = case.x_dtype or case.dtype
    tol = 3e-4 if np.dtype(dtype) == np.float32 else 1e-9
    for name, got, ref in zip(("update", "lse", "entropy", "weights"),
                              (update, *(result[1:] if extras else (None,) * 3)), want):
        if got is None:
            continue
        got = to_numpy(got).astype(np.float64)
        assert got.shape == ref.shape, f"{case}: {name} has shape {got.shape}, not {ref.shape}"
        finite = np.isfinite(ref)
        assert np.array_equal(np.isfinite(got), finite), f"{case}: {name} differs in -inf"
        assert np.all(got[~finite] == ref[~finite]), f"{case}: {name} padding"
        scale = 1 + np.abs(ref[finite]).max(initial=0)
        error = np.abs(got[finite] - ref[finite]).max(initial=0)
        assert error <= tol * scale, f"{case}: {name} off by {error} (scale {scale})"
    return "computed"


def test_random_arguments_are_refused_by_name_or_computed_right():
    outcomes = {"refused": 0, "no device": 0, "computed": 0}
    for seed in range(FIRST_SEED, FIRST_SEED + CASES):
        outcomes[check(seed)] += 1
    # The mix is part of the property: a generator that only ever made bad cases (or only good
    # ones) would check nothing.
    assert outcomes["computed"] > CASES // 4 and outcomes["refused"] > CASES // 10, outcomes


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + 5))
def test_the_first_cases_one_by_one(seed):
    check(seed)  # a failure shows the case in the test's name too
