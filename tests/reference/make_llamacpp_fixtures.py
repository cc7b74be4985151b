#!/usr/bin/env python3
"""Writes tests/data/llamacpp/: small random-weight GGUFs of the architectures llama.cpp
(commit c392e509) runs -- written by make_reference.py's writer -- and llama.cpp's float32
logits for every position of a token sequence plus its greedy continuation, read back by
tests/core/model/llamacpp_reference_test.cc. Run through tools/llama_ref/build.sh, which
builds the logits tool against a llama.cpp checkout outside this repository.

manifest.txt, one record per line:
    llamacpp model=NAME gguf=FILE tokens=1,2 logits=FILE greedy=5,6 tol=1e-4
"""
import argparse
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_reference import BASE, MODELS, write_model  # noqa: E402

# Llama (plain, and with Llama 3's frequency factors), Qwen2 (biases, halves RoPE, tied output,
# with Q8_0 weights, and with YaRN scaling), Phi-3 (fused tensors; and with a 13-token sliding
# window, which llama.cpp masks for Phi-3). llama.cpp c392e509 predates Qwen3.
NAMES = ["gqa_f32", "llama3_freqs_f32", "qwen2_f32", "qwen2_q8_0", "phi3_f32", "qwen2_yarn_f32",
         "phi3_swa_f32"]
N_TOKENS, GREEDY_STEPS = 24, 12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logits-tool", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-commit", default="unknown")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = ["# written by tests/reference/make_llamacpp_fixtures.py with llama.cpp %s" %
             args.llama_commit]
    for index, name in enumerate(NAMES):
        overrides, mtype, ntype, tol = MODELS[name]
        cfg = dict(BASE, **overrides)
        gguf = name + ".gguf"
        write_model(os.path.join(args.out, gguf), name, cfg, mtype, ntype, seed=5000 + index)
        rng = np.random.default_rng(index)
        tokens = [int(t) for t in rng.integers(3, cfg["vocab"], N_TOKENS)]
        logits = name + ".logits.f32"
        out = subprocess.run([args.logits_tool, os.path.join(args.out, gguf),
                              ",".join(map(str, tokens)), os.path.join(args.out, logits),
                              str(GREEDY_STEPS)],
                             check=True, capture_output=True, text=True).stdout
        greedy = [line for line in out.splitlines() if line.startswith("greedy=")][0][7:]
        lines.append("llamacpp model=%s gguf=%s tokens=%s logits=%s greedy=%s tol=%g" % (
            name, gguf, ",".join(map(str, tokens)), logits, greedy, tol))
    with open(os.path.join(args.out, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d llama.cpp references to %s" % (len(NAMES), args.out))


if __name__ == "__main__":
    main()
