"""Independent float64 NumPy Llama forward pass, the oracle for the C++ model's logits.

Reads the GGUF with its own small parser (it shares no code with core/ nor tools/gguf_writer.py,
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


def _decode(raw, ggml_type, count):
    """Tensor bytes -> float64 values (F32, F16, BF16, Q8_0)."""
    if ggml_type == 0:
        return np.frombuffer(raw, "<f4", count).astype(np.float64)
    if ggml_type == 1:
        return np.frombuffer(raw, "<f2", count).astype(np.float64)
    if ggml_type == 30:
        bits = np.frombuffer(raw, "<u2", count).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if ggml_type == 8:  # blocks of 32: f16 scale + 32 int8
        blocks = np.frombuffer(raw, np.dtype([("d", "<f2"), ("q", "i1", (32,))]), count // 32)
        return (blocks["q"].astype(np.float64) * blocks["d"].astype(np.float64)[:, None]).ravel()
    raise ValueError("unsupported ggml type %d" % ggml_type)


def _quantize_q8_0_rows(x):
    """x [n, k] -> the values llama.cpp's CPU matmul multiplies quantized weights with: each
    block of 32 activations scaled by d = max|x| / 127 (fp32, stored as fp16), rounded half away
    from zero to int8, and read back as q * fp16(d). Arithmetic in fp32, as the engine does."""
    n, k = x.shape
    blocks = x.astype(np.float32).reshape(n, k // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
    scaled = (blocks * inv).astype(np.float32)
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return (q.astype(np.float64) * d.astype(np.float16).astype(np.float64)).reshape(n, k)


class _Matrix:
    """A weight matrix [rows, cols] in float64 and how the engine multiplies it: quantized
    weights (Q8_0) take activations quantized to q8_0 per row, as in llama.cpp."""

    __array_ufunc__ = None  # so that `x @ matrix` calls __rmatmul__

    def __init__(self, values, ggml_type):
        self.values, self.quantized = values, ggml_type == 8

    def __rmatmul__(self, x):
        if self.quantized:
            x = _quantize_q8_0_rows(x)
        return x @ self.values.T


def _nbytes(ggml_type, count):
    return {0: 4 * count, 1: 2 * count, 30: 2 * count, 8: count // 32 * 34}[ggml_type]


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
    """The model as float64 arrays; forward(tokens) -> logits [n, n_vocab]."""

    def __init__(self, path):
        meta, t, types = read_gguf(path)
        if meta["general.architecture"] != "llama":
            raise ValueError("not a llama model")
        self.dim = int(meta["llama.embedding_length"])
        self.n_layers = int(meta["llama.block_count"])
        self.n_heads = int(meta["llama.attention.head_count"])
        self.n_kv = int(meta.get("llama.attention.head_count_kv", self.n_heads))
        self.head_dim = self.dim // self.n_heads
        self.rope_dim = int(meta.get("llama.rope.dimension_count", self.head_dim))
        self.theta = float(meta.get("llama.rope.freq_base", 10000.0))
        self.eps = float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.embd = t["token_embd.weight"]                     # [vocab, dim]
        out_name = "output.weight" if "output.weight" in t else "token_embd.weight"  # tied
        self.output = _Matrix(t[out_name], types[out_name])    # [vocab, dim]
        self.output_norm = t["output_norm.weight"]
        self.layers = []
        for i in range(self.n_layers):
            p = "blk.%d." % i
            layer = {k: t[p + k + ".weight"] for k in ("attn_norm", "ffn_norm")}
            for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                      "ffn_down"):
                layer[k] = _Matrix(t[p + k + ".weight"], types[p + k + ".weight"])
            self.layers.append(layer)

    def _rms_norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, positions):
        """x: [n, heads, head_dim]; rotates adjacent pairs (2i, 2i+1) of the first rope_dim."""
        half = self.rope_dim // 2
        inv_freq = self.theta ** (-2.0 * np.arange(half) / self.rope_dim)   # [half]
        ang = positions[:, None].astype(np.float64) * inv_freq[None, :]     # [n, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        x0, x1 = x[..., 0:self.rope_dim:2], x[..., 1:self.rope_dim:2]
        out[..., 0:self.rope_dim:2] = x0 * cos - x1 * sin
        out[..., 1:self.rope_dim:2] = x0 * sin + x1 * cos
        return out

    def forward(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        pos = np.arange(n)
        hd, group = self.head_dim, self.n_heads // self.n_kv
        causal = np.tril(np.ones((n, n), dtype=bool))
        x = self.embd[tokens]                                               # [n, dim]
        for L in self.layers:
            h = self._rms_norm(x, L["attn_norm"])
            q = self._rope((h @ L["attn_q"]).reshape(n, self.n_heads, hd), pos)
            k = self._rope((h @ L["attn_k"]).reshape(n, self.n_kv, hd), pos)
            v = (h @ L["attn_v"]).reshape(n, self.n_kv, hd)
            attn = np.empty((n, self.n_heads, hd))
            for head in range(self.n_heads):
                kv = head // group
                s = q[:, head, :] @ k[:, kv, :].T / np.sqrt(hd)             # [n, n]
                s = np.where(causal, s, -np.inf)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                attn[:, head, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv, :]
            x = x + attn.reshape(n, self.dim) @ L["attn_output"]
            h = self._rms_norm(x, L["ffn_norm"])
            gate, up = h @ L["ffn_gate"], h @ L["ffn_up"]
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["ffn_down"]
        return self._rms_norm(x, self.output_norm) @ self.output           # [n, vocab]
