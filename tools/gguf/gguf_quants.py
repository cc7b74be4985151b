"""Quantizers for the GGUF block types, for writing test and benchmark models with our own GGUF
writer (tools/gguf/gguf_writer.py): q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl.

The byte layouts are ggml's (ggml-common.h); the choice of scales is plain round-to-nearest on
each block's range, simpler than llama-quantize's error-minimising search, so files written here
are valid and decode everywhere but are not bit-identical to llama.cpp's, and their error is a
little larger. For llama.cpp's own quantization use tools/ggml_ref/quantize_gguf.c.

Each quantize_<type>(a) takes a float array whose last dimension is a multiple of the block
size and returns the bytes of all its rows.
"""
import numpy as np

QK = 32     # legacy blocks and iq4_nl
QK_K = 256  # K-quant super-blocks

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                          1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _blocks(a, size):
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape[-1] % size:
        raise ValueError("the last dim must be a multiple of %d, got %d" % (size, a.shape[-1]))
    return a.reshape(-1, size)


def _round(x):
    """Round half away from zero (C's roundf)."""
    return np.trunc(x + 0.5 * np.sign(x))


def _safe_inverse(d):
    return np.where(d != 0, 1.0 / np.where(d != 0, d, 1.0), 0.0).astype(np.float32)


def _signed_extreme(blocks):
    """Per row of `blocks`, the value of largest magnitude (with its sign)."""
    idx = np.abs(blocks).argmax(axis=-1)
    return np.take_along_axis(blocks, idx[..., None], axis=-1)[..., 0]


def _pack_nibbles(q):
    """q [n, 32] codes 0..15 -> [n, 16] bytes: value j in the low nibble of byte j % 16 for
    j < 16, in the high nibble for j >= 16."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_bits32(bits):
    """bits [n, 32] of 0/1 -> [n] uint32 with value j in bit j."""
    return (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)


def quantize_q4_0(a):
    b = _blocks(a, QK)
    d = (_signed_extreme(b) / -8.0).astype(np.float32)
    q = np.clip(_round(b * _safe_inverse(d)[:, None]) + 8, 0, 15)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("qs", "u1", (16,))])
    rec["d"], rec["qs"] = d, _pack_nibbles(q)
    return rec.tobytes()


def _min_max_codes(b, levels):
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = ((hi - lo) / levels).astype(np.float32)
    q = np.clip(_round((b - lo[:, None]) * _safe_inverse(d)[:, None]), 0, levels)
    return d, lo, q


def quantize_q4_1(a):
    b = _blocks(a, QK)
    d, m, q = _min_max_codes(b, 15)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
    rec["d"], rec["m"], rec["qs"] = d, m, _pack_nibbles(q)
    return rec.tobytes()


def quantize_q5_0(a):
    b = _blocks(a, QK)
    d = (_signed_extreme(b) / -16.0).astype(np.float32)
    q = np.clip(_round(b * _safe_inverse(d)[:, None]) + 16, 0, 31).astype(np.uint8)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))])
    rec["d"], rec["qh"], rec["qs"] = d, _pack_bits32(q >> 4), _pack_nibbles(q & 15)
    return rec.tobytes()


def quantize_q5_1(a):
    b = _blocks(a, QK)
    d, m, q = _min_max_codes(b, 31)
    q = q.astype(np.uint8)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))])
    rec["d"], rec["m"], rec["qh"], rec["qs"] = d, m, _pack_bits32(q >> 4), _pack_nibbles(q & 15)
    return rec.tobytes()


def quantize_iq4_nl(a):
    b = _blocks(a, QK)
    d = (_signed_extreme(b) / -127.0).astype(np.float32)
    scaled = b * _safe_inverse(d)[:, None]
    q = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(axis=-1)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("qs", "u1", (16,))])
    rec["d"], rec["qs"] = d, _pack_nibbles(q)
    return rec.tobytes()


def _sub_blocks_min_scale(b, sub, levels, scale_levels):
    """K-quants with mins: per sub-block, min (<= 0) and scale, both quantized to
    `scale_levels` steps of super-block scales dmin and d. Returns d, dmin, sc, mn, q."""
    s = b.reshape(len(b), -1, sub)
    lo = np.minimum(s.min(axis=2), 0.0)
    scale = (s.max(axis=2) - lo) / levels
    d = (scale.max(axis=1) / scale_levels).astype(np.float32)
    dmin = ((-lo).max(axis=1) / scale_levels).astype(np.float32)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _safe_inverse(d16)[:, None]), 0, scale_levels)
    mn = np.clip(_round(-lo * _safe_inverse(dmin16)[:, None]), 0, scale_levels)
    step = (d16[:, None] * sc)[..., None]
    offset = (dmin16[:, None] * mn)[..., None]
    q = np.clip(_round((s + offset) * _safe_inverse(step)), 0, levels)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.reshape(len(b), -1).astype(np.uint8)


def _sub_blocks_signed(b, sub, lowest, scale_max):
    """K-quants without mins: per sub-block, a signed scale mapping the extreme to `lowest`,
    quantized to a signed integer of magnitude <= scale_max times the super-block scale d."""
    s = b.reshape(len(b), -1, sub)
    scale = _signed_extreme(s) / lowest
    d = (np.abs(scale).max(axis=1) / scale_max).astype(np.float32)
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale * _safe_inverse(d16)[:, None]), -scale_max - 1, scale_max)
    step = (d16[:, None] * sc)[..., None]
    q = np.clip(_round(s * _safe_inverse(step)), lowest, -lowest - 1)
    return d, sc.astype(np.int8), q.reshape(len(b), -1).astype(np.int8)


def _two_bit_planes(q):
    """q [n, 256] codes 0..3 -> [n, 64] bytes: value 128 h + 32 j + l in bits 2j of byte
    32 h + l."""
    q = q.reshape(len(q), 2, 4, 32).astype(np.uint8)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(len(q), 64)


def quantize_q2_K(a):
    b = _blocks(a, QK_K)
    d, dmin, sc, mn, q = _sub_blocks_min_scale(b, 16, 3, 15)
    rec = np.zeros(len(b), dtype=[("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"),
                                  ("dmin", "<f2")])
    rec["scales"], rec["qs"], rec["d"], rec["dmin"] = sc | (mn << 4), _two_bit_planes(q), d, dmin
    return rec.tobytes()


def _pack_q3_scales(sc):
    """sc [n, 16] in -32..31 -> [n, 12] bytes (the inverse of the q3_K scale unpacking)."""
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    out = np.zeros((len(u), 12), dtype=np.uint8)
    out[:, :8] = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
    for i in range(16):
        out[:, 8 + i % 4] |= (u[:, i] >> 4) << (2 * (i // 4))
    return out


def quantize_q3_K(a):
    b = _blocks(a, QK_K)
    d, sc, q = _sub_blocks_signed(b, 16, -4, 31)
    code = (q.astype(np.int16) + 4).astype(np.uint8)  # 0..7
    high = (code >> 2).reshape(len(b), 2, 4, 32)  # value 128 h + 32 j + l -> bit 4 h + j of l
    hmask = (high << (np.arange(8, dtype=np.uint8).reshape(2, 4)[None, :, :, None])).sum(
        axis=(1, 2), dtype=np.uint8)
    rec = np.zeros(len(b), dtype=[("hmask", "u1", (32,)), ("qs", "u1", (64,)),
                                  ("scales", "u1", (12,)), ("d", "<f2")])
    rec["hmask"], rec["qs"] = hmask, _two_bit_planes(code & 3)
    rec["scales"], rec["d"] = _pack_q3_scales(sc), d
    return rec.tobytes()


def _pack_k4_scales(sc, mn):
    """6-bit scales and mins of 8 sub-blocks -> 12 bytes (inverse of get_scale_min_k4)."""
    out = np.zeros((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _k4_nibbles(q):
    """q [n, 256] codes 0..15 -> [n, 128]: sub-block s in the low (s even) or high nibble of
    bytes 32 (s / 2) .. + 31."""
    q = q.reshape(len(q), 4, 2, 32) & 15
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(len(q), 128)


def quantize_q4_K(a):
    b = _blocks(a, QK_K)
    d, dmin, sc, mn, q = _sub_blocks_min_scale(b, 32, 15, 63)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                                  ("qs", "u1", (128,))])
    rec["d"], rec["dmin"], rec["scales"], rec["qs"] = d, dmin, _pack_k4_scales(sc, mn), _k4_nibbles(q)
    return rec.tobytes()


def quantize_q5_K(a):
    b = _blocks(a, QK_K)
    d, dmin, sc, mn, q = _sub_blocks_min_scale(b, 32, 31, 63)
    high = (q >> 4).reshape(len(b), 8, 32)  # sub-block s -> bit s of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                                  ("qh", "u1", (32,)), ("qs", "u1", (128,))])
    rec["d"], rec["dmin"], rec["scales"] = d, dmin, _pack_k4_scales(sc, mn)
    rec["qh"], rec["qs"] = qh, _k4_nibbles(q)
    return rec.tobytes()


def quantize_q6_K(a):
    b = _blocks(a, QK_K)
    d, sc, q = _sub_blocks_signed(b, 16, -32, 127)
    code = (q.astype(np.int16) + 32).astype(np.uint8).reshape(len(b), 2, 4, 32)  # h, k, l
    low, high = code & 15, code >> 4
    ql = np.zeros((len(b), 2, 2, 32), dtype=np.uint8)  # h, k % 2, l
    ql[:, :, 0, :] = low[:, :, 0, :] | (low[:, :, 2, :] << 4)
    ql[:, :, 1, :] = low[:, :, 1, :] | (low[:, :, 3, :] << 4)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2,
                                                                               dtype=np.uint8)
    rec = np.zeros(len(b), dtype=[("ql", "u1", (128,)), ("qh", "u1", (64,)),
                                  ("scales", "i1", (16,)), ("d", "<f2")])
    rec["ql"], rec["qh"] = ql.reshape(len(b), 128), qh.reshape(len(b), 64)
    rec["scales"], rec["d"] = sc, d
    return rec.tobytes()


QUANTIZERS = {2: quantize_q4_0, 3: quantize_q4_1, 6: quantize_q5_0, 7: quantize_q5_1,
              10: quantize_q2_K, 11: quantize_q3_K, 12: quantize_q4_K, 13: quantize_q5_K,
              14: quantize_q6_K, 20: quantize_iq4_nl}
# ggml type id -> (values per block, bytes per block)
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84),
          11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 20: (32, 18)}
