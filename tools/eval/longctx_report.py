#!/usr/bin/python3
"""Turns subspace-longctx's --json rows into the long-context quality report: the table, the
gate verdict (does the model need its context? eviction must lose >= 50 points of retrieval
accuracy and >= 10 % long-range perplexity against the full cache), the caches on the Pareto
front of KL divergence and of long-range perplexity against bytes, and a PNG of retrieval, KL
divergence and long-range perplexity against bytes per token.
  longctx_report.py ROWS.json --png OUT.png [--title TEXT] > REPORT.md
Needs Debian's python3-matplotlib (Agg backend, no display).
"""
import argparse
import json


def family(name):
    if name == "full":
        return "full fp16", "k", "*"
    if name == "evict":
        return "eviction (sinks + window)", "tab:red", "X"
    if name.endswith(":sw"):
        label, color, _ = family(name[:-3])
        return label + ", sinks + window exact", color, "o"
    if name in ("q8_0", "q4_0"):
        return "quantized (q8_0 / q4_0)", "tab:blue", "s"
    if name in ("hq8_0", "hq4_0"):
        return "Hadamard-rotated q8_0 / q4_0", "tab:cyan", "s"
    if name.startswith("tq"):
        return "TurboQuant (rotation + Lloyd-Max)", "tab:brown", "P"
    if name in ("kivi4", "kivi2"):
        return "KIVI int4 / int2", "tab:purple", "D"
    parts = name.split(":")
    if parts[0] in ("tcfile", "tccache"):
        return "transform codec from a file (the model's own: the server's default)", \
            "darkviolet", "*"
    if parts[0] == "tc":
        opts = set(parts[2:])
        if "id" in opts:
            return "transform codec, identity basis", "tab:gray", "v"
        if "post" in opts:
            return "transform codec, post-RoPE keys", "tab:pink", "v"
        if "joint" in opts:
            return "transform codec, one budget for all heads", "gold", "*"
        return "transform codec (PCA + bit allocation, pre-RoPE keys)", "magenta", "*"
    method, dtype = parts[0], parts[2]
    if len(parts) == 4:
        return "low-rank + online refresh", "tab:cyan", "o" if dtype == "fp16" else "^"
    if method == "self":
        return "low-rank, self-calibrated, %s" % dtype, "tab:olive", "o" if dtype == "fp16" else "^"
    return "low-rank, calibrated, %s" % dtype, "tab:green" if dtype == "fp16" else "tab:orange", \
        "o" if dtype == "fp16" else "^"


def pareto(rows, key):
    """Names of the rows no other row beats on both bytes and `key` (lower is better)."""
    out = []
    pts = [(r["bytes_ratio"], r[key], n) for n, r in rows.items() if r.get(key) is not None]
    for b, v, n in pts:
        if not any((b2 <= b and v2 <= v) and (b2 < b or v2 < v) for b2, v2, _ in pts):
            out.append((b, n))
    return [n for _, n in sorted(out)]


def retrieval(r):
    n = r["passkey_n"] + r["kv_n"]
    return (r["passkey_hits"] + r["kv_hits"]) / n if n else None


def gate(rows):
    """Lines of the gate verdict, and whether it passed."""
    full, evict = rows.get("full"), rows.get("evict")
    if not full or not evict:
        return ["gate: needs the full and evict rows"], False
    fa, ea = retrieval(full), retrieval(evict)
    lines, ok = [], True
    if fa is None or full["long_ppl"] is None:
        return ["gate: the suite has no retrieval or recurrence items"], False
    drop = 100 * (fa - ea)
    rise = 100 * (evict["long_ppl"] / full["long_ppl"] - 1)
    lines.append("- retrieval accuracy: full %.3f, eviction %.3f: **%.1f points** lost (needs >= 50)"
                 % (fa, ea, drop))
    lines.append("- long-range perplexity: full %.3f, eviction %.3f: **%+.1f %%** (needs >= +10 %%)"
                 % (full["long_ppl"], evict["long_ppl"], rise))
    ok = drop >= 50 and rise >= 10
    lines.append("- verdict: **%s**" % ("the model needs its context" if ok else
                                        "FAILED: the model does not need its context enough to "
                                        "tell compression from eviction"))
    return lines, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("rows")
    ap.add_argument("--png", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    rows = {}
    with open(args.rows) as f:
        for line in f:
            r = json.loads(line)
            rows[r["cache"]] = r

    def fmt(x, digits=3):
        return "—" if x is None else ("%%.%df" % digits) % x

    print("| cache | bytes/token vs fp16 | retrieval | pass key | kv recall | long-range ppl | "
          "plain ppl | KLD (nats) | top-1 agree | bytes @2k | retrieval @2k | long-range ppl @2k | "
          "KLD @2k |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["bytes_ratio"]):
        pk = r["passkey_hits"] / r["passkey_n"] if r["passkey_n"] else None
        kv = r["kv_hits"] / r["kv_n"] if r["kv_n"] else None
        ln = r.get("long_retrieval_n") or 0
        print("| %s | %.3f | %s | %s | %s | %s | %s | %.4f | %.4f | %s | %s | %s | %s |" % (
            name, r["bytes_ratio"], fmt(retrieval(r)), fmt(pk), fmt(kv), fmt(r["long_ppl"]),
            fmt(r["plain_ppl"]), r["kld"], r["top1"], fmt(r.get("long_bytes_ratio")),
            fmt(r["long_retrieval_hits"] / ln if ln else None), fmt(r.get("long_long_ppl")),
            fmt(r.get("long_kld"), 4)))
    print()
    lines, _ = gate(rows)
    print("\n".join(lines))
    print("- Pareto front, KLD against bytes: %s" % ", ".join(pareto(rows, "kld")))
    print("- Pareto front, long-range perplexity against bytes: %s"
          % ", ".join(pareto(rows, "long_ppl")))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2))
    seen = set()
    for name, r in rows.items():
        label, color, marker = family(name)
        kw = dict(color=color, marker=marker, s=60, label=None if label in seen else label)
        seen.add(label)
        acc = retrieval(r)
        if acc is not None:
            ax1.scatter(r["bytes_ratio"], acc, **kw)
            ax1.annotate(name, (r["bytes_ratio"], acc), fontsize=7, xytext=(4, 3),
                         textcoords="offset points")
        kld = max(r["kld"], 1e-6)
        kw["label"] = None
        ax2.scatter(r["bytes_ratio"], kld, **kw)
        ax2.annotate(name, (r["bytes_ratio"], kld), fontsize=7, xytext=(4, 3),
                     textcoords="offset points")
        if r["long_ppl"] is not None:
            ax3.scatter(r["bytes_ratio"], r["long_ppl"], **kw)
            ax3.annotate(name, (r["bytes_ratio"], r["long_ppl"]), fontsize=7, xytext=(4, 3),
                         textcoords="offset points")
    ax1.set_xlabel("KV bytes per token / full fp16")
    ax1.set_ylabel("retrieval accuracy (pass key + kv recall, exact match)")
    ax1.set_ylim(-0.03, 1.03)
    ax2.set_xlabel("KV bytes per token / full fp16")
    ax2.set_ylabel("KL divergence from the full cache (nats / token, log)")
    ax2.set_yscale("log")
    ax3.set_xlabel("KV bytes per token / full fp16")
    ax3.set_ylabel("long-range perplexity (recurring passages, log)")
    ax3.set_yscale("log")
    for ax in (ax1, ax2, ax3):
        ax.set_xlim(0, 1.08)
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
