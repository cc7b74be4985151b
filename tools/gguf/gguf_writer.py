"""Minimal GGUF (version 3) writer and reader, written from the GGUF spec (no `gguf` package).

Used by the model recipe (tools/train/export_gguf.py) and by the test suite's NumPy reference to
write small random models. Typical use:

    from gguf_writer import GgufWriter, GgufType, TensorType
    w = GgufWriter("model.gguf")
    w.add_string("general.architecture", "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["<unk>", "<s>"], GgufType.STRING)
    w.add_tensor("token_embd.weight", emb, TensorType.F16)  # emb: np.ndarray [vocab, dim]
    w.write()

Shapes: a NumPy array of shape (a, b) is stored row-major and described with GGUF dims
ne0 = b (fastest varying), ne1 = a, i.e. dims are the reversed NumPy shape. A torch Linear weight
[out, in] therefore becomes ne0 = in, ne1 = out with identical bytes.
File layout: "GGUF", u32 version, u64 tensor_count, u64 kv_count, kv pairs, tensor infos,
padding to `general.alignment` (default 32), tensor data with every tensor aligned likewise.
Everything is little-endian.
"""
import enum
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_quants  # noqa: E402

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32


class GgufType(enum.IntEnum):
    """Metadata value types."""
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class TensorType(enum.IntEnum):
    """Tensor data types (ggml_type ids). Only these are written by this module (the block
    types through gguf_quants.py)."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    BF16 = 30


_SCALAR_FMT = {
    GgufType.UINT8: "<B", GgufType.INT8: "<b", GgufType.UINT16: "<H", GgufType.INT16: "<h",
    GgufType.UINT32: "<I", GgufType.INT32: "<i", GgufType.FLOAT32: "<f", GgufType.BOOL: "<?",
    GgufType.UINT64: "<Q", GgufType.INT64: "<q", GgufType.FLOAT64: "<d",
}
_NP_DTYPE = {
    GgufType.UINT8: "<u1", GgufType.INT8: "<i1", GgufType.UINT16: "<u2", GgufType.INT16: "<i2",
    GgufType.UINT32: "<u4", GgufType.INT32: "<i4", GgufType.FLOAT32: "<f4", GgufType.BOOL: "<u1",
    GgufType.UINT64: "<u8", GgufType.INT64: "<i8", GgufType.FLOAT64: "<f8",
}
QK8_0 = 32  # Q8_0 block: f16 scale + 32 int8


def _pack_string(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pad(n, alignment):
    return (alignment - n % alignment) % alignment


def f32_to_bf16_bits(a):
    """Round-to-nearest-even float32 -> bfloat16, returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(a)
    out[nan] = 0x7FC0
    return out


def quantize_q8_0(a):
    """ggml's Q8_0: per block of 32 along ne0, d = amax / 127 (stored f16), q = round(x / d)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape[-1] % QK8_0:
        raise ValueError("Q8_0 needs the last dim to be a multiple of 32")
    blocks = a.reshape(-1, QK8_0)
    amax = np.abs(blocks).max(axis=1)
    d = amax / 127.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0).astype(np.float32)  # f32 d, as ggml
    v = blocks * inv[:, None]
    q = np.trunc(v + 0.5 * np.sign(v)).astype(np.int8)  # roundf: halves away from zero
    rec = np.zeros(len(blocks), dtype=[("d", "<f2"), ("qs", "i1", (QK8_0,))])
    rec["d"] = d.astype(np.float16)
    rec["qs"] = q
    return rec.tobytes()


def dequantize_q8_0(raw, shape):
    rec = np.frombuffer(raw, dtype=[("d", "<f2"), ("qs", "i1", (QK8_0,))])
    return (rec["qs"].astype(np.float32) * rec["d"].astype(np.float32)[:, None]).reshape(shape)


def tensor_bytes(array, ttype):
    """Serialises a NumPy array as the given TensorType."""
    ttype = TensorType(ttype)
    if ttype == TensorType.F32:
        return np.ascontiguousarray(array, dtype="<f4").tobytes()
    if ttype == TensorType.F16:
        return np.ascontiguousarray(array, dtype="<f2").tobytes()
    if ttype == TensorType.BF16:
        return f32_to_bf16_bits(np.asarray(array, dtype=np.float32)).astype("<u2").tobytes()
    if ttype == TensorType.Q8_0:
        return quantize_q8_0(array)
    if int(ttype) in gguf_quants.QUANTIZERS:
        return gguf_quants.QUANTIZERS[int(ttype)](array)
    raise ValueError("unsupported tensor type %r" % ttype)


class GgufWriter:
    """Collects metadata and tensors, then writes one GGUF v3 file with write().

    Keys keep insertion order. `general.alignment` is honoured if added (as UINT32)."""

    def __init__(self, path, alignment=DEFAULT_ALIGNMENT):
        self.path = path
        self.alignment = alignment
        self._kv = []        # (key, bytes of type+value)
        self._keys = set()
        self._tensors = []   # (name, ne list, ttype, data bytes)

    # -- metadata ------------------------------------------------------------------------------
    def _add(self, key, payload):
        if key in self._keys:
            raise ValueError("duplicate key %s" % key)
        self._keys.add(key)
        self._kv.append((key, payload))

    def add_scalar(self, key, value, vtype):
        vtype = GgufType(vtype)
        if vtype == GgufType.STRING:
            self._add(key, struct.pack("<I", vtype) + _pack_string(value))
        elif vtype == GgufType.ARRAY:
            raise ValueError("use add_array")
        else:
            self._add(key, struct.pack("<I", vtype) + struct.pack(_SCALAR_FMT[vtype], value))
        if key == "general.alignment":
            self.alignment = int(value)

    def add_uint8(self, key, v): self.add_scalar(key, v, GgufType.UINT8)
    def add_int8(self, key, v): self.add_scalar(key, v, GgufType.INT8)
    def add_uint16(self, key, v): self.add_scalar(key, v, GgufType.UINT16)
    def add_int16(self, key, v): self.add_scalar(key, v, GgufType.INT16)
    def add_uint32(self, key, v): self.add_scalar(key, v, GgufType.UINT32)
    def add_int32(self, key, v): self.add_scalar(key, v, GgufType.INT32)
    def add_uint64(self, key, v): self.add_scalar(key, v, GgufType.UINT64)
    def add_int64(self, key, v): self.add_scalar(key, v, GgufType.INT64)
    def add_float32(self, key, v): self.add_scalar(key, v, GgufType.FLOAT32)
    def add_float64(self, key, v): self.add_scalar(key, v, GgufType.FLOAT64)
    def add_bool(self, key, v): self.add_scalar(key, bool(v), GgufType.BOOL)
    def add_string(self, key, v): self.add_scalar(key, v, GgufType.STRING)

    def add_array(self, key, values, elem_type):
        """Array of scalars or strings (nested arrays: pass elem_type ARRAY and a list of
        (values, elem_type) pairs)."""
        elem_type = GgufType(elem_type)
        out = [struct.pack("<I", GgufType.ARRAY), struct.pack("<I", elem_type),
               struct.pack("<Q", len(values))]
        if elem_type == GgufType.STRING:
            out.extend(_pack_string(v) for v in values)
        elif elem_type == GgufType.ARRAY:
            for sub_values, sub_type in values:
                sub_type = GgufType(sub_type)
                out.append(struct.pack("<I", sub_type) + struct.pack("<Q", len(sub_values)))
                out.append(self._array_body(sub_values, sub_type))
        else:
            out.append(self._array_body(values, elem_type))
        self._add(key, b"".join(out))

    @staticmethod
    def _array_body(values, elem_type):
        if elem_type == GgufType.STRING:
            return b"".join(_pack_string(v) for v in values)
        arr = np.asarray(values)
        if elem_type == GgufType.BOOL:
            arr = arr.astype(bool)
        return np.ascontiguousarray(arr, dtype=_NP_DTYPE[elem_type]).tobytes()

    # -- tensors -------------------------------------------------------------------------------
    def add_tensor(self, name, array, ttype=TensorType.F32):
        """array: NumPy array in row-major order; GGUF dims are its reversed shape."""
        array = np.asarray(array)
        if array.ndim == 0 or array.ndim > 4:
            raise ValueError("tensor %s: 1-4 dims supported" % name)
        if any(n == name for n, *_ in self._tensors):
            raise ValueError("duplicate tensor %s" % name)
        ne = [int(d) for d in reversed(array.shape)]
        self._tensors.append((name, ne, TensorType(ttype), tensor_bytes(array, ttype)))

    # -- output --------------------------------------------------------------------------------
    def write(self):
        head = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))]
        for key, payload in self._kv:
            head.append(_pack_string(key))
            head.append(payload)
        offset = 0
        for name, ne, ttype, data in self._tensors:
            head.append(_pack_string(name))
            head.append(struct.pack("<I", len(ne)))
            head.append(struct.pack("<%dQ" % len(ne), *ne))
            head.append(struct.pack("<IQ", ttype, offset))
            offset += len(data) + _pad(len(data), self.alignment)
        header = b"".join(head)
        with open(self.path, "wb") as f:
            f.write(header)
            f.write(b"\0" * _pad(len(header), self.alignment))
            for _, _, _, data in self._tensors:
                f.write(data)
                f.write(b"\0" * _pad(len(data), self.alignment))


class GgufReader:
    """Reads a GGUF v2/v3 file: .metadata {key: value}, .tensors {name: (ne, ttype, bytes)}.
    tensor(name) returns F32/F16/BF16/Q8_0 data as a float32 NumPy array of the NumPy shape."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self._buf = f.read()
        self._pos = 0
        if self._take(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file")
        self.version, n_tensors, n_kv = struct.unpack("<IQQ", self._take(20))
        self.metadata = {}
        self.metadata_types = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = GgufType(self._u32())
            self.metadata[key] = self._value(vtype)
            self.metadata_types[key] = vtype
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            ne = list(struct.unpack("<%dQ" % n_dims, self._take(8 * n_dims)))
            ttype, off = struct.unpack("<IQ", self._take(12))
            infos.append((name, ne, ttype, off))
        data_start = self._pos + _pad(self._pos, alignment)
        self.tensors = {}
        for name, ne, ttype, off in infos:
            n = int(np.prod(ne))
            size = {0: 4 * n, 1: 2 * n, 30: 2 * n}.get(ttype)
            if ttype in gguf_quants.BLOCKS:
                block_values, block_bytes = gguf_quants.BLOCKS[ttype]
                size = n // block_values * block_bytes
            if size is None:
                raise ValueError("tensor %s: unsupported type %d" % (name, ttype))
            start = data_start + off
            self.tensors[name] = (ne, ttype, self._buf[start:start + size])

    def tensor(self, name):
        ne, ttype, raw = self.tensors[name]
        shape = tuple(reversed(ne))
        if ttype == TensorType.F32:
            return np.frombuffer(raw, "<f4").reshape(shape).copy()
        if ttype == TensorType.F16:
            return np.frombuffer(raw, "<f2").astype(np.float32).reshape(shape)
        if ttype == TensorType.BF16:
            bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        if ttype == TensorType.Q8_0:
            return dequantize_q8_0(raw, shape)
        raise ValueError("tensor %s: no decoder here for type %d (tests/reference/llama_numpy.py "
                         "decodes every block type)" % (name, ttype))

    def _take(self, n):
        b = self._buf[self._pos:self._pos + n]
        if len(b) != n:
            raise ValueError("truncated GGUF file")
        self._pos += n
        return b

    def _u32(self):
        return struct.unpack("<I", self._take(4))[0]

    def _string(self):
        n = struct.unpack("<Q", self._take(8))[0]
        return self._take(n).decode("utf-8")

    def _value(self, vtype):
        if vtype == GgufType.STRING:
            return self._string()
        if vtype == GgufType.ARRAY:
            et = GgufType(self._u32())
            n = struct.unpack("<Q", self._take(8))[0]
            if et in (GgufType.STRING, GgufType.ARRAY):
                return [self._value(et) for _ in range(n)]
            dt = np.dtype(_NP_DTYPE[et])
            arr = np.frombuffer(self._take(n * dt.itemsize), dt)
            return arr.astype(bool).tolist() if et == GgufType.BOOL else arr.tolist()
        fmt = _SCALAR_FMT[vtype]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]


def _dump(path):
    """Prints a GGUF file's metadata (arrays abbreviated) and tensor table."""
    r = GgufReader(path)
    print("GGUF v%d: %d metadata keys, %d tensors" % (r.version, len(r.metadata), len(r.tensors)))
    for k, v in r.metadata.items():
        if isinstance(v, list):
            v = "array[%d] %r ..." % (len(v), v[:8])
        print("  %-45s %s" % (k, v))
    for name, (ne, ttype, raw) in r.tensors.items():
        print("  %-32s %-5s ne=%s" % (name, TensorType(ttype).name, ne))


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 2:
        sys.exit("usage: gguf_writer.py FILE.gguf   (prints metadata and tensor table)")
    _dump(sys.argv[1])
