#!/usr/bin/env python3
"""Plots the long-context model's training (tools/train/run_long.sh) from its phase logs: the
training loss (EMA) per phase on one token axis, and the retrieval accuracy of each evaluation.

    plot_long.py --out docs/long/train.png LOG0 LOG1 LOG2

A resumed phase logs its steps again from the checkpoint; the last record of a step wins.
"""
import argparse
import re

STEP = re.compile(r"^step\s+(\d+)/(\d+) loss \S+ \(ema ([\d.]+)\)")
EVAL = re.compile(r"^eval step (\d+) .*?acc_kv ([\d.]+) acc_passkey_filler ([\d.]+) "
                  r"acc_passkey_natural ([\d.]+)")


def read(path):
    steps, evals = {}, {}
    with open(path) as f:
        for line in f:
            m = STEP.match(line)
            if m:
                steps[int(m.group(1))] = float(m.group(3))
            m = EVAL.match(line)
            if m:
                evals[int(m.group(1))] = tuple(float(m.group(i)) for i in (2, 3, 4))
    return sorted(steps.items()), sorted(evals.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-per-step", default="4096,8192,8192",
                    help="window x batch of each phase (run_long.sh: 128x32, 512x16, 2048x4)")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = [int(x) for x in args.tokens_per_step.split(",")]
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    offset = 0.0
    for phase, path in enumerate(args.logs):
        steps, evals = read(path)
        if not steps:
            continue
        tps = per_step[min(phase, len(per_step) - 1)]
        x = [offset + s * tps / 1e6 for s, _ in steps]
        ax_loss.plot(x, [v for _, v in steps], label="phase %d" % phase)
        if evals:
            ex = [offset + s * tps / 1e6 for s, _ in evals]
            for i, (name, style) in enumerate((("kv recall", ":"), ("pass key, filler", "-"),
                                                ("pass key, text", "--"))):
                ax_acc.plot(ex, [e[i] for _, e in evals], style, marker="o",
                            color="C%d" % phase, label="%s (phase %d)" % (name, phase))
        offset = x[-1]
        ax_loss.axvline(offset, color="grey", lw=0.5)
        ax_acc.axvline(offset, color="grey", lw=0.5)
    ax_loss.set_ylabel("training loss (EMA, nats)")
    ax_loss.legend()
    ax_acc.set_ylabel("retrieval accuracy\n(at the phase's window)")
    ax_acc.set_xlabel("training tokens (millions)")
    ax_acc.set_ylim(-0.05, 1.05)
    ax_acc.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
