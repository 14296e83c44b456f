#!/usr/bin/env python3
"""PyTorch's CPU scaled_dot_product_attention beside emflow's fused CPU backend (fp32, or both in
bf16 or fp16 storage).

The dense EMF update of one head is SDPA with queries beta X M, keys X, values X F^T and scale 1
(docs/MATH.md §1, §3), so both compute the same 4 B H N^2 d attention-equivalent FLOP. Torch
is timed on the attention call alone (its projections are not counted); emflow's time includes
its projections (2 of 2 N d^2, about d / N of the total).

For each shape the script runs `emflow bench` and then times torch right after it, so
the two figures are measured side by side; it prints emflow's JSON line, torch's JSON line in
the same format (op "torch_sdpa"), and a line with the ratio of the wall times (and of the
process CPU times, which a loaded machine disturbs less when both run on one thread).

    python3 bench/torch_sdpa.py --emflow build/emflow --threads 2
    python3 bench/torch_sdpa.py --emflow build/emflow --tokens 1024 4096 8192 --dim 64 128
    python3 bench/torch_sdpa.py --emflow build/emflow --precision bf16 --mask causal

With --backward both backward passes are timed as well: `emflow bench --backward` (the
SDPA-shaped operator emflow::sdpa_attend and emflow::sdpa_backward on the same Q, K, V, scale 1,
dQ, dK and dV from a random dO) beside torch's SDPA forward with autograd and its backward
(`out.backward(dO)` alone timed, a fresh forward before each). Backward FLOP are 2.5 times the
forward's (five products against two). The ratio line then has the backward's ratios and each
library's backward over its own forward.

    python3 bench/torch_sdpa.py --emflow build/emflow --backward --dim 64 128 --threads 1
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def problem(torch, batch, heads, tokens, dim, dtype):
    """Queries X M, keys X and values X F^T (B, H, N, d) of a seeded problem, in dtype, and the
    generator that made them."""
    gen = torch.Generator().manual_seed(2024)
    scale = 2.0 / dim**0.5
    x = torch.rand(batch, 1, tokens, dim, generator=gen) * 2 - 1
    m = (torch.rand(heads, dim, dim, generator=gen) * 2 - 1) * scale
    f = (torch.rand(heads, dim, dim, generator=gen) * 2 - 1) * scale
    q = x @ m  # R = X M
    k = x.expand(batch, heads, tokens, dim)
    v = x @ f.transpose(-1, -2)  # C = X F^T
    return [t.contiguous().to(dtype) for t in (q, k, v)], gen


def time_torch(torch, batch, heads, tokens, dim, causal, repeats, dtype):
    (q, k, v), _ = problem(torch, batch, heads, tokens, dim, dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        sdpa(q, k, v, is_causal=causal, scale=1.0)  # warm-up
        times, cpu_times = [], []
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            sdpa(q, k, v, is_causal=causal, scale=1.0)
            times.append((time.perf_counter() - start) * 1e3)
            cpu_times.append((time.process_time() - cpu_start) * 1e3)
    return statistics.median(times), statistics.median(cpu_times)


def time_torch_backward(torch, batch, heads, tokens, dim, causal, repeats, dtype):
    """Medians (wall ms, CPU ms) of torch's SDPA forward with autograd and of its backward."""
    inputs, gen = problem(torch, batch, heads, tokens, dim, dtype)
    q, k, v = (t.requires_grad_() for t in inputs)
    d_out = (torch.rand(batch, heads, tokens, dim, generator=gen) * 2 - 1).to(dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    forward, backward = ([], []), ([], [])
    for r in range(repeats + 1):  # the first round is a warm-up
        q.grad = k.grad = v.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        out = sdpa(q, k, v, is_causal=causal, scale=1.0)
        middle, cpu_middle = time.perf_counter(), time.process_time()
        out.backward(d_out)
        stop, cpu_stop = time.perf_counter(), time.process_time()
        if r > 0:
            forward[0].append((middle - start) * 1e3)
            forward[1].append((cpu_middle - cpu_start) * 1e3)
            backward[0].append((stop - middle) * 1e3)
            backward[1].append((cpu_stop - cpu_middle) * 1e3)
    return [tuple(statistics.median(t) for t in pair) for pair in (forward, backward)]


def torch_line(torch, op, args, tokens, dim, threads, ms, cpu_ms, flop):
    return {"op": op, "device": "cpu", "precision": args.precision,
            "batch": args.batch, "heads": args.heads, "tokens": tokens, "dim": dim,
            "mask": args.mask, "ms_median": round(ms, 4),
            "gflops": round(flop / (ms * 1e6), 4), "threads": threads,
            "repeats": args.repeats, "cpu_ms_median": round(cpu_ms, 4),
            "torch": torch.__version__}


def measure(args, torch, dtype, threads, tokens, dim):
    """One round at one shape: emflow bench, then torch; prints both and their ratio line,
    and returns the ratio line."""
    command = [args.emflow, "bench", "--device", "cpu", "--tokens", str(tokens),
               "--dim", str(dim), "--heads", str(args.heads), "--batch",
               str(args.batch), "--mask", args.mask, "--repeats", str(args.repeats),
               "--threads", str(threads), "--precision", args.precision]
    if args.backward:
        command.append("--backward")
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    ours = {}
    for line in result.stdout.strip().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            ours[entry["op"]] = entry
            print(json.dumps(entry), flush=True)
    flop = 4.0 * args.batch * args.heads * tokens * tokens * dim
    if args.mask == "causal":
        flop /= 2
    causal = args.mask == "causal"
    if not args.backward:
        ms, cpu_ms = time_torch(torch, args.batch, args.heads, tokens, dim, causal,
                                args.repeats, dtype)
        print(json.dumps(torch_line(torch, "torch_sdpa", args, tokens, dim, threads, ms,
                                    cpu_ms, flop)), flush=True)
        mine = ours["attend"]
        ratio = {"op": "ratio", "tokens": tokens, "dim": dim,
                 "emflow_over_torch": round(ms / mine["ms_median"], 3)}
        if "cpu_ms_median" in mine:
            ratio["emflow_over_torch_cpu_time"] = round(cpu_ms / mine["cpu_ms_median"], 3)
        print(json.dumps(ratio), flush=True)
        return ratio
    (fwd, fwd_cpu), (bwd, bwd_cpu) = time_torch_backward(
        torch, args.batch, args.heads, tokens, dim, causal, args.repeats, dtype)
    print(json.dumps(torch_line(torch, "torch_sdpa_forward", args, tokens, dim, threads,
                                fwd, fwd_cpu, flop)), flush=True)
    print(json.dumps(torch_line(torch, "torch_sdpa_backward", args, tokens, dim, threads,
                                bwd, bwd_cpu, 2.5 * flop)), flush=True)
    ours_fwd, ours_bwd = ours["sdpa_attend"], ours["sdpa_backward"]
    ratio = {"op": "ratio", "tokens": tokens, "dim": dim, "mask": args.mask,
             "precision": args.precision,
             "backward_emflow_over_torch": round(bwd / ours_bwd["ms_median"], 3),
             "backward_emflow_over_torch_cpu_time":
                 round(bwd_cpu / ours_bwd["cpu_ms_median"], 3),
             "forward_emflow_over_torch": round(fwd / ours_fwd["ms_median"], 3),
             "emflow_backward_over_forward":
                 round(ours_bwd["ms_median"] / ours_fwd["ms_median"], 3),
             "torch_backward_over_forward": round(bwd / fwd, 3)}
    print(json.dumps(ratio), flush=True)
    return ratio


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emflow", default="emflow", help="path to the emflow executable")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--dim", type=int, nargs="+", default=[64])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mask", choices=["none", "causal"], default="none")
    parser.add_argument("--threads", type=int, default=0, help="0: every core")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="storage of both: emflow bench --precision, torch's tensors' dtype")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of (emflow, torch) per shape; with more than one, a last "
                             "line (op ratio_median) has the median of each ratio over the rounds")
    parser.add_argument("--backward", action="store_true",
                        help="time the backward passes too (emflow bench --backward)")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        print("torch is not installed (pip install torch); nothing to compare", file=sys.stderr)
        return 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]

    for tokens in args.tokens:
        for dim in args.dim:
            ratios = [measure(args, torch, dtype, threads, tokens, dim)
                      for _ in range(args.rounds)]
            if args.rounds > 1:
                summary = {"op": "ratio_median", "rounds": args.rounds}
                for key, value in ratios[0].items():
                    if isinstance(value, float):
                        summary[key] = round(statistics.median(r[key] for r in ratios), 3)
                    elif key != "op":
                        summary[key] = value
                print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
