#!/usr/bin/python3
"""PyTorch reference numbers for a Subspace-tiny GGUF file, for the C++ engine's tests.

Loads the weights FROM THE GGUF FILE (so F16 rounding is included), runs the fp32 PyTorch model
of model.py and writes models/subspace-tiny.expected.json: prompt token ids, 32-token greedy
continuations (with the top-1/top-2 logit margin of every step, so a test can tell a genuine
mismatch from a near tie), top-10 next-token logits after each prompt, and perplexity on the
test split under the chunking rule of eval_lib.py. Optionally also the fp32 checkpoint's
perplexities and the unigram baseline (needs models/data/train.txt from build_corpus.py).
"""
import argparse
import hashlib
import json
import math
import os
import sys

import numpy as np
import sentencepiece as spm
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gguf"))
import eval_lib  # noqa: E402
from gguf_writer import GgufReader  # noqa: E402
from model import Config, Llama, load_checkpoint  # noqa: E402

PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the",
    "A computer is",
    "The secret of happiness is",
    "Q: Why did the chicken cross the road?\nA:",
]
N_GREEDY = 32
# Strings whose sentencepiece ids a C++ tokenizer must reproduce (no BOS added here).
TOKENIZER_CASES = [
    "Hello world", " leading space", "two  spaces and a tab\there", "line one\nline two\n",
    "Numbers: 1611, 3.14159 and 42!", "caf\u00e9 na\u00efve \u2014 \U0001F600", "", " ",
    "UPPER lower MiXeD", "The LORD is my shepherd; I shall not want.",
]


def model_from_gguf(path, context_length=0):
    """(model, config, metadata) with the GGUF's weights; context_length overrides the file's."""
    r = GgufReader(path)
    md = r.metadata
    cfg = Config(vocab_size=int(md["llama.vocab_size"]), dim=int(md["llama.embedding_length"]),
                 n_layers=int(md["llama.block_count"]),
                 n_heads=int(md["llama.attention.head_count"]),
                 n_kv_heads=int(md["llama.attention.head_count_kv"]),
                 ffn_dim=int(md["llama.feed_forward_length"]),
                 context_length=context_length or int(md["llama.context_length"]),
                 rope_theta=float(md["llama.rope.freq_base"]),
                 norm_eps=float(md["llama.attention.layer_norm_rms_epsilon"]),
                 tied_output="output.weight" not in r.tensors)
    model = Llama(cfg)
    sd = {"tok_emb.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not cfg.tied_output:
        sd["output.weight"] = "output.weight"
    for i in range(cfg.n_layers):
        for t, g in [("attn_norm.weight", "attn_norm"), ("wq.weight", "attn_q"),
                     ("wk.weight", "attn_k"), ("wv.weight", "attn_v"),
                     ("wo.weight", "attn_output"), ("ffn_norm.weight", "ffn_norm"),
                     ("w_gate.weight", "ffn_gate"), ("w_up.weight", "ffn_up"),
                     ("w_down.weight", "ffn_down")]:
            sd["blocks.%d.%s" % (i, t)] = "blk.%d.%s.weight" % (i, g)
    model.load_state_dict({k: torch.from_numpy(r.tensor(v).copy()) for k, v in sd.items()})
    model.eval()
    return model, cfg, md


@torch.no_grad()
def greedy(model, ids, n):
    ids = list(ids)
    out, margins = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids[-model.cfg.context_length:]]))[0, -1].double()
        top2 = torch.topk(logits, 2)
        out.append(int(top2.indices[0]))
        margins.append(round(float(top2.values[0] - top2.values[1]), 4))
        ids.append(out[-1])
    return out, margins


@torch.no_grad()
def top_logits(model, ids, k=10):
    logits = model(torch.tensor([ids]))[0, -1]
    t = torch.topk(logits, k)
    return [[int(i), round(float(v), 5)] for i, v in zip(t.indices, t.values)]


def unigram_ppl(train_ids, test_ids, vocab):
    counts = np.bincount(np.asarray(train_ids), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return math.exp(-logp[np.asarray(test_ids)].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", default="models/subspace-tiny.gguf")
    ap.add_argument("--tokenizer", default="models/subspace-tiny.tokenizer.model")
    ap.add_argument("--ckpt", default="models/work/ckpt.pt", help="optional fp32 checkpoint")
    ap.add_argument("--data-dir", default="models/data")
    ap.add_argument("--out", default="models/subspace-tiny.expected.json")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    model, cfg, md = model_from_gguf(args.gguf)
    ctx = cfg.context_length
    res = {"model": os.path.basename(args.gguf),
           "gguf_sha256": hashlib.sha256(open(args.gguf, "rb").read()).hexdigest(),
           "weights": "as stored in the GGUF (matrices F16, norms F32), computed in fp32",
           "prompts": []}
    for p in PROMPTS:
        ids = [eval_lib.BOS] + sp.encode(p)
        cont, margins = greedy(model, ids, N_GREEDY)
        res["prompts"].append({"text": p, "ids": ids, "greedy_ids": cont,
                               "greedy_text": sp.decode(ids[1:] + cont),
                               "greedy_top2_margin": margins,
                               "next_token_top10_logits": top_logits(model, ids)})
        print("%r -> %r" % (p, sp.decode(cont)), flush=True)

    res["tokenizer_cases"] = [{"text": t, "ids": sp.encode(t),
                               "pieces": sp.encode(t, out_type=str)} for t in TOKENIZER_CASES]

    def ppl_block(split, m):
        path = os.path.join(args.data_dir, split + ".txt")
        ids = eval_lib.encode_file(sp, path)
        ppl, nll, n = eval_lib.perplexity(m, ids, ctx)
        return ids, {"file": "models/data/%s.txt" % split,
                     "file_sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
                     "num_file_tokens": len(ids), "num_windows": len(eval_lib.windows(ids, ctx)),
                     "first_16_token_ids": ids[:16], "mean_nll": round(nll, 6),
                     "perplexity": round(ppl, 4), "predicted_tokens": n}

    res["perplexity_rule"] = (
        "ids = sentencepiece encode of the whole file text (dummy prefix, no BOS/EOS); split ids "
        "into consecutive chunks of (context_length - 1) = %d tokens, the last may be shorter; "
        "each window = [BOS] + chunk; NLL over positions 1..len(window)-1 of every window (every "
        "file token predicted once); ppl = exp(total NLL / total predicted tokens)" % (ctx - 1))
    res["context_length"] = ctx
    test_ids, res["test"] = ppl_block("test", model)
    print("test ppl (gguf weights) %.4f" % res["test"]["perplexity"], flush=True)
    if os.path.exists(os.path.join(args.data_dir, "val.txt")):
        _, res["val"] = ppl_block("val", model)
        print("val ppl (gguf weights) %.4f" % res["val"]["perplexity"], flush=True)
    if args.ckpt and os.path.exists(args.ckpt):
        ck_model, _, ck = load_checkpoint(args.ckpt)
        res["fp32_checkpoint"] = {"step": ck["step"], "history": ck["history"],
                                  "test_perplexity": round(eval_lib.perplexity(
                                      ck_model, test_ids, ctx)[0], 4)}
        print("test ppl (fp32 checkpoint) %.4f" % res["fp32_checkpoint"]["test_perplexity"],
              flush=True)
    train_path = os.path.join(args.data_dir, "train.txt")
    if os.path.exists(train_path):
        train_ids = eval_lib.encode_file(sp, train_path)
        res["unigram_baseline_test_perplexity"] = round(
            unigram_ppl(train_ids, test_ids, cfg.vocab_size), 4)
        res["unigram_baseline_rule"] = ("train-split token counts + 1 (add-one over the vocab), "
                                        "evaluated on every test-file token")
        print("unigram baseline test ppl %.4f" % res["unigram_baseline_test_perplexity"],
              flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("wrote %s" % args.out, flush=True)


if __name__ == "__main__":
    main()
