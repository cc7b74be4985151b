"""Independent float64 NumPy Llama forward pass, the oracle for the C++ model's logits.

Reads the GGUF with its own small parser (it shares no code with core/ nor tools/gguf/gguf_writer.py,
so a bug in either writer or engine cannot hide behind the same bug here) and runs a plain,
uncached, causal forward over a whole token sequence.
"""
import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self):
        n = self.take("<Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            return [self.value(etype) for _ in range(n)]
        return self.take(_SCALARS[vtype])


_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                  dtype=np.float64)
# ggml type id -> (values per block, bytes per block) of the block types.
_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84),
           11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 20: (32, 18)}


def _f16(u8, lo):
    """fp16 at byte offset lo of each row of u8 [n, block bytes] -> float64 [n, 1]."""
    return u8[:, lo:lo + 2].copy().view("<f2").astype(np.float64)


def _legacy_codes(u8, ggml_type):
    """Blocks of 32 -> (codes [n, 32] as float64, d [n, 1], m [n, 1] or 0)."""
    j = np.arange(32)
    if ggml_type == 8:
        return u8[:, 2:34].view(np.int8).astype(np.float64), _f16(u8, 0), 0.0
    qs_at = {2: 2, 3: 4, 6: 6, 7: 8, 20: 2}[ggml_type]
    qs = u8[:, qs_at:qs_at + 16]
    nib = np.where(j < 16, qs[:, j % 16] & 15, qs[:, j % 16] >> 4).astype(np.int64)
    if ggml_type == 20:
        return _IQ4NL[nib], _f16(u8, 0), 0.0
    if ggml_type in (6, 7):
        qh_at = 2 if ggml_type == 6 else 4
        qh = u8[:, qh_at:qh_at + 4].copy().view("<u4").astype(np.int64)  # [n, 1]
        nib = nib | (((qh >> j) & 1) << 4)
    if ggml_type == 2:
        return nib - 8.0, _f16(u8, 0), 0.0
    if ggml_type == 6:
        return nib - 16.0, _f16(u8, 0), 0.0
    return nib.astype(np.float64), _f16(u8, 0), _f16(u8, 2)   # q4_1, q5_1: d q + m


def _k_values(u8, ggml_type):
    """K-quant super-blocks [n, bytes] -> values [n, 256], from the formulas of ggml-common.h."""
    v = np.arange(256)
    half, j, l = v // 128, (v % 128) // 32, v % 32       # 2-bit / 6-bit layouts
    s32, l32 = v // 32, v % 32                           # 4-bit / 5-bit layouts
    if ggml_type == 10:    # q2_K: scales[16] qs[64] d dmin
        sc = u8[:, 0:16][:, v // 16].astype(np.float64)
        q = (u8[:, 16:80][:, 32 * half + l] >> (2 * j)) & 3
        return _f16(u8, 80) * (sc % 16) * q - _f16(u8, 82) * (sc // 16)
    if ggml_type == 11:    # q3_K: hmask[32] qs[64] scales[12] d
        packed = u8[:, 96:108].astype(np.int64)
        i = np.arange(16)
        low = np.where(i < 8, packed[:, i % 8] & 15, packed[:, i % 8] >> 4)
        high = (packed[:, 8 + i % 4] >> (2 * (i // 4))) & 3
        sc = ((low | (high << 4)) - 32)[:, v // 16]
        low2 = (u8[:, 32:96][:, 32 * half + l] >> (2 * j)) & 3
        hbit = (u8[:, 0:32][:, l] >> (4 * half + j)) & 1
        return _f16(u8, 108) * sc * (low2.astype(np.int64) - 4 * (1 - hbit))
    if ggml_type in (12, 13):    # q4_K / q5_K: d dmin scales[12] (qh[32]) qs[128]
        p = u8[:, 4:16].astype(np.int64)
        k = np.arange(8)
        sc = np.where(k < 4, p[:, k % 4] & 63, (p[:, 8 + k % 4] & 15) | ((p[:, k % 4] >> 6) << 4))
        mn = np.where(k < 4, p[:, 4 + k % 4] & 63,
                      (p[:, 8 + k % 4] >> 4) | ((p[:, 4 + k % 4] >> 6) << 4))
        qs_at = 16 if ggml_type == 12 else 48
        byte = u8[:, qs_at:qs_at + 128][:, 32 * (s32 // 2) + l32].astype(np.int64)
        q = np.where(s32 % 2 == 0, byte & 15, byte >> 4)
        if ggml_type == 13:
            q = q | (((u8[:, 16:48][:, l32] >> s32) & 1) << 4)
        return _f16(u8, 0) * sc[:, s32] * q - _f16(u8, 2) * mn[:, s32]
    if ggml_type == 14:    # q6_K: ql[128] qh[64] scales[16] (int8) d
        lo = u8[:, 0:128][:, 64 * half + 32 * (j % 2) + l].astype(np.int64)
        low4 = np.where(j < 2, lo & 15, lo >> 4)
        high2 = (u8[:, 128:192][:, 32 * half + l] >> (2 * j)) & 3
        sc = u8[:, 192:208].view(np.int8).astype(np.float64)[:, v // 16]
        return _f16(u8, 208) * sc * ((low4 | (high2 << 4)) - 32)
    raise ValueError("not a K-quant type %d" % ggml_type)


def _decode(raw, ggml_type, count):
    """Tensor bytes -> float64 values (F32, F16, BF16 and the block types q4_0 .. iq4_nl)."""
    if ggml_type == 0:
        return np.frombuffer(raw, "<f4", count).astype(np.float64)
    if ggml_type == 1:
        return np.frombuffer(raw, "<f2", count).astype(np.float64)
    if ggml_type == 30:
        bits = np.frombuffer(raw, "<u2", count).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if ggml_type in _BLOCKS:
        values, nbytes = _BLOCKS[ggml_type]
        u8 = np.frombuffer(raw, np.uint8, count // values * nbytes).reshape(-1, nbytes)
        if values == 256:
            return _k_values(u8, ggml_type).ravel()
        codes, d, m = _legacy_codes(u8, ggml_type)
        return (codes * d + m).ravel()
    raise ValueError("unsupported ggml type %d" % ggml_type)


def _nbytes(ggml_type, count):
    if ggml_type in _BLOCKS:
        values, nbytes = _BLOCKS[ggml_type]
        return count // values * nbytes
    return {0: 4 * count, 1: 2 * count, 30: 2 * count}[ggml_type]


def _quantize_q8_0_rows(x):
    """x [n, k] -> the values llama.cpp's CPU matmul multiplies q4_0 / q5_0 / q8_0 / iq4_nl
    weights with: each block of 32 activations scaled by d = max|x| / 127 (fp32, stored as
    fp16), rounded half away from zero to int8, and read back as q * fp16(d). q4_1 / q5_1 take
    the same codes (q8_1). Arithmetic in fp32, as the engine does."""
    n, k = x.shape
    blocks = x.astype(np.float32).reshape(n, k // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
    scaled = (blocks * inv).astype(np.float32)
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return (q.astype(np.float64) * d.astype(np.float16).astype(np.float64)).reshape(n, k)


def _quantize_q8_K_rows(x):
    """x [n, k] -> what the K-quants are multiplied with: blocks of 256 scaled so that the
    value of largest magnitude (first one if tied) maps to -127, codes rounded half to even and
    capped at 127, read back as q * d with d = 1 / scale in fp32."""
    n, k = x.shape
    blocks = x.astype(np.float32).reshape(n, k // 256, 256)
    idx = np.abs(blocks).argmax(axis=2)[..., None]
    extreme = np.take_along_axis(blocks, idx, axis=2)
    nonzero = extreme != 0
    iscale = np.where(nonzero, np.float32(-127.0) / np.where(nonzero, extreme, 1),
                      0).astype(np.float32)
    q = np.minimum(np.rint((iscale * blocks).astype(np.float32)), 127)
    d = np.where(nonzero, np.float32(1.0) / np.where(nonzero, iscale, 1), 0).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)


_ACTIVATIONS = {2: _quantize_q8_0_rows, 3: _quantize_q8_0_rows, 6: _quantize_q8_0_rows,
                7: _quantize_q8_0_rows, 8: _quantize_q8_0_rows, 20: _quantize_q8_0_rows,
                10: _quantize_q8_K_rows, 11: _quantize_q8_K_rows, 12: _quantize_q8_K_rows,
                13: _quantize_q8_K_rows, 14: _quantize_q8_K_rows}


class _Matrix:
    """A weight matrix [rows, cols] in float64 and how the engine multiplies it: quantized
    weights take activations quantized per row to their dot-product partner (q8_0 / q8_1 /
    q8_K), as in llama.cpp."""

    __array_ufunc__ = None  # so that `x @ matrix` calls __rmatmul__

    def __init__(self, values, ggml_type):
        self.values, self.activations = values, _ACTIVATIONS.get(ggml_type)

    def __rmatmul__(self, x):
        if self.activations is not None:
            x = self.activations(x)
        return x @ self.values.T


def read_gguf(path):
    """Returns (metadata dict, {name: float64 array in NumPy order, i.e. reversed GGUF dims})."""
    with open(path, "rb") as f:
        buf = f.read()
    cur = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError("%s: not GGUF" % path)
    cur.pos = 4
    _, n_tensors, n_kv = cur.take("<IQQ")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        ggml_type, offset = cur.take("<I"), cur.take("<Q")
        infos.append((name, dims, ggml_type, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors, types = {}, {}
    for name, dims, ggml_type, offset in infos:
        types[name] = ggml_type
        count = int(np.prod(dims))
        start = data_start + offset
        raw = buf[start:start + _nbytes(ggml_type, count)]
        tensors[name] = _decode(raw, ggml_type, count).reshape(tuple(reversed(dims)))
    return meta, tensors, types


class LlamaNumpy:
    """The model as float64 arrays; forward(tokens) -> logits [n, n_vocab].

    Architectures: "llama" (RoPE on adjacent pairs, the GGUF converter's permuted Q/K; Llama 3
    frequency factors, linear scaling), "qwen2" (Q/K/V biases), "qwen3" (per-head Q/K RMSNorm,
    key_length heads), "phi3" (fused attn_qkv and ffn_up = [gate | up]); all but llama rotate
    halves (x[i], x[i + rope_dim/2]).
    """

    def __init__(self, path):
        meta, t, types = read_gguf(path)
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2", "qwen3", "phi3"):
            raise ValueError("unsupported architecture %s" % arch)
        k = arch + "."
        self.dim = int(meta[k + "embedding_length"])
        self.n_layers = int(meta[k + "block_count"])
        self.n_heads = int(meta[k + "attention.head_count"])
        self.n_kv = int(meta.get(k + "attention.head_count_kv", self.n_heads))
        self.head_dim = int(meta.get(k + "attention.key_length", self.dim // self.n_heads))
        self.rope_dim = int(meta.get(k + "rope.dimension_count", self.head_dim))
        self.theta = float(meta.get(k + "rope.freq_base", 10000.0))
        self.eps = float(meta.get(k + "attention.layer_norm_rms_epsilon", 1e-5))
        self.halves = arch != "llama"
        self.freq_scale = 1.0
        self.yarn_orig_ctx = None
        scaling = meta.get(k + "rope.scaling.type")
        if scaling in ("linear", "yarn"):
            self.freq_scale = 1.0 / float(meta[k + "rope.scaling.factor"])
        if scaling == "yarn":
            self.yarn_orig_ctx = int(meta.get(k + "rope.scaling.original_context_length",
                                              meta[k + "context_length"]))
        self.attn_factor = float(meta.get(k + "rope.scaling.attn_factor", 1.0))
        # Sliding-window attention: position i sees positions j with i - j < window (llama.cpp's
        # "standard" SWA, Mistral's and Phi-3's); 0 = none.
        self.window = int(meta.get(k + "attention.sliding_window", 0))
        self.freq_factors = t.get("rope_freqs.weight")                  # [rope_dim / 2] or None
        self.embd = t["token_embd.weight"]                     # [vocab, dim]
        out_name = "output.weight" if "output.weight" in t else "token_embd.weight"  # tied
        self.output = _Matrix(t[out_name], types[out_name])    # [vocab, dim]
        self.output_norm = t["output_norm.weight"]
        self.layers = []
        for i in range(self.n_layers):
            p = "blk.%d." % i
            layer = {k2: t[p + k2 + ".weight"] for k2 in ("attn_norm", "ffn_norm")}
            names = ["attn_output", "ffn_down"]
            names += ["attn_qkv"] if p + "attn_qkv.weight" in t else ["attn_q", "attn_k", "attn_v"]
            names += ["ffn_gate", "ffn_up"] if p + "ffn_gate.weight" in t else ["ffn_gate_up"]
            for k2 in names:
                tensor = "ffn_up" if k2 == "ffn_gate_up" else k2
                layer[k2] = _Matrix(t[p + tensor + ".weight"], types[p + tensor + ".weight"])
            for k2 in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight",
                       "attn_k_norm.weight"):
                layer[k2] = t.get(p + k2)
            self.layers.append(layer)

    def _rms_norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, positions):
        """x: [n, heads, head_dim]; rotates pairs of the first rope_dim dims by pos * freq."""
        half = self.rope_dim // 2
        scale = np.full(half, self.freq_scale)
        mscale = self.attn_factor
        if self.yarn_orig_ctx is not None:
            # YaRN (Peng et al. 2023): pairs turning more than beta_fast = 32 times over the
            # original context keep their frequency, those turning fewer than beta_slow = 1
            # times are interpolated, a linear ramp between; cos/sin grow by 1 + 0.1 ln(factor).
            def corr_dim(rotations):
                return (self.rope_dim * np.log(self.yarn_orig_ctx / (rotations * 2 * np.pi)) /
                        (2 * np.log(self.theta)))
            low = max(0.0, np.floor(corr_dim(32.0)))
            high = min(self.rope_dim - 1.0, np.ceil(corr_dim(1.0)))
            ramp = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)
            scale = self.freq_scale * (1.0 - ramp) + ramp
            mscale *= 1.0 + 0.1 * np.log(1.0 / self.freq_scale)
        inv_freq = scale * self.theta ** (-2.0 * np.arange(half) / self.rope_dim)
        if self.freq_factors is not None:
            inv_freq = inv_freq / self.freq_factors
        ang = positions[:, None].astype(np.float64) * inv_freq[None, :]     # [n, half]
        cos = np.cos(ang)[:, None, :] * mscale
        sin = np.sin(ang)[:, None, :] * mscale
        out = x.copy()
        if self.halves:
            a, b = slice(0, half), slice(half, self.rope_dim)
        else:
            a, b = slice(0, self.rope_dim, 2), slice(1, self.rope_dim, 2)
        x0, x1 = x[..., a], x[..., b]
        out[..., a] = x0 * cos - x1 * sin
        out[..., b] = x0 * sin + x1 * cos
        return out

    def forward(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        pos = np.arange(n)
        hd, group = self.head_dim, self.n_heads // self.n_kv
        qw, kvw = self.n_heads * hd, self.n_kv * hd
        causal = np.tril(np.ones((n, n), dtype=bool))
        if self.window > 0:
            causal &= (pos[:, None] - pos[None, :]) < self.window
        x = self.embd[tokens]                                               # [n, dim]
        for L in self.layers:
            h = self._rms_norm(x, L["attn_norm"])
            if "attn_qkv" in L:
                qkv = h @ L["attn_qkv"]
                q, k, v = qkv[:, :qw], qkv[:, qw:qw + kvw], qkv[:, qw + kvw:]
            else:
                q, k, v = h @ L["attn_q"], h @ L["attn_k"], h @ L["attn_v"]
            if L["attn_q.bias"] is not None:
                q, k, v = q + L["attn_q.bias"], k + L["attn_k.bias"], v + L["attn_v.bias"]
            q, k = q.reshape(n, self.n_heads, hd), k.reshape(n, self.n_kv, hd)
            if L["attn_q_norm.weight"] is not None:
                q = self._rms_norm(q, L["attn_q_norm.weight"])
                k = self._rms_norm(k, L["attn_k_norm.weight"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            v = v.reshape(n, self.n_kv, hd)
            attn = np.empty((n, self.n_heads, hd))
            for head in range(self.n_heads):
                kv = head // group
                s = q[:, head, :] @ k[:, kv, :].T / np.sqrt(hd)             # [n, n]
                s = np.where(causal, s, -np.inf)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                attn[:, head, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv, :]
            x = x + attn.reshape(n, qw) @ L["attn_output"]
            h = self._rms_norm(x, L["ffn_norm"])
            if "ffn_gate_up" in L:
                gate_up = h @ L["ffn_gate_up"]
                half = gate_up.shape[1] // 2
                gate, up = gate_up[:, :half], gate_up[:, half:]
            else:
                gate, up = h @ L["ffn_gate"], h @ L["ffn_up"]
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["ffn_down"]
        return self._rms_norm(x, self.output_norm) @ self.output           # [n, vocab]
