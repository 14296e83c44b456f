#!/usr/bin/env python3
"""What calling emflow from Python costs, and emflow.torch beside torch's CPU attention.

Three measurements in one run, each side by side (the two contenders alternate in rounds, and
the medians of the rounds are compared):

1. Per-call overhead on a tiny problem: emflow.attend(..., out=..., device="cpu") from Python
   against the same emflow::attend call timed in a C++ loop inside the extension
   (emflow._emflow.time_attend). Target: under 5 microseconds.
2. The same at N = 4096, d = 64 (one head, float32): the Python call within 2 % of C++.
3. emflow.torch.attend_factored (one QKV attention layer: projections, attention, output
   projection) against torch.nn.functional.scaled_dot_product_attention on the CPU, both
   alone (q, k, v precomputed) and with torch doing the same projections.

    PYTHONPATH=build/python python3 bench/python_overhead.py
    PYTHONPATH=build/python python3 bench/python_overhead.py --threads 1 --rounds 21
"""
import argparse
import json
import statistics
import time

import numpy as np

import emflow


def per_call(function, calls):
    """(wall, process CPU) seconds per call over `calls` calls. The CPU time is what a loaded,
    shared machine disturbs least."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        function()
    return ((time.perf_counter() - start) / calls, (time.process_time() - cpu_start) / calls)


def side_by_side(python_call, cxx_call, calls, rounds):
    """Alternates one round of each; returns the medians (wall and CPU seconds per call) of
    Python and of C++."""
    py, cxx = [], []
    for _ in range(rounds):
        py.append(per_call(python_call, calls))
        cpu_start = time.process_time()
        wall = cxx_call(calls)
        cxx.append((wall, (time.process_time() - cpu_start) / calls))
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    return med(py, 0), med(py, 1), med(cxx, 0), med(cxx, 1)


def dense(tokens, dim, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (1, tokens, dim)).astype(np.float32)
    m = (rng.uniform(-1, 1, (1, dim, dim)) * 2 / dim**0.5).astype(np.float32)
    f = (rng.uniform(-1, 1, (1, dim, dim)) * 2 / dim**0.5).astype(np.float32)
    return x, m, f, np.empty_like(x)


def overhead(tokens, dim, threads, calls, rounds):
    x, m, f, out = dense(tokens, dim)
    emflow.attend(x, m, f, out=out, device="cpu", threads=threads)  # warm-up

    def python_call():
        emflow.attend(x, m, f, out=out, device="cpu", threads=threads)

    def cxx_call(n):
        return emflow._emflow.time_attend(x, m, f, out, threads, n)

    py, py_cpu, cxx, cxx_cpu = side_by_side(python_call, cxx_call, calls, rounds)
    return {"op": "python_overhead", "tokens": tokens, "dim": dim, "threads": threads,
            "python_us": py * 1e6, "cxx_us": cxx * 1e6, "overhead_us": (py - cxx) * 1e6,
            "ratio": py / cxx, "python_cpu_us": py_cpu * 1e6, "cxx_cpu_us": cxx_cpu * 1e6,
            "overhead_cpu_us": (py_cpu - cxx_cpu) * 1e6, "cpu_ratio": py_cpu / cxx_cpu}


def torch_side_by_side(torch, batch, tokens, dim, heads, rank, causal, threads, rounds):
    gen = torch.Generator().manual_seed(2024)
    x = torch.randn(batch, tokens, dim, generator=gen)
    wq, wk, wv = (torch.randn(heads, rank, dim, generator=gen) / dim**0.5 for _ in range(3))
    wo = torch.randn(heads, dim, rank, generator=gen) / rank**0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = "causal" if causal else None
    a = (wq / rank**0.5).contiguous()

    def project():
        q = torch.einsum("bnd,hkd->bhnk", x, wq)
        k = torch.einsum("bnd,hkd->bhnk", x, wk)
        v = torch.einsum("bnd,hkd->bhnk", x, wv)
        return q.contiguous(), k.contiguous(), v.contiguous()

    q, k, v = project()

    def torch_attention():
        return sdpa(q, k, v, is_causal=causal)

    def torch_layer():
        qq, kk, vv = project()
        return torch.einsum("bhnk,hdk->bnd", sdpa(qq, kk, vv, is_causal=causal), wo)

    def emflow_layer():
        return emflow.torch.attend_factored(x, a, wk, wo, wv, mask=mask, threads=threads)

    with torch.no_grad():
        torch.testing.assert_close(emflow_layer(), torch_layer(), rtol=1e-3, atol=1e-4)
        functions = {"emflow_factored": emflow_layer, "torch_sdpa": torch_attention,
                     "torch_layer": torch_layer}
        times = {name: [] for name in functions}
        for _ in range(rounds):
            for name, function in functions.items():
                times[name].append(per_call(function, 1))
    medians = {}
    for name, rows in times.items():
        medians[name] = statistics.median(r[0] for r in rows) * 1e3
        medians[name + "_cpu"] = statistics.median(r[1] for r in rows) * 1e3
    return {"op": "torch_cpu", "batch": batch, "tokens": tokens, "dim": dim, "heads": heads,
            "rank": rank, "mask": mask or "none", "threads": threads,
            **{f"{name}_ms": value for name, value in medians.items()},
            "sdpa_over_emflow": medians["torch_sdpa"] / medians["emflow_factored"],
            "layer_over_emflow": medians["torch_layer"] / medians["emflow_factored"],
            "sdpa_over_emflow_cpu": medians["torch_sdpa_cpu"] / medians["emflow_factored_cpu"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--tokens", type=int, default=4096, help="the large problem's N")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--torch-tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()

    print(json.dumps(overhead(8, 4, 1, 2000, args.rounds)))
    print(json.dumps(overhead(args.tokens, args.dim, args.threads, 1, args.rounds)))
    try:
        import torch
        import emflow.torch  # noqa: F401
    except ImportError:
        print(json.dumps({"op": "torch_cpu", "skipped": "torch is not installed"}))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(torch_side_by_side(torch, 1, args.torch_tokens, args.dim, args.heads,
                                        args.rank, args.causal, args.threads, args.rounds)))


if __name__ == "__main__":
    main()
