#!/usr/bin/python3
"""Pre-RoPE vs post-RoPE keys: the rank a low-rank key basis needs for the same attention error.

Palu, ShadowKV and xKV compress keys before RoPE because RoPE raises their rank; Subspace's
coefficient-space attention (q~ = P^T q, logit q~ . c) needs a post-RoPE basis. For every layer
and KV head this measures, on held-out text, the relative error of the attention output when
keys are replaced by their projection on the top-r PCA directions of keys from calibration text
-- post-RoPE keys projected as they are, or pre-RoPE keys projected and then rotated -- and the
rank each needs to reach a given error. Values are kept exact, so only the key basis differs.
  rope_rank.py --ckpt CKPT.pt | --gguf MODEL.gguf [--calib TEXT] [--eval TEXT] [--window N]
"""
import argparse
import os
import sys

import numpy as np
import sentencepiece as spm
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import eval_lib  # noqa: E402
import reference  # noqa: E402
from model import apply_rope, load_checkpoint  # noqa: E402

RANKS = (4, 8, 12, 16, 24, 32, 48, 64)
TARGETS = (0.02, 0.05, 0.10)


@torch.no_grad()
def collect(model, ids, window):
    """Per layer: q [H, T, d] (post-RoPE), k_pre / k_post / v [KV, T, d] over windows of ids."""
    cfg = model.cfg
    hd, out = cfg.head_dim, []
    for l in range(cfg.n_layers):
        out.append({"q": [], "k_pre": [], "k_post": [], "v": []})
    for s in range(0, len(ids) - window + 1, window):
        x_ids = torch.tensor([[1] + ids[s:s + window - 1]])
        T = x_ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]
        x = model.tok_emb(x_ids)
        for l, b in enumerate(model.blocks):
            h = b.attn_norm(x)
            q = b.wq(h).view(1, T, cfg.n_heads, hd).transpose(1, 2)
            k = b.wk(h).view(1, T, cfg.n_kv_heads, hd).transpose(1, 2)
            v = b.wv(h).view(1, T, cfg.n_kv_heads, hd).transpose(1, 2)
            out[l]["q"].append(apply_rope(q, cos, sin)[0])
            out[l]["k_pre"].append(k[0])
            out[l]["k_post"].append(apply_rope(k, cos, sin)[0])
            out[l]["v"].append(v[0])
            x = b(x, cos, sin, mask)
    return out, cos, sin


def top_basis(k_list, r):
    """Top-r right singular directions of keys [n, d] (uncentred, as the cache's PCA)."""
    k = torch.cat([t.reshape(-1, t.shape[-1]) for t in k_list]).double()
    _, _, vt = torch.linalg.svd(k, full_matrices=False)
    return vt[:r].T.float()  # [d, r]


def attention(q, k, v, group):
    """Causal attention; q [H, T, d], k/v [KV, T, d] -> [H, T, d]."""
    T, d = q.shape[1], q.shape[2]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    s = (q @ k.transpose(-1, -2)) / d ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ckpt")
    ap.add_argument("--gguf")
    ap.add_argument("--tokenizer", default="models/subspace-tiny.tokenizer.model")
    ap.add_argument("--text", default="models/data/test.txt",
                    help="first half calibrates, second half evaluates")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=2, help="windows per half")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ckpt:
        model, cfg, _ = load_checkpoint(args.ckpt)
    else:
        model, cfg, _ = reference.model_from_gguf(args.gguf, max(args.window, 512))
        model = model.float().eval()
    window = min(args.window, cfg.context_length)
    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    ids = [int(t) for t in eval_lib.encode_file(sp, args.text)]
    half = len(ids) // 2
    need = window * args.windows
    calib, held = ids[:min(half, need)], ids[half:half + need]
    cal, _, _ = collect(model, calib, window)
    ev, cos, sin = collect(model, held, window)
    group = cfg.n_heads // cfg.n_kv_heads
    # err[kind][r] summed over layers and windows
    rows = []
    for l in range(cfg.n_layers):
        for h in range(cfg.n_kv_heads):
            for kind in ("post", "pre"):
                basis_all = top_basis([t[h] for t in cal[l]["k_" + kind]], cfg.head_dim)
                errs = []
                for r in RANKS:
                    if r > cfg.head_dim:
                        continue
                    p = basis_all[:, :r]
                    num = den = 0.0
                    for w in range(len(ev[l]["q"])):
                        q = ev[l]["q"][w][h * group:(h + 1) * group]
                        v = ev[l]["v"][w][h:h + 1]
                        k_exact = ev[l]["k_post"][w][h:h + 1]
                        k_src = ev[l]["k_" + kind][w][h:h + 1]
                        k_hat = (k_src @ p) @ p.T
                        if kind == "pre":
                            T = k_hat.shape[1]
                            k_hat = apply_rope(k_hat[None], cos[:T], sin[:T])[0]
                        o = attention(q, k_exact, v, group)
                        o_hat = attention(q, k_hat, v, group)
                        num += float((o_hat - o).pow(2).sum())
                        den += float(o.pow(2).sum())
                    errs.append((r, (num / den) ** 0.5))
                rows.append((l, h, kind, errs))
    print("relative attention-output error by key rank (values exact), held-out text, "
          "window %d x %d; basis from the other half" % (window, args.windows))
    print("| layer/head | keys | " + " | ".join("r=%d" % r for r, _ in rows[0][3]) +
          " | " + " | ".join("rank for <=%g" % t for t in TARGETS) + " |")
    print("|---|---|" + "--:|" * (len(rows[0][3]) + len(TARGETS)))
    need = {"pre": {t: [] for t in TARGETS}, "post": {t: [] for t in TARGETS}}
    for l, h, kind, errs in rows:
        cells = []
        for t in TARGETS:
            r_ok = next((r for r, e in errs if e <= t), None)
            need[kind][t].append(r_ok if r_ok is not None else cfg.head_dim)
            cells.append(str(r_ok) if r_ok is not None else "> %d" % errs[-1][0])
        print("| %d/%d | %s | %s | %s |" % (l, h, kind, " | ".join("%.3f" % e for _, e in errs),
                                           " | ".join(cells)))
    print()
    for t in TARGETS:
        print("mean rank for error <= %g: post-RoPE %.1f, pre-RoPE %.1f" % (
            t, np.mean(need["post"][t]), np.mean(need["pre"][t])))


if __name__ == "__main__":
    main()
