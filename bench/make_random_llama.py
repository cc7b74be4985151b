#!/usr/bin/env python3
"""Writes a random-weight Llama GGUF of a real model's shape, for benchmarks that need the size
of a real model but not its quality (the GPU's end-to-end decode at 1 B parameters).

    make_random_llama.py --out FILE [--preset 1b] [--ctx 16384]

Preset 1b is Llama 3.2 1B's shape (dim 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64,
FFN 8192) with a 32,000-token toy vocabulary; weights are fp16, N(0, 0.02) like a fresh init, so
activations stay finite. The tokenizer is the reference fixtures' toy SentencePiece table
(tests/reference/make_reference.py): the file loads everywhere a model loads.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools", "gguf"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
from gguf_writer import GgufWriter, TensorType  # noqa: E402
from make_reference import tokenizer_metadata  # noqa: E402

PRESETS = {
    "1b": dict(vocab=32000, dim=2048, n_heads=32, n_kv=8, n_layers=16, ffn=8192,
               theta=500000.0, eps=1e-5),
    "tiny": dict(vocab=512, dim=256, n_heads=4, n_kv=2, n_layers=2, ffn=512,
                 theta=10000.0, eps=1e-5),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--ctx", type=int, default=16384, help="llama.context_length")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    rng = np.random.default_rng(args.seed)
    hd = cfg["dim"] // cfg["n_heads"]

    def mat(rows, cols, std=0.02):
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)

    def norm():
        return np.ones(cfg["dim"], dtype=np.float32)

    w = GgufWriter(args.out)
    w.add_string("general.architecture", "llama")
    w.add_string("general.name", "random-llama-" + args.preset)
    w.add_uint32("llama.context_length", args.ctx)
    w.add_uint32("llama.embedding_length", cfg["dim"])
    w.add_uint32("llama.block_count", cfg["n_layers"])
    w.add_uint32("llama.feed_forward_length", cfg["ffn"])
    w.add_uint32("llama.attention.head_count", cfg["n_heads"])
    w.add_uint32("llama.attention.head_count_kv", cfg["n_kv"])
    w.add_uint32("llama.rope.dimension_count", hd)
    w.add_float32("llama.rope.freq_base", cfg["theta"])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["eps"])
    w.add_uint32("llama.vocab_size", cfg["vocab"])
    tokenizer_metadata(w, cfg["vocab"])
    f16 = TensorType.F16
    w.add_tensor("token_embd.weight", mat(cfg["vocab"], cfg["dim"], 1.0), f16)
    for i in range(cfg["n_layers"]):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", norm(), TensorType.F32)
        w.add_tensor(p + "attn_q.weight", mat(cfg["n_heads"] * hd, cfg["dim"]), f16)
        w.add_tensor(p + "attn_k.weight", mat(cfg["n_kv"] * hd, cfg["dim"]), f16)
        w.add_tensor(p + "attn_v.weight", mat(cfg["n_kv"] * hd, cfg["dim"]), f16)
        w.add_tensor(p + "attn_output.weight", mat(cfg["dim"], cfg["n_heads"] * hd), f16)
        w.add_tensor(p + "ffn_norm.weight", norm(), TensorType.F32)
        w.add_tensor(p + "ffn_gate.weight", mat(cfg["ffn"], cfg["dim"]), f16)
        w.add_tensor(p + "ffn_up.weight", mat(cfg["ffn"], cfg["dim"]), f16)
        w.add_tensor(p + "ffn_down.weight", mat(cfg["dim"], cfg["ffn"]), f16)
    w.add_tensor("output_norm.weight", norm(), TensorType.F32)
    w.add_tensor("output.weight", mat(cfg["vocab"], cfg["dim"]), f16)
    w.write()


if __name__ == "__main__":
    main()
