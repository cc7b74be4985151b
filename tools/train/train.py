#!/usr/bin/python3
"""Trains Subspace-tiny on the corpus from build_corpus.py (CPU, deterministic, fixed steps).

Each training sequence is BOS followed by (context_length - 1) consecutive tokens of the
tokenized train split, at a seeded random offset: the same framing the perplexity evaluation
uses (see eval_lib.py), so train and eval losses are comparable.

With --data longctx the sequences come from longctx.Mixer instead: pass keys, key-value lists
and recurring passages packed with natural text, so the model learns to retrieve and copy from
far back (the long-context model, models/subspace-long.gguf). --init-gguf starts from a GGUF's
weights (the long model continues subspace-tiny); --resume continues the checkpoint at --out
(model, optimizer, step, RNG states), which is saved every --save-every-min minutes and at each
evaluation, so a run can span several sessions.

On a GPU (--device cuda: bf16 autocast, the fused attention kernel) the sequences come from
--workers processes, each with its own seeded stream (seed, worker, first step), so a run is
deterministic for a given worker count; --time-budget-min fits --steps to the time a lease
allows, from the speed of the first steps (the step count is logged, and a rerun with that
--steps repeats the schedule). The weights with the lowest validation loss are also kept, as
<out>-best.pt, for when the last ones overfit the small natural-text corpus.
"""
import argparse
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eval_lib  # noqa: E402
import longctx  # noqa: E402
from model import Config, Llama  # noqa: E402


def log(msg):
    print(msg, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data-dir", default="models/data")
    ap.add_argument("--tokenizer", default="models/work/tokenizer.model")
    ap.add_argument("--out", default="models/work/ckpt.pt")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-chunks", type=int, default=24)
    ap.add_argument("--data", choices=("natural", "longctx"), default="natural")
    ap.add_argument("--mix", choices=("long", "copy", "induct", "wide"), default="long",
                    help="longctx: the long mix, or the copy curriculum for short windows")
    ap.add_argument("--context", type=int, default=0,
                    help="model context length (default: max(512, --seq))")
    ap.add_argument("--init-gguf", default="", help="start from this GGUF's weights")
    ap.add_argument("--init-ckpt", default="", help="start from this checkpoint's weights")
    ap.add_argument("--resume", action="store_true", help="continue the checkpoint at --out")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop after this step (saved), keeping the lr schedule of --steps; "
                         "0: run all --steps")
    ap.add_argument("--save-every-min", type=float, default=10.0)
    ap.add_argument("--eval-retrieval", type=int, default=24,
                    help="longctx: held-out pass-key / key-value prompts scored at each eval")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes that make the training sequences (0: this one)")
    ap.add_argument("--time-budget-min", type=float, default=0.0,
                    help="fit --steps (an upper bound) to this many minutes of training, from "
                         "the speed of the first steps; 0: run --steps")
    args = ap.parse_args()
    device = torch.device(args.device)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    cfg = Config(vocab_size=sp.vocab_size(), n_layers=args.layers, ffn_dim=args.ffn,
                 context_length=args.context or max(512, args.seq))
    t0 = time.time()
    train_ids = np.array(eval_lib.encode_file(sp, os.path.join(args.data_dir, "train.txt")),
                         dtype=np.int64)
    val_ids = eval_lib.encode_file(sp, os.path.join(args.data_dir, "val.txt"))
    val_windows = eval_lib.windows(val_ids, cfg.context_length)[: args.eval_chunks]
    log("tokenized train=%d val=%d tokens in %.1fs" % (len(train_ids), len(val_ids),
                                                       time.time() - t0))

    if args.init_gguf:
        import reference
        model = reference.model_from_gguf(args.init_gguf, context_length=cfg.context_length)[0]
        model = model.float()
        assert model.cfg.vocab_size == cfg.vocab_size, "GGUF vocabulary differs from --tokenizer"
        cfg = model.cfg
        model.train()
        log("initialised from %s" % args.init_gguf)
    elif args.init_ckpt:
        ck = torch.load(args.init_ckpt, map_location="cpu", weights_only=False)
        cfg = Config.from_dict(dict(ck["config"], context_length=cfg.context_length))
        model = Llama(cfg)
        model.load_state_dict(ck["model"])
        log("initialised from %s (step %d)" % (args.init_ckpt, ck["step"]))
    else:
        model = Llama(cfg)
    retrieval, mixer = [], None
    if args.data == "longctx":
        mixer = longctx.Mixer(sp, longctx.Texts(sp, train_ids), rng, args.seq, profile=args.mix)
        val_texts = longctx.Texts(sp, val_ids)
        retrieval = retrieval_set(sp, val_texts, args.seq, args.eval_retrieval)
    n_params = sum(p.numel() for p in model.parameters())
    log("config %s" % json.dumps(cfg.__dict__))
    log("params %d (%.2f M)" % (n_params, n_params / 1e6))

    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 *
                          (1 + math.cos(math.pi * p)))

    history = []
    start = 0
    if args.resume and os.path.exists(args.out):
        ck = torch.load(args.out, map_location="cpu", weights_only=False)
        assert ck["config"] == cfg.__dict__, "checkpoint config differs from this run's"
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        rng.bit_generator.state = ck["numpy_rng"]
        torch.set_rng_state(ck["torch_rng"])
        start, history = ck["step"], ck["history"]
        log("resumed %s at step %d" % (args.out, start))

    def save_best(step):
        path = os.path.splitext(args.out)[0] + "-best.pt"
        torch.save({"config": cfg.__dict__, "model": model.state_dict(), "step": step,
                    "args": vars(args), "history": history}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def save(step):
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        tmp = args.out + ".tmp"
        torch.save({"config": cfg.__dict__, "model": model.state_dict(), "step": step,
                    "args": vars(args), "history": history, "optimizer": opt.state_dict(),
                    "numpy_rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state()},
                   tmp)
        os.replace(tmp, args.out)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"config": cfg.__dict__, "step": step, "params": n_params,
                       "args": vars(args), "history": history}, f, indent=1)

    tokens_per_step = args.batch * args.seq
    t_start = time.time()
    t_saved = t_start
    run_loss = None
    last = min(args.steps, args.stop_at) if args.stop_at > 0 else args.steps
    fit_at = start + 13 if args.time_budget_min > 0 else -1  # 3 warm-up steps + 10 timed
    best_val = min([h["val_loss"] for h in history] or [float("inf")])

    batches = Batches(args, sp, train_ids, start) if args.workers > 0 else None
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    step = start
    t_timed = time.time()  # restarted at start + 3, once the first steps' warm-up is past
    while step < last:
        if step == fit_at:
            # Fit the schedule to the budget: the time per step so far (evaluations are counted
            # at 3 s each, a guess on the safe side), as an upper bound on --steps.
            per_step = (time.time() - t_timed) / 10
            left = 60 * args.time_budget_min - (time.time() - t_start)
            n = int(left / (per_step + 3.0 / args.eval_every))
            args.steps = min(args.steps, step + max(1, n))
            last = min(args.steps, args.stop_at) if args.stop_at > 0 else args.steps
            log("time budget %.1f min: %.3f s/step, --steps %d" % (args.time_budget_min,
                                                                 per_step, args.steps))
        if step == start + 3:
            t_timed = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        seqs = batches.get(step) if batches else make_batch(args, train_ids, rng, mixer)
        x = torch.from_numpy(seqs).to(device, non_blocking=True)
        with autocast:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(),
                                   x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        lv = loss.item()
        run_loss = lv if run_loss is None else 0.9 * run_loss + 0.1 * lv
        step = done = step + 1
        if args.time_budget_min > 0 and time.time() - t_start > 72 * args.time_budget_min:
            log("past 1.2x the time budget at step %d: stopping here" % done)
            last = done  # evaluated and saved below
        if done % args.log_every == 0 or done == start + 1:
            el = time.time() - t_start
            eta = el / (done - start) * (last - done)
            log("step %5d/%d loss %.4f (ema %.4f) lr %.2e gnorm %.2f | %.2f s/step "
                "%.0f tok/s | elapsed %s eta %s" % (
                    done, last, lv, run_loss, lr_at(step), gnorm, el / (done - start),
                    (done - start) * tokens_per_step / el, fmt(el), fmt(eta)))
        if done % args.eval_every == 0 or done == last:
            model.eval()
            vl = eval_lib.mean_nll(model, val_windows)
            acc = retrieval_accuracy(model, retrieval)
            if args.data == "longctx":
                acc["copy_gain"] = longctx.copy_gain(
                    lambda ids: token_nll(model, ids), np.random.default_rng(7), cfg.vocab_size,
                    seq=min(args.seq, 256))
                acc["copy_gain_text"] = longctx.passage_copy_gain(
                    lambda ids: token_nll(model, ids), val_texts, np.random.default_rng(7))
                acc["copy_gain_far"] = longctx.passage_copy_gain(
                    lambda ids: token_nll(model, ids), val_texts, np.random.default_rng(7),
                    gap=int(0.75 * args.seq))
            model.train()
            entry = {"step": done, "train_loss_ema": round(run_loss, 4),
                     "val_loss": round(vl, 4), "elapsed_s": round(time.time() - t_start)}
            entry.update({k: round(v, 4) for k, v in acc.items()})
            history.append(entry)
            log("eval step %d train_loss_ema %.4f val_loss %.4f (val ppl %.2f, %d chunks)%s" % (
                done, run_loss, vl, math.exp(vl), len(val_windows),
                "".join(" %s %.3f" % kv for kv in sorted(acc.items()))))
            save(done)
            if vl < best_val:
                best_val = vl
                save_best(done)
            t_saved = time.time()
        elif time.time() - t_saved > 60 * args.save_every_min:
            save(done)
            t_saved = time.time()
    if batches:
        batches.close()
    log("done in %s; checkpoint %s" % (fmt(time.time() - t_start), args.out))


def _worker(args, train_ids, wid, start, queue):
    """Makes the batches of steps start + wid, start + wid + workers, ... into `queue`."""
    torch.set_num_threads(1)
    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    rng = np.random.default_rng([args.seed, wid, start])
    mixer = longctx.Mixer(sp, longctx.Texts(sp, train_ids), rng, args.seq, profile=args.mix)
    while True:
        queue.put(make_batch(args, train_ids, rng, mixer))


def make_batch(args, train_ids, rng, mixer):
    """One training batch [batch, seq]: documents from `mixer` (--data longctx), or BOS and
    a span of the train split at a random offset."""
    if args.data == "longctx":
        return np.array([mixer.sequence() for _ in range(args.batch)], dtype=np.int64)
    n_body = args.seq - 1
    offs = rng.integers(0, len(train_ids) - n_body - 1, size=args.batch)
    return np.stack([np.concatenate(([eval_lib.BOS], train_ids[o:o + n_body])) for o in offs])


class Batches:
    """Training batches from --workers processes, each with its own seeded stream: the batch
    of step s comes from worker (s - start) % workers, so a run is deterministic for a given
    worker count and starting step. Forked before the model touches the GPU."""

    def __init__(self, args, sp, train_ids, start):
        ctx = multiprocessing.get_context("fork")
        self.start, self.n = start, args.workers
        self.queues = [ctx.Queue(maxsize=4) for _ in range(self.n)]
        self.procs = [ctx.Process(target=_worker, args=(args, train_ids, w, start, q),
                                  daemon=True) for w, q in enumerate(self.queues)]
        for p in self.procs:
            p.start()

    def get(self, step):
        return self.queues[(step - self.start) % self.n].get()

    def close(self):
        for p in self.procs:
            p.terminate()


def retrieval_set(sp, texts, seq, n):
    """Held-out (validation split, fixed seed) pass-key and key-value prompts that fill the
    training window, as token ids with the answer span, for retrieval_accuracy()."""
    rng = np.random.default_rng(20261125)
    out = []
    for i in range(n):
        depth = (i // 3) / max(1, (n - 1) // 3)
        kind = ("passkey_filler", "passkey_natural", "kv")[i % 3]
        if kind == "kv":
            d = longctx.kv_recall(sp, rng, seq - 16)
        else:
            d = longctx.passkey(sp, texts, rng, seq - 16, depth, haystack=kind.split("_")[1])
        p = [eval_lib.BOS] + sp.encode(d["prompt"])
        a = sp.encode(d["prompt"] + d["answer"])[len(p) - 1:]
        out.append((kind, p + a, len(p), len(a)))
    return out


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def token_nll(model, ids):
    x = torch.tensor([ids], dtype=torch.long, device=_device(model))
    return F.cross_entropy(model(x[:, :-1])[0], x[0, 1:], reduction="none").tolist()


@torch.no_grad()
def retrieval_accuracy(model, items):
    """Exact match of every answer token under teacher forcing (= greedy exact match)."""
    hits = {}
    for kind, ids, n_prompt, n_ans in items:
        x = torch.tensor([ids[:-1]], dtype=torch.long, device=_device(model))
        pred = model(x)[0, n_prompt - 1:n_prompt - 1 + n_ans].argmax(-1).tolist()
        hits.setdefault(kind, []).append(pred == ids[n_prompt:n_prompt + n_ans])
    return {"acc_" + k: sum(v) / len(v) for k, v in hits.items()}


def fmt(s):
    s = int(s)
    return "%d:%02d:%02d" % (s // 3600, s // 60 % 60, s % 60)


if __name__ == "__main__":
    main()
