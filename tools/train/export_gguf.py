#!/usr/bin/python3
"""Exports a Subspace-tiny checkpoint and its SentencePiece tokenizer as a llama-arch GGUF file.

Matrices are written as F16 (or --dtype f32/bf16/q8_0), norm weights always as F32. No weight
permutation is needed: the PyTorch model already uses llama.cpp's adjacent-pair RoPE.
"""
import argparse
import os
import sys

import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gguf"))
from gguf_writer import GgufType, GgufWriter, TensorType  # noqa: E402
from model import load_checkpoint  # noqa: E402

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def token_type(sp, i):
    if sp.is_unknown(i):
        return TOKEN_UNKNOWN
    if sp.is_control(i):
        return TOKEN_CONTROL
    if sp.is_byte(i):
        return TOKEN_BYTE
    if sp.is_unused(i):
        return TOKEN_UNUSED
    return TOKEN_NORMAL


def add_tokenizer(w, sp):
    n = sp.vocab_size()
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [sp.id_to_piece(i) for i in range(n)], GgufType.STRING)
    w.add_array("tokenizer.ggml.scores", [sp.get_score(i) for i in range(n)], GgufType.FLOAT32)
    w.add_array("tokenizer.ggml.token_type", [token_type(sp, i) for i in range(n)],
                GgufType.INT32)
    w.add_uint32("tokenizer.ggml.bos_token_id", sp.bos_id())
    w.add_uint32("tokenizer.ggml.eos_token_id", sp.eos_id())
    w.add_uint32("tokenizer.ggml.unknown_token_id", sp.unk_id())
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_bool("tokenizer.ggml.add_space_prefix", True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ckpt", default="models/work/ckpt.pt")
    ap.add_argument("--tokenizer", default="models/subspace-tiny.tokenizer.model")
    ap.add_argument("--out", default="models/subspace-tiny.gguf")
    ap.add_argument("--dtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--name", default="subspace-tiny")
    args = ap.parse_args()

    model, cfg, ck = load_checkpoint(args.ckpt)
    sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    assert sp.vocab_size() == cfg.vocab_size
    mat_type = {"f32": TensorType.F32, "f16": TensorType.F16, "bf16": TensorType.BF16,
                "q8_0": TensorType.Q8_0}[args.dtype]
    file_type = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[args.dtype]  # llama_ftype

    w = GgufWriter(args.out)
    w.add_string("general.architecture", "llama")
    w.add_string("general.name", args.name)
    w.add_string("general.description",
                 "Subspace-tiny: a small Llama trained by tools/train on the King James Bible "
                 "and BSD-licensed fortune cookies (see models/README.md)")
    w.add_string("general.license", "CC0-1.0")
    w.add_uint32("general.file_type", file_type)
    w.add_uint32("general.alignment", 32)
    w.add_uint32("llama.context_length", cfg.context_length)
    w.add_uint32("llama.embedding_length", cfg.dim)
    w.add_uint32("llama.block_count", cfg.n_layers)
    w.add_uint32("llama.feed_forward_length", cfg.ffn_dim)
    w.add_uint32("llama.attention.head_count", cfg.n_heads)
    w.add_uint32("llama.attention.head_count_kv", cfg.n_kv_heads)
    w.add_uint32("llama.rope.dimension_count", cfg.head_dim)
    w.add_float32("llama.rope.freq_base", cfg.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    w.add_uint32("llama.vocab_size", cfg.vocab_size)
    add_tokenizer(w, sp)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["tok_emb.weight"], mat_type)
    names = [("attn_norm", "attn_norm.weight", None), ("attn_q", "wq.weight", mat_type),
             ("attn_k", "wk.weight", mat_type), ("attn_v", "wv.weight", mat_type),
             ("attn_output", "wo.weight", mat_type), ("ffn_norm", "ffn_norm.weight", None),
             ("ffn_gate", "w_gate.weight", mat_type), ("ffn_up", "w_up.weight", mat_type),
             ("ffn_down", "w_down.weight", mat_type)]
    for i in range(cfg.n_layers):
        for gguf_name, torch_name, ttype in names:
            w.add_tensor("blk.%d.%s.weight" % (i, gguf_name),
                         sd["blocks.%d.%s" % (i, torch_name)], ttype or TensorType.F32)
    w.add_tensor("output_norm.weight", sd["norm.weight"], TensorType.F32)
    if not cfg.tied_output:
        w.add_tensor("output.weight", sd["output.weight"], mat_type)
    w.write()
    print("wrote %s (%d bytes, step %d)" % (args.out, os.path.getsize(args.out), ck["step"]),
          flush=True)


if __name__ == "__main__":
    main()
