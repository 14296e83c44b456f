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
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def time_torch(torch, batch, heads, tokens, dim, causal, repeats, dtype):
    gen = torch.Generator().manual_seed(2024)
    scale = 2.0 / dim**0.5
    x = torch.rand(batch, 1, tokens, dim, generator=gen) * 2 - 1
    m = (torch.rand(heads, dim, dim, generator=gen) * 2 - 1) * scale
    f = (torch.rand(heads, dim, dim, generator=gen) * 2 - 1) * scale
    q = (x @ m).contiguous()  # (B, H, N, d): R = X M
    k = x.expand(batch, heads, tokens, dim).contiguous()
    v = (x @ f.transpose(-1, -2)).contiguous()  # C = X F^T
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
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
            command = [args.emflow, "bench", "--device", "cpu", "--tokens", str(tokens),
                       "--dim", str(dim), "--heads", str(args.heads), "--batch",
                       str(args.batch), "--mask", args.mask, "--repeats", str(args.repeats),
                       "--threads", str(threads), "--precision", args.precision]
            result = subprocess.run(command, check=True, capture_output=True, text=True)
            ours = json.loads(result.stdout.strip().splitlines()[-1])
            print(json.dumps(ours), flush=True)
            ms, cpu_ms = time_torch(torch, args.batch, args.heads, tokens, dim,
                                    args.mask == "causal", args.repeats, dtype)
            flop = 4.0 * args.batch * args.heads * tokens * tokens * dim
            if args.mask == "causal":
                flop /= 2
            theirs = {"op": "torch_sdpa", "device": "cpu", "precision": args.precision,
                      "batch": args.batch, "heads": args.heads, "tokens": tokens, "dim": dim,
                      "mask": args.mask, "ms_median": round(ms, 4),
                      "gflops": round(flop / (ms * 1e6), 4), "threads": threads,
                      "repeats": args.repeats, "cpu_ms_median": round(cpu_ms, 4),
                      "torch": torch.__version__}
            print(json.dumps(theirs), flush=True)
            ratio = {"op": "ratio", "tokens": tokens, "dim": dim,
                     "emflow_over_torch": round(ms / ours["ms_median"], 3)}
            if "cpu_ms_median" in ours:
                ratio["emflow_over_torch_cpu_time"] = round(cpu_ms / ours["cpu_ms_median"], 3)
            print(json.dumps(ratio), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
