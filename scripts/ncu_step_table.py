#!/usr/bin/env python3
"""Accounts for one decode step kernel by kernel, from an Nsight Compute CSV.

scripts/gpu_run.sh runs `ncu --csv --page raw` over subspace-bench-cpu (a prefill, then a few
decode steps, for each cache kind in turn) and this reads the log back: a decode step is the run
of launches from one EmbeddingKernel to the next that holds no prefill attention; the last decode
step before each prefill (and the final one) is tabled, kernels grouped by name, with their time
(gpu__time_duration, each kernel alone with cold caches: ncu serialises launches and flushes
the L2), the DRAM bytes they moved and the share of the step. The weight-read floor is the
model's tensor bytes over the measured copy bandwidth (read + write counted, as the decode
attention benchmark quotes it: a kernel that only streams reads reaches about that rate).

    ncu_step_table.py NCU_CSV --labels full,compressed [--weight-bytes N] [--copy-gbps G]
"""
import argparse
import csv
import io
import re
import sys
from collections import OrderedDict


def read_rows(path):
    with open(path, newline="", errors="replace") as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        sys.exit(f"{path}: no ncu CSV header")
    lines = [l for l in text[start:].splitlines() if l.startswith('"')]
    reader = csv.reader(io.StringIO("\n".join(lines)))
    header = next(reader)
    units = next(reader)  # the units row of --page raw
    rows = [dict(zip(header, r)) for r in reader if len(r) == len(header)]
    return header, dict(zip(header, units)), rows


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def scale(units, name):
    """Nanoseconds per unit of a duration metric, bytes per unit of a byte metric."""
    u = units.get(name, "")
    return {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "byte": 1.0,
            "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(u, 1.0)


def short(name):
    """`void ns::<unnamed>::RmsNormKernel<1>(Params)` -> `RmsNormKernel<1>`."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"<unnamed>|\(anonymous namespace\)", "anon", name)
    depth, cut = 0, len(name)
    for i, c in enumerate(name):  # drop the parameter list: the first '(' outside template brackets
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    head = name.split("<", 1)
    head[0] = head[0].rsplit("::", 1)[-1]
    return "<".join(head)[:56]


def steps(rows):
    """Yields (is_prefill, rows) for each run of launches that starts at an EmbeddingKernel."""
    cur = None
    for r in rows:
        if "EmbeddingKernel" in r["Kernel Name"]:
            if cur:
                yield cur
            cur = []
        if cur is not None:
            cur.append(r)
    if cur:
        yield cur


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--labels", default="full,compressed")
    ap.add_argument("--weight-bytes", type=float, default=0.0)
    ap.add_argument("--copy-gbps", type=float, default=0.0, help="read + write GB/s")
    args = ap.parse_args()
    _, units, rows = read_rows(args.csv)
    t_key, r_key, w_key = "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"
    t_scale, r_scale, w_scale = scale(units, t_key), scale(units, r_key), scale(units, w_key)

    # The last decode step before each prefill, and the last one of all.
    chosen, last_decode = [], None
    for run in steps(rows):
        prefill = any("PrefillAttention" in r["Kernel Name"] for r in run)
        if prefill:
            if last_decode:
                chosen.append(last_decode)
            last_decode = None
        else:
            last_decode = run
    if last_decode:
        chosen.append(last_decode)
    labels = args.labels.split(",")
    floor_us = 0.0
    if args.weight_bytes and args.copy_gbps:
        floor_us = args.weight_bytes / (args.copy_gbps * 1e9) * 1e6
    for i, run in enumerate(chosen):
        label = labels[i] if i < len(labels) else f"run {i}"
        groups = OrderedDict()
        for r in run:
            g = groups.setdefault(short(r["Kernel Name"]), [0, 0.0, 0.0, 0.0, r.get("Grid Size", ""),
                                                             r.get("Block Size", "")])
            g[0] += 1
            g[1] += number(r.get(t_key, "0")) * t_scale / 1e3
            g[2] += number(r.get(r_key, "0")) * r_scale
            g[3] += number(r.get(w_key, "0")) * w_scale
        total_us = sum(g[1] for g in groups.values())
        total_read = sum(g[2] for g in groups.values())
        print(f"\n### One decode step, {label} cache: {len(run)} launches, "
              f"{total_us:,.1f} us of kernel time, {total_read / 1e6:,.1f} MB read from DRAM")
        if floor_us:
            print(f"(weights {args.weight_bytes / 1e9:.2f} GB at the copy's {args.copy_gbps:,.0f} GB/s: "
                  f"{floor_us:,.1f} us; kernel time / floor {total_us / floor_us:.2f})")
        print("\n| kernel | launches | grid x block | us | % of step | MB read | GB/s read |")
        print("|---|--:|---|--:|--:|--:|--:|")
        for name, (n, us, rd, wr, grid, block) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            gbps = rd / (us * 1e3) if us else 0.0
            print(f"| {name} | {n} | {grid} x {block} | {us:,.1f} | {100 * us / total_us:.1f} | "
                  f"{rd / 1e6:,.1f} | {gbps:,.0f} |")
    if not chosen:
        print("no decode step found in", args.csv)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
