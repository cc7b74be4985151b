#!/usr/bin/python3
"""The transform codec's file end to end: subspace-calibrate --kv-budget writes it, and
subspace-longctx's tcfile: cache reading it scores exactly as the codec it fits itself on the same
tokens (tc:BITS), on the small suite and the default model; the real cache (tccache:, the server's
--kv-cache transform) stores its codes and scores as close; bad uses are refused by name.
  codec_file_itest.py BUILD/bin REPO_ROOT
"""
import os
import subprocess
import sys
import tempfile
import unittest

from longctx_run import run_longctx, write_suite

BIN, ROOT = sys.argv[1], sys.argv[2]
MODEL = os.path.join(ROOT, "models/subspace-tiny.gguf")
TEXT = os.path.join(ROOT, "models/data/test.txt")


class CodecFileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.codec = os.path.join(cls.tmp, "tiny.codec.gguf")
        cls.calib = subprocess.run(
            [os.path.join(BIN, "subspace-calibrate"), "--model", MODEL, "--text", TEXT,
             "--out", cls.codec, "--kv-budget", "3", "--max-tokens", "3000"],
            capture_output=True, text=True, timeout=300)
        suite = os.path.join(cls.tmp, "suite.jsonl")
        write_suite(ROOT, suite, "--small")
        cls.proc, cls.rows = run_longctx(
            os.path.join(BIN, "subspace-longctx"),
            ["--model", MODEL, "--suite", suite,
             "--caches", "tcfile:{0},tc:3:aw,tccache:{0}".format(cls.codec),
             "--calib", TEXT, "--calib-tokens", "3000", "--max-items", "6"],
            os.path.join(cls.tmp, "rows.json"), timeout=300)

    def test_calibrate_writes_the_codec(self):
        self.assertEqual(self.calib.returncode, 0, self.calib.stderr)
        self.assertIn("transform codec, 3 / 3 bits per key / value element (pre-RoPE keys, "
                      "attention-weighted)",
                      self.calib.stdout)
        self.assertGreater(os.path.getsize(self.codec), 1000)

    def test_the_file_codes_as_the_fit_it_holds(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr)
        # subspace-calibrate weighs errors by attention by default, as tc:...:aw does.
        a, b = self.rows["tcfile:%s" % self.codec], self.rows["tc:3:aw"]
        for key in ("bytes_ratio", "kld", "top1", "passkey_hits", "kv_hits", "long_ppl"):
            self.assertEqual(a[key], b[key], key)
        self.assertGreater(a["kld"], 0.0)

    def test_the_cache_stores_the_codes(self):
        # tccache: the server's --kv-cache transform on the file: whole blocks coded, the rest
        # fp16, bytes measured in its pool. It keeps more full (block-granular window), so it is
        # a little larger and at least as close as the token-precise emulation.
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr)
        emu, real = self.rows["tcfile:%s" % self.codec], self.rows["tccache:%s" % self.codec]
        self.assertLess(real["bytes_ratio"], 0.7)
        self.assertGreaterEqual(real["bytes_ratio"], emu["bytes_ratio"])
        self.assertGreater(real["kld"], 0.0)
        self.assertLessEqual(real["kld"], 2 * emu["kld"] + 1e-3)
        self.assertGreaterEqual(real["top1"], 0.95)

    def test_bad_uses_are_refused_by_name(self):
        both = subprocess.run(
            [os.path.join(BIN, "subspace-calibrate"), "--model", MODEL, "--text", TEXT,
             "--out", os.path.join(self.tmp, "x"), "--kv-budget", "3", "--rank", "8"],
            capture_output=True, text=True, timeout=60)
        self.assertNotEqual(both.returncode, 0)
        self.assertIn("exactly one of", both.stderr)
        # A codec file is no low-rank basis: the file: cache (the server's --bases) refuses it.
        proc, _ = run_longctx(
            os.path.join(BIN, "subspace-longctx"),
            ["--model", MODEL, "--suite", os.path.join(self.tmp, "suite.jsonl"),
             "--caches", "file:%s:fp16" % self.codec, "--max-items", "1"],
            os.path.join(self.tmp, "bad.json"), timeout=120)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("transform codec", proc.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
