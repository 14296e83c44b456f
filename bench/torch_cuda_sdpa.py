#!/usr/bin/env python3
"""PyTorch's fused attention kernels on the GPU, forward and backward, on the shapes of emflow's
GPU benchmarks, as Google Benchmark JSON, so that scripts/device-check.sh prints them beside
emflow's BM_SdpaBackward and BM_TensorCore in the same run.

The peers are the kernels torch.nn.functional.scaled_dot_product_attention dispatches to:
cuDNN's fused flash attention (SDPBackend.CUDNN_ATTENTION, the cuDNN frontend's SDPA graph,
forward and backward) and FlashAttention-2 (SDPBackend.FLASH_ATTENTION). bench/cuda_cudnn.cpp
times cuDNN's forward through the backend API itself; cuDNN's backward graph is timed here
through torch, which builds it with the frontend.

Shapes (those of BM_SdpaBackward and BM_CudnnSdpa): N = 4096 and 16384 tokens, head dim 64 and
128, B = max(1, 16384 / N) clouds of one head, the causal mask or none, bf16, scale 1/sqrt(d);
Q, K, V and dO uniform in [-1, 1). FLOP: the forward 4 B N^2 d, the backward 2.5 times that
(five products against two), both halved for the causal mask, as emflow's benchmarks count.

Timing: CUDA events around each call on torch's current stream, after two warm-up calls; the
median of --repeats. The forward is timed without autograd; the backward is
torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) on one saved forward, so each timed
call is the backend's backward alone (its row sums D = rowsum(dO * O) included). Before timing,
each backend's output and gradients are compared with the float32 math backend on the same
bf16 inputs: a backend whose results differ by more than a bf16 rounding's worth is reported as
failed, not timed. A backend torch cannot run on this GPU or shape gets a row with an
`error_message`, as Google Benchmark writes a skipped benchmark.

    python3 bench/torch_cuda_sdpa.py --out torch-sdpa.json
    python3 bench/torch_cuda_sdpa.py --tokens 4096 --dim 128 --backends cudnn

--device cpu runs the same harness on the CPU (wall-clock timing, torch's CPU flash kernel and
the math backend) so that it can be checked on a machine without a GPU; its figures are not
GPU figures.
"""
import argparse
import json
import os
import statistics
import sys
import time

TOKENS_PER_CASE = 16384


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="PyTorch's cuDNN and FlashAttention-2 SDPA kernels, forward and backward, "
        "as Google Benchmark JSON (the peers of emflow's BM_SdpaBackward and BM_TensorCore).")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384],
                        help="tokens N per cloud (default: 4096 16384); B = max(1, 16384 / N)")
    parser.add_argument("--dim", type=int, nargs="+", default=[64, 128],
                        help="head dims d (default: 64 128)")
    parser.add_argument("--mask", choices=["none", "causal", "both"], default="both",
                        help="the mask (default: both)")
    parser.add_argument("--backends", nargs="+", default=["cudnn", "flash"],
                        choices=["cudnn", "flash", "efficient", "math"],
                        help="torch SDPA backends to time (default: cudnn flash)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed calls per shape and pass; the median is reported (default: 20)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default); cpu only checks the harness, its figures are not "
                        "GPU figures")
    parser.add_argument("--out", help="write the Google Benchmark JSON here (default: stdout)")
    args = parser.parse_args(argv)
    for name in ("tokens", "dim"):
        bad = [v for v in getattr(args, name) if v <= 0]
        if bad:
            parser.error(f"--{name}: expected positive integers, got {bad}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    return args


class Timer:
    """Median time of a call in ms: CUDA events on the GPU, the wall clock on the CPU."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"

    def median_ms(self, call, repeats):
        torch = self.torch
        for _ in range(2):
            call()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
        else:
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def backend_of(torch, name):
    backends = torch.nn.attention.SDPBackend
    return {"cudnn": backends.CUDNN_ATTENTION, "flash": backends.FLASH_ATTENTION,
            "efficient": backends.EFFICIENT_ATTENTION, "math": backends.MATH}[name]


def inputs(torch, batch, tokens, dim, device):
    gen = torch.Generator(device="cpu").manual_seed(2024)
    shape = (batch, 1, tokens, dim)
    made = [(torch.rand(shape, generator=gen) * 2 - 1).to(device=device, dtype=torch.bfloat16)
            for _ in range(4)]
    q, k, v, grad = made
    return [t.requires_grad_() for t in (q, k, v)], grad


def run_pass(torch, sdpa, q, k, v, grad, causal):
    out = sdpa(q, k, v, is_causal=causal)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), grad))


def agreement(torch, got, want):
    """The largest |got - want| over max |want|, per tensor (output, dQ, dK, dV)."""
    return [float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
            for g, w in zip(got, want)]


def measure(torch, args, backend, tokens, dim, causal, reference):
    """One shape on one backend: the forward's and the backward's rows."""
    from torch.nn.attention import sdpa_kernel

    batch = max(1, TOKENS_PER_CASE // tokens)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    (q, k, v), grad = inputs(torch, batch, tokens, dim, args.device)
    flop = 4.0 * batch * tokens * tokens * dim * (0.5 if causal else 1.0)
    label = f"N:{tokens}/d:{dim}/causal:{int(causal)}"
    names = (f"BM_TorchSdpa_{backend}/{label}", f"BM_TorchSdpaBackward_{backend}/{label}")
    timer = Timer(torch, args.device)
    try:
        with sdpa_kernel(backend_of(torch, backend)):
            got = run_pass(torch, sdpa, q, k, v, grad, causal)
            errors = agreement(torch, got, reference(q, k, v, grad, causal))
            # bf16 outputs and gradients, float32 accumulation on both sides: a few roundings.
            if max(errors) > 3e-2:
                raise RuntimeError("differs from the float32 math backend by "
                                   + ", ".join(f"{e:.2e}" for e in errors)
                                   + " (output, dQ, dK, dV; relative to each tensor's largest)")
            with torch.no_grad():
                forward_ms = timer.median_ms(lambda: sdpa(q, k, v, is_causal=causal),
                                             args.repeats)
            out = sdpa(q, k, v, is_causal=causal)
            backward_ms = timer.median_ms(
                lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                args.repeats)
    except RuntimeError as error:
        message = f"torch {backend}: " + str(error).strip().splitlines()[0][:300]
        return [{"name": n, "run_type": "iteration", "error_occurred": True,
                 "error_message": message} for n in names]
    rows = []
    for name, ms, work in ((names[0], forward_ms, flop), (names[1], backward_ms, 2.5 * flop)):
        rows.append({"name": name, "run_name": name, "run_type": "iteration",
                     "iterations": args.repeats, "real_time": ms, "cpu_time": ms,
                     "time_unit": "ms", "TFLOP/s": work / (ms * 1e-3) * 1e-12, "B": batch,
                     "max_relative_error": max(errors)})
    return rows


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch_cuda_sdpa.py: torch is not installed", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_cuda_sdpa.py: no CUDA device visible to torch "
              f"(torch {torch.__version__}); nothing timed", file=sys.stderr)
        return 2
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def reference(q, k, v, grad, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            return run_pass(torch, sdpa, *wide, grad.float(), causal)

    masks = {"none": [False], "causal": [True], "both": [False, True]}[args.mask]
    rows = []
    for causal in masks:
        for dim in args.dim:
            for tokens in args.tokens:
                for backend in args.backends:
                    rows += measure(torch, args, backend, tokens, dim, causal, reference)
                    for row in rows[-2:]:
                        shown = (f"{row['real_time']:9.3f} ms {row['TFLOP/s']:8.2f} TFLOP/s"
                                 if "real_time" in row else row["error_message"])
                        print(f"{row['name']:<58} {shown}", file=sys.stderr, flush=True)
    device = (torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    report = {"context": {"executable": "bench/torch_cuda_sdpa.py", "torch": torch.__version__,
                          "device": device,
                          "cudnn": torch.backends.cudnn.version() if args.device == "cuda"
                          else None},
              "benchmarks": rows}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out + ".part", "w") as f:
            f.write(text)
        os.replace(args.out + ".part", args.out)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
