#!/usr/bin/python3
"""Writes the long-context evaluation suite: seeded prompts from the held-out test split.

One JSON object per line:
  {"kind": "passkey_filler" | "passkey_natural" | "kv", "length": L, "depth": D,
   "prompt": TEXT, "answer": TEXT}
      retrieval: greedy continuation of PROMPT must start with ANSWER (exact match)
  {"kind": "recurrence", "length": L, "distance": N, "text": TEXT, "scored_from": C}
      long-range perplexity: the tokens of TEXT[C:] (a passage that appeared N tokens earlier;
      TEXT[C] is the space that starts it)
  {"kind": "continuation", "length": L, "distance": N, "text": TEXT, "scored_from": C}
      copying an unseen document: a passage of held-out text, unrelated text, then the
      passage's first words again; TEXT[C:] is the rest of the passage (from a space), which only
      copying from N tokens back predicts. Scored by top-1 accuracy against the text (how much
      of the passage greedy decoding would copy) and perplexity
  {"kind": "plain", "length": L, "text": TEXT}
      plain perplexity of natural text, for comparison

Lengths are in tokens of the tokenizer given here (the long model's); another model's tokenizer
makes them somewhat longer or shorter. The documents are those of longctx.py (the training
data's kinds) but drawn from models/data/test.txt with their own seed, so no prompt was seen in
training.
"""
import argparse
import json
import os
import sys

import numpy as np
import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import eval_lib  # noqa: E402
import longctx  # noqa: E402


def recurrence_doc(sp, texts, rng, length, distance, passage=48):
    """Natural text with a `passage`-token span that recurs `distance` tokens after it started:
    [lead][P][filler ... distance tokens from P's start][P]. Returns (text, scored_from)."""
    lead = max(0, length - distance - passage)
    ids = texts.span_ids(rng, lead + passage + max(0, distance - passage)).tolist()
    p = ids[lead:lead + passage]
    prefix = sp.decode(ids)
    return prefix + " " + sp.decode(p), len(prefix)


def continuation_doc(sp, texts, rng, length, distance, passage=96, cue=12):
    """[lead][P][unrelated text][P's first `cue` tokens] + the rest of P, where P starts
    `distance` tokens before the cue ends and the unrelated text comes from elsewhere in the
    split. Returns (text, scored_from) with text[scored_from] the space that starts the first
    scored word, or None when the cut would split a piece."""
    lead = max(0, length - distance - passage)
    ids = texts.span_ids(rng, lead + passage).tolist()
    p_text = sp.decode(ids[lead:])
    head = sp.decode(ids[:lead])
    filler = sp.decode(texts.span_ids(rng, max(0, distance - passage)).tolist())
    cue_chars = len(sp.decode(ids[lead:lead + cue]))
    cut = p_text.find(" ", cue_chars)
    if cut < 0 or cut > len(p_text) - 80:
        return None
    prefix = " ".join(x for x in (head, p_text, filler) if x) + " "
    text = prefix + p_text
    scored_from = len(prefix) + cut
    whole = sp.encode(text)
    start = sp.encode(text[:scored_from])
    if whole[:len(start)] != start or len(whole) - len(start) < 16:
        return None
    return text, scored_from


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", default="models/subspace-tiny.tokenizer.model")
    ap.add_argument("--text", default="models/data/test.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--lengths", default="256,512,1024,2000")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--per-cell", type=int, default=2, help="prompts per (kind, length, depth)")
    ap.add_argument("--kv-pairs", default="8,32,64,110")
    ap.add_argument("--distances", default="128,512,1024,1900")
    ap.add_argument("--kinds", default="passkey_filler,passkey_natural,kv,recurrence,plain",
                    help="comma-separated kinds of item to write (default: all but "
                         "continuation)")
    ap.add_argument("--continuation-depths", default="0.25,0.5,0.75,0.9",
                    help="continuation: how far back the passage starts, as fractions of the "
                         "longest --lengths")
    ap.add_argument("--continuation-text", default="models/data-wide/test.txt",
                    help="continuation: the held-out documents passages and filler come from")
    ap.add_argument("--small", action="store_true",
                    help="the CI slice: every kind, one prompt per cell, at 256 tokens (fits "
                         "the default model's context of 512)")
    args = ap.parse_args()
    if args.small:
        args.lengths, args.depths, args.per_cell = "256", "0,0.5,1", 1
        args.kv_pairs, args.distances = "8", "128"

    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    texts = longctx.Texts(sp, eval_lib.encode_file(sp, args.text))
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    kinds_wanted = set(args.kinds.split(","))
    unknown = kinds_wanted - {"passkey_filler", "passkey_natural", "kv", "recurrence", "plain",
                              "continuation"}
    if unknown:
        ap.error("unknown --kinds: %s" % ",".join(sorted(unknown)))
    rows = []
    for kind in ("passkey_filler", "passkey_natural"):
        if kind not in kinds_wanted:
            continue
        for length in lengths:
            for depth in depths:
                for _ in range(args.per_cell):
                    d = longctx.passkey(sp, texts, rng, length, depth, haystack=kind.split("_")[1])
                    rows.append({"kind": kind, "length": d["n_tokens"], "depth": depth,
                                 "prompt": d["prompt"], "answer": d["answer"]})
    for pairs in (int(x) for x in args.kv_pairs.split(",") if "kv" in kinds_wanted):
        for _ in range(2 * args.per_cell):
            d = longctx.kv_recall(sp, rng, 0, pairs=pairs)
            rows.append({"kind": "kv", "length": d["n_tokens"], "depth": d["depth"],
                         "pairs": pairs, "prompt": d["prompt"], "answer": d["answer"]})
    for distance in (int(x) for x in args.distances.split(",") if "recurrence" in kinds_wanted):
        for _ in range(2 * args.per_cell):
            text, start = recurrence_doc(sp, texts, rng, max(lengths), distance)
            rows.append({"kind": "recurrence", "length": len(sp.encode(text)),
                         "distance": distance, "text": text, "scored_from": start})
    if "continuation" in kinds_wanted:
        wide = longctx.Texts(sp, eval_lib.encode_file(sp, args.continuation_text))
        for frac in (float(x) for x in args.continuation_depths.split(",")):
            distance = int(frac * max(lengths))
            made = 0
            while made < 4 * args.per_cell:
                doc = continuation_doc(sp, wide, rng, max(lengths), distance)
                if doc is None:
                    continue
                text, start = doc
                rows.append({"kind": "continuation", "length": len(sp.encode(text)),
                             "distance": distance, "text": text, "scored_from": start})
                made += 1
    for _ in range(2 * args.per_cell if "plain" in kinds_wanted else 0):
        text = texts.span_text(rng, max(lengths))
        rows.append({"kind": "plain", "length": len(sp.encode(text)), "text": text})
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    kinds = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print("%s: %d rows %s" % (args.out, len(rows), kinds))


if __name__ == "__main__":
    main()
