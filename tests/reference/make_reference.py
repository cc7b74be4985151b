#!/usr/bin/env python3
"""Writes the fixtures of the model reference tests: small random-weight Llama, Qwen2, Qwen3 and
Phi-3 GGUFs (written
with tools/gguf/gguf_writer.py) and their float64 NumPy logits (tests/reference/llama_numpy.py).

    make_reference.py --out DIR

DIR/manifest.txt lists one record per line, space-separated key=value fields:
    case model=NAME gguf=FILE wtype=F32 tol=1e-4 tokens=1,2,3 logits=FILE
        logits FILE: raw little-endian float64 [len(tokens), n_vocab], every position
    greedy model=NAME gguf=FILE prompt=1,2 generated=5,6 min_margin=0.3
        greedy continuation by the reference, and the smallest top-1/top-2 logit gap on the way
"""
import argparse
import os
import sys

try:
    import numpy as np
except ImportError:  # a Python without NumPy first on PATH (pyenv): use Debian's python3-numpy
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "gguf"))
sys.path.insert(0, HERE)
from gguf_writer import GgufType, GgufWriter, TensorType  # noqa: E402
from llama_numpy import LlamaNumpy  # noqa: E402

# Shapes shared by the models; per-model fields override.
BASE = dict(vocab=96, dim=64, n_heads=4, n_kv=2, n_layers=2, ffn=96, ctx=64, rope_dim=16,
            theta=10000.0, eps=1e-5, tied=False)
K_SHAPE = dict(dim=256, n_heads=4, n_kv=2, ffn=512, rope_dim=64)
QTOL = 8e-2
# name -> (overrides, matrix type (or {role: type}), norm type, tolerance on max|a-b|/max|b| per
# logits row).
# The reference reads the weights back from the GGUF, so rounding of F16/BF16 weights is the
# same on both sides and only the engine's fp32 arithmetic differs: 1e-4. For the block types the
# reference also quantizes each matmul's activations to 8 bits as the engine (and llama.cpp)
# does. Most rows then agree to ~3e-7, but the engine's fp32 activations differ from the
# reference's fp64 ones by ~1e-6, enough to land an activation on the next code now and then
# (~2.5e-4 of values sit that close to a rounding edge); one such code moves a logits row of
# these random models by up to ~4e-2. Hence QTOL. The kernels themselves are held to 1e-5 on
# fixed activations by tests/core/cpu/ops_test.cc and to ggml's numbers by
# tests/core/base/quant_blocks_test.cc.
MODELS = {
    "gqa_f32": ({}, TensorType.F32, TensorType.F32, 1e-4),
    "gqa_f16": ({}, TensorType.F16, TensorType.F32, 1e-4),
    "gqa_bf16": ({}, TensorType.BF16, TensorType.BF16, 1e-4),
    "gqa_q8_0": ({}, TensorType.Q8_0, TensorType.F32, QTOL),
    "mqa_tied_f32": (dict(n_kv=1, tied=True, theta=500000.0, rope_dim=8, eps=1e-6),
                     TensorType.F32, TensorType.F32, 1e-4),
    "mqa_tied_f16": (dict(n_kv=1, tied=True, theta=500000.0, rope_dim=8, eps=1e-6),
                     TensorType.F16, TensorType.F16, 1e-4),
    # Every block type. (q4_1 / q5_1: the engine's decode path also multiplies the weights' mins
    # by q8_1's fp16 sum of the activation codes, within 2^-10 of what the reference uses.)
    "gqa_q4_0": ({}, TensorType.Q4_0, TensorType.F32, QTOL),
    "gqa_q4_1": ({}, TensorType.Q4_1, TensorType.F32, QTOL),
    "gqa_q5_0": ({}, TensorType.Q5_0, TensorType.F32, QTOL),
    "gqa_q5_1": ({}, TensorType.Q5_1, TensorType.F32, QTOL),
    "gqa_iq4_nl": ({}, TensorType.IQ4_NL, TensorType.F32, QTOL),
    # K-quants need rows of whole 256-value super-blocks: dim 256, FFN 512, head_dim 64.
    "k_q2_K": (K_SHAPE, TensorType.Q2_K, TensorType.F32, QTOL),
    "k_q3_K": (K_SHAPE, TensorType.Q3_K, TensorType.F32, QTOL),
    "k_q4_K": (K_SHAPE, TensorType.Q4_K, TensorType.F32, QTOL),
    "k_q5_K": (K_SHAPE, TensorType.Q5_K, TensorType.F32, QTOL),
    "k_q6_K": (K_SHAPE, TensorType.Q6_K, TensorType.F32, QTOL),
    # A file mixing types the way llama.cpp's Q4_K_M does: q4_K, q6_K for attn_v / ffn_down /
    # output, q5_0 where rows are not whole super-blocks (here the 288-wide FFN's ffn_down).
    "k_mixed_q4_K_M": (dict(K_SHAPE, ffn=288), {"default": TensorType.Q4_K,
                                                "attn_v": TensorType.Q6_K,
                                                "ffn_down": TensorType.Q5_0,
                                                "output": TensorType.Q6_K,
                                                "token_embd": TensorType.Q8_0},
                       TensorType.F32, QTOL),
}
# The other architectures (general.architecture and what comes with it): the halves RoPE
# layout with Qwen2's biases and a tied output, Qwen3's per-head Q/K norms on heads wider than
# dim / n_heads, Phi-3's fused QKV and gate-up, Llama 3's RoPE frequency factors, linear and
# YaRN RoPE scaling.
MODELS.update({
    "qwen2_f32": (dict(arch="qwen2", theta=1e6, tied=True, eps=1e-6, ctx=256), TensorType.F32,
                  TensorType.F32, 1e-4),
    "qwen2_q8_0": (dict(arch="qwen2", theta=1e6), TensorType.Q8_0, TensorType.F32, QTOL),
    "qwen3_f16": (dict(arch="qwen3", key_length=32, rope_dim=32, theta=1e6, eps=1e-6,
                       ctx=256), TensorType.F16, TensorType.F32, 1e-4),
    # llama.cpp insists on Phi-3's sliding_window key (one as long as the context changes
    # nothing), and a general.name with "phi3" in it would make it look for Phi-3's tokens.
    "phi3_f32": (dict(arch="phi3", n_kv=4, sliding_window=256, general_name="fused-qkv",
                      ctx=256), TensorType.F32, TensorType.F32, 1e-4),
    "llama3_freqs_f32": (dict(theta=500000.0, rope_freqs=True, ctx=256), TensorType.F32,
                         TensorType.F32, 1e-4),
    # The head widths of real models, for the compressed cache over these families
    # (server_cache_itest): Qwen2 with 64-wide heads, Qwen3 with 128-wide heads on a 256-wide
    # model (q_width 512).
    "qwen2_hd64_f16": (dict(arch="qwen2", dim=256, n_heads=4, n_kv=2, ffn=512, rope_dim=64,
                            theta=1e6, ctx=256), TensorType.F16, TensorType.F32, 1e-4),
    "qwen3_hd128_f16": (dict(arch="qwen3", dim=256, n_heads=4, n_kv=2, ffn=512, key_length=128,
                             rope_dim=128, theta=1e6, ctx=256), TensorType.F16, TensorType.F32,
                        1e-4),
    "llama_linear_f32": (dict(linear_scale=4.0), TensorType.F32, TensorType.F32, 1e-4),
    # YaRN as Qwen2.5 long-context configs use it (factor 4 over the original context), with
    # a small original context so the 48-token prompts reach interpolated frequencies.
    "qwen2_yarn_f32": (dict(arch="qwen2", theta=1e6, yarn_factor=4.0, yarn_orig_ctx=16,
                            rope_dim=16, ctx=256), TensorType.F32, TensorType.F32, 1e-4),
    # Last, so the models above keep their seeds. A sliding window shorter than the prompts
    # and not a whole number of 16-token blocks: position i attends to i - 12 .. i only.
    "phi3_swa_f32": (dict(arch="phi3", n_kv=4, sliding_window=13, general_name="fused-qkv",
                          ctx=256), TensorType.F32, TensorType.F32, 1e-4),
})
PROMPT_LENGTHS = {"long": 48, "short": 11}
GREEDY_PROMPT, GREEDY_STEPS = 6, 10


def tokenizer_metadata(w, vocab):
    """A complete (if toy) SentencePiece-style vocabulary so the file is a usable model."""
    tokens = ["<unk>", "<s>", "</s>"] + [chr(33 + i) for i in range(vocab - 3)]
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens, GgufType.STRING)
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0, 0.0] + [-float(i) for i in range(vocab - 3)],
                GgufType.FLOAT32)
    w.add_array("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (vocab - 3), GgufType.INT32)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)


def write_model(path, name, cfg, mtype, ntype, seed):
    rng = np.random.default_rng(seed)
    arch = cfg.get("arch", "llama")
    hd = cfg.get("key_length", cfg["dim"] // cfg["n_heads"])
    qw, kvw = cfg["n_heads"] * hd, cfg["n_kv"] * hd
    types = mtype if isinstance(mtype, dict) else {"default": mtype}

    def mtype_of(role):
        return types.get(role, types["default"])

    def mat(rows, cols, std):
        # std is for 64 inputs; wider rows are scaled down to keep each layer's gain, so the
        # 256-wide K-quant models are no more chaotic than the others.
        std *= np.sqrt(64.0 / cols)
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n=None):
        return (1.0 + 0.2 * rng.standard_normal(n or cfg["dim"])).astype(np.float32)

    def vec(n, std):
        return (rng.standard_normal(n) * std).astype(np.float32)

    k = arch + "."
    w = GgufWriter(path)
    w.add_string("general.architecture", arch)
    w.add_string("general.name", cfg.get("general_name", name))
    w.add_uint32(k + "context_length", cfg["ctx"])
    w.add_uint32(k + "embedding_length", cfg["dim"])
    w.add_uint32(k + "block_count", cfg["n_layers"])
    w.add_uint32(k + "feed_forward_length", cfg["ffn"])
    w.add_uint32(k + "attention.head_count", cfg["n_heads"])
    w.add_uint32(k + "attention.head_count_kv", cfg["n_kv"])
    if "sliding_window" in cfg:
        w.add_uint32(k + "attention.sliding_window", cfg["sliding_window"])
    if "key_length" in cfg:
        w.add_uint32(k + "attention.key_length", hd)
        w.add_uint32(k + "attention.value_length", hd)
    w.add_uint32(k + "rope.dimension_count", cfg["rope_dim"])
    w.add_float32(k + "rope.freq_base", cfg["theta"])
    if "linear_scale" in cfg:
        w.add_string(k + "rope.scaling.type", "linear")
        w.add_float32(k + "rope.scaling.factor", cfg["linear_scale"])
    if "yarn_factor" in cfg:
        w.add_string(k + "rope.scaling.type", "yarn")
        w.add_float32(k + "rope.scaling.factor", cfg["yarn_factor"])
        w.add_uint32(k + "rope.scaling.original_context_length", cfg["yarn_orig_ctx"])
    w.add_float32(k + "attention.layer_norm_rms_epsilon", cfg["eps"])
    w.add_uint32(k + "vocab_size", cfg["vocab"])
    tokenizer_metadata(w, cfg["vocab"])
    w.add_tensor("token_embd.weight", mat(cfg["vocab"], cfg["dim"], 0.5),
                 mtype_of("token_embd"))
    if cfg.get("rope_freqs"):
        # Llama 3.x-style divisors: 1 for the fast pairs, growing to 8 for the slow ones.
        w.add_tensor("rope_freqs.weight",
                     np.linspace(1.0, 8.0, cfg["rope_dim"] // 2).astype(np.float32),
                     TensorType.F32)
    for i in range(cfg["n_layers"]):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", norm(), ntype)
        if arch == "phi3":
            qkv = np.concatenate([mat(qw, cfg["dim"], 0.2), mat(kvw, cfg["dim"], 0.2),
                                  mat(kvw, cfg["dim"], 0.15)])
            w.add_tensor(p + "attn_qkv.weight", qkv, mtype_of("attn_qkv"))
        else:
            w.add_tensor(p + "attn_q.weight", mat(qw, cfg["dim"], 0.2), mtype_of("attn_q"))
            w.add_tensor(p + "attn_k.weight", mat(kvw, cfg["dim"], 0.2), mtype_of("attn_k"))
            w.add_tensor(p + "attn_v.weight", mat(kvw, cfg["dim"], 0.15), mtype_of("attn_v"))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", vec(qw, 0.3), TensorType.F32)
            w.add_tensor(p + "attn_k.bias", vec(kvw, 0.3), TensorType.F32)
            w.add_tensor(p + "attn_v.bias", vec(kvw, 0.1), TensorType.F32)
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd), TensorType.F32)
            w.add_tensor(p + "attn_k_norm.weight", norm(hd), TensorType.F32)
        w.add_tensor(p + "attn_output.weight", mat(cfg["dim"], qw, 0.1),
                     mtype_of("attn_output"))
        w.add_tensor(p + "ffn_norm.weight", norm(), ntype)
        if arch == "phi3":
            gate_up = np.concatenate([mat(cfg["ffn"], cfg["dim"], 0.15),
                                      mat(cfg["ffn"], cfg["dim"], 0.15)])
            w.add_tensor(p + "ffn_up.weight", gate_up, mtype_of("ffn_up"))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(cfg["ffn"], cfg["dim"], 0.15),
                         mtype_of("ffn_gate"))
            w.add_tensor(p + "ffn_up.weight", mat(cfg["ffn"], cfg["dim"], 0.15),
                         mtype_of("ffn_up"))
        w.add_tensor(p + "ffn_down.weight", mat(cfg["dim"], cfg["ffn"], 0.1), mtype_of("ffn_down"))
    w.add_tensor("output_norm.weight", norm(), ntype)
    if not cfg["tied"]:
        w.add_tensor("output.weight", mat(cfg["vocab"], cfg["dim"], 0.3), mtype_of("output"))
    w.write()


def greedy(model, prompt, steps):
    tokens, margin = list(prompt), np.inf
    for _ in range(steps):
        last = model.forward(tokens)[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(last)))
    return tokens[len(prompt):], margin


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = ["# written by tests/reference/make_reference.py"]
    for seed, (name, (overrides, mtype, ntype, tol)) in enumerate(MODELS.items()):
        cfg = dict(BASE, **overrides)
        gguf = name + ".gguf"
        write_model(os.path.join(args.out, gguf), name, cfg, mtype, ntype, seed=1000 + seed)
        model = LlamaNumpy(os.path.join(args.out, gguf))  # weights as stored, rounding included
        rng = np.random.default_rng(seed)
        wtype = "mixed" if isinstance(mtype, dict) else mtype.name
        common = "model=%s gguf=%s wtype=%s" % (name, gguf, wtype)
        for case, n in PROMPT_LENGTHS.items():
            tokens = rng.integers(0, cfg["vocab"], n)
            logits = model.forward(tokens)
            assert np.all(np.isfinite(logits)) and logits.std() > 0.1, (name, logits.std())
            out = "%s.%s.f64" % (name, case)
            logits.astype("<f8").tofile(os.path.join(args.out, out))
            lines.append("case %s name=%s tol=%g tokens=%s logits=%s" % (
                common, case, tol, ",".join(str(int(t)) for t in tokens), out))
        prompt = [int(t) for t in rng.integers(0, cfg["vocab"], GREEDY_PROMPT)]
        generated, margin = greedy(model, prompt, GREEDY_STEPS)
        lines.append("greedy %s prompt=%s generated=%s min_margin=%g" % (
            common, ",".join(map(str, prompt)), ",".join(map(str, generated)), margin))
    with open(os.path.join(args.out, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d models to %s" % (len(MODELS), args.out))


if __name__ == "__main__":
    main()
