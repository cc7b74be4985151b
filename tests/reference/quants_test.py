#!/usr/bin/env python3
"""The Python side of the quantized types, against ggml's numbers (tests/data/quants/):

- the NumPy reference's decoders (llama_numpy.py) turn ggml's bytes into ggml's values;
- the writer's quantizers (tools/gguf/gguf_quants.py) produce blocks that those decoders read back
  close to the input (round trip), for every type.

    python3 tests/reference/quants_test.py
"""
import os
import struct
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "gguf"))
sys.path.insert(0, HERE)
import gguf_quants  # noqa: E402
from llama_numpy import _decode  # noqa: E402

TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_K": 10, "q3_K": 11,
         "q4_K": 12, "q5_K": 13, "q6_K": 14, "iq4_nl": 20}
# Relative RMS error of a round trip on Gaussian rows: what each bit width allows, loosely.
ROUND_TRIP_RMS = {"q4_0": 0.16, "q4_1": 0.14, "q5_0": 0.08, "q5_1": 0.07, "q2_K": 0.45,
                  "q3_K": 0.25, "q4_K": 0.14, "q5_K": 0.08, "q6_K": 0.04, "iq4_nl": 0.14}


def load_vectors(name):
    with open(os.path.join(ROOT, "tests", "data", "quants", name + ".bin"), "rb") as f:
        buf = f.read()
    magic, version, gtype, _, rows, n = struct.unpack_from("<6I", buf, 0)
    qbytes, _ = struct.unpack_from("<2Q", buf, 24)
    assert magic == 0x56515353 and version == 1
    pos = 40
    x = np.frombuffer(buf, "<f4", rows * n, pos)
    pos += 4 * rows * n
    q = buf[pos:pos + qbytes]
    pos += qbytes
    deq = np.frombuffer(buf, "<f4", rows * n, pos)
    return gtype, rows, n, x, q, deq


class DecodersMatchGgml(unittest.TestCase):
    def test_every_type(self):
        for name, gtype in TYPES.items():
            with self.subTest(name):
                t, rows, n, _, q, deq = load_vectors(name)
                self.assertEqual(t, gtype)
                ours = _decode(q, gtype, rows * n)
                # ggml decodes in fp32, we in fp64: equal to fp32 rounding.
                np.testing.assert_allclose(ours, deq, rtol=2e-7, atol=1e-9)


class WriterRoundTrips(unittest.TestCase):
    def test_every_type(self):
        rng = np.random.default_rng(3)
        a = rng.normal(0, 0.05, size=(6, 512)).astype(np.float32)
        a[0, :32] = 0.0                # an all-zero block
        a[1, 5] = 1.0                  # an outlier
        a[2] = np.abs(a[2])            # all positive
        for name, gtype in TYPES.items():
            if gtype == 8:
                continue  # q8_0 has its own writer in gguf_writer.py
            with self.subTest(name):
                raw = gguf_quants.QUANTIZERS[gtype](a)
                values, nbytes = gguf_quants.BLOCKS[gtype]
                self.assertEqual(len(raw), a.size // values * nbytes)
                back = _decode(raw, gtype, a.size).reshape(a.shape)
                self.assertTrue(np.all(back[0, :32] == 0.0) or gtype in (3, 7, 10, 12, 13),
                                "zero block decodes to zero")
                rms = np.sqrt(((back - a) ** 2).sum(axis=1) / (a ** 2).sum(axis=1))
                self.assertLess(rms.max(), ROUND_TRIP_RMS[name], rms)

    def test_matches_ggml_quality_roughly(self):
        # Our scales are plain round-to-nearest; ggml searches. On ggml's own inputs ours may
        # be somewhat worse, never wildly.
        for name, gtype in TYPES.items():
            if gtype == 8:
                continue
            with self.subTest(name):
                _, rows, n, x, _, deq = load_vectors(name)
                x = x.reshape(rows, n)
                ours = _decode(gguf_quants.QUANTIZERS[gtype](x), gtype, rows * n).reshape(rows, n)
                err_ours = np.sqrt(((ours - x) ** 2).sum())
                err_ggml = np.sqrt(((deq.reshape(rows, n) - x) ** 2).sum())
                self.assertLess(err_ours, 2.0 * err_ggml + 1e-6)


if __name__ == "__main__":
    unittest.main()
