#!/usr/bin/python3
"""Prints seeded samples (temperature, top-k) from a Subspace-tiny GGUF, for the model card."""
import argparse
import os
import sys

import sentencepiece as spm
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import model_from_gguf  # noqa: E402


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", default="models/subspace-tiny.gguf")
    ap.add_argument("--tokenizer", default="models/subspace-tiny.tokenizer.model")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("prompts", nargs="*", default=["And it came to pass", "A programmer",
                                                   "Love is"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    model, cfg, _ = model_from_gguf(args.gguf)
    gen = torch.Generator().manual_seed(args.seed)
    for p in args.prompts:
        ids = [1] + sp.encode(p)
        out = []
        for _ in range(args.tokens):
            logits = model(torch.tensor([ids[-cfg.context_length:]]))[0, -1] / args.temperature
            v, i = torch.topk(logits, args.top_k)
            nxt = int(i[torch.multinomial(torch.softmax(v, -1), 1, generator=gen)])
            if nxt == 2:
                break
            ids.append(nxt)
            out.append(nxt)
        print("PROMPT %r\n%s\n" % (p, sp.decode(ids[1:])), flush=True)


if __name__ == "__main__":
    main()
