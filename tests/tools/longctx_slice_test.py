#!/usr/bin/python3
"""The long-context evaluation end to end on the CI slice: longctx_suite.py --small (every kind
of item, 256 tokens) run by subspace-longctx on the default model against every baseline kind
and two low-rank caches, checked through its --json rows. The default model barely uses its
context, so this checks the machinery (every cache runs every item, the reference is exact,
footprints and divergences are ordered as their formats imply), not the quality claim; that is
docs/quality.md on the long-context model.
  longctx_slice_test.py BUILD/bin/subspace-longctx REPO_ROOT
"""
import json
import math
import os
import sys
import tempfile
import unittest

from longctx_run import run_longctx, write_suite

BIN, ROOT = sys.argv[1], sys.argv[2]
CACHES = ["evict", "q8_0", "q4_0", "kivi4", "self:16:fp16", "kqsvd:16:int8", "self:16:fp16:pca",
          "hq4_0", "tq2.5", "kivi2", "q4_0:sw", "tc:4", "tc:2", "tc:3:post:aw"]


class LongContextSliceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        suite = os.path.join(cls.tmp, "suite.jsonl")
        write_suite(ROOT, suite, "--small")
        cls.kinds = {}
        with open(suite) as f:
            for line in f:
                k = json.loads(line)["kind"]
                cls.kinds[k] = cls.kinds.get(k, 0) + 1
        cls.proc, cls.rows = run_longctx(
            BIN, ["--model", os.path.join(ROOT, "models/subspace-tiny.gguf"), "--suite", suite,
                  "--caches", ",".join(CACHES), "--calib",
                  os.path.join(ROOT, "models/data/test.txt"), "--calib-tokens", "4000",
                  "--refresh-every-tokens", "64"],
            os.path.join(cls.tmp, "rows.json"), timeout=600)

    def test_every_cache_reports(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr)
        self.assertEqual(sorted(self.rows), sorted(["full"] + CACHES))
        # The markdown table carries the same rows.
        for name in ["full"] + CACHES:
            self.assertIn("| %s |" % name, self.proc.stdout)

    def test_every_item_is_scored(self):
        for name, r in self.rows.items():
            self.assertEqual(r["passkey_n"],
                             self.kinds["passkey_filler"] + self.kinds["passkey_natural"], name)
            self.assertEqual(r["kv_n"], self.kinds["kv"], name)
            self.assertTrue(math.isfinite(r["long_ppl"]) and r["long_ppl"] > 1, name)
            self.assertTrue(math.isfinite(r["plain_ppl"]) and r["plain_ppl"] > 1, name)
            self.assertGreaterEqual(r["kld"], 0.0, name)
            self.assertLessEqual(r["top1"], 1.0, name)

    def test_the_full_cache_is_the_reference(self):
        full = self.rows["full"]
        self.assertEqual(full["bytes_ratio"], 1.0)
        self.assertEqual(full["kld"], 0.0)
        self.assertEqual(full["top1"], 1.0)

    def test_footprints_follow_the_formats(self):
        r = {k: v["bytes_ratio"] for k, v in self.rows.items()}
        self.assertAlmostEqual(r["q8_0"], 34 / 64, places=6)  # 34 bytes per 32 fp16 values
        self.assertAlmostEqual(r["q4_0"], 18 / 64, places=6)
        self.assertLess(r["evict"], 1.0)
        self.assertLess(r["kivi4"], r["q8_0"])
        self.assertLess(r["kqsvd:16:int8"], r["self:16:fp16"])
        self.assertLess(r["self:16:fp16"], 1.0)

    def test_footprints_of_the_rotated_and_transform_codes(self):
        r = {k: v["bytes_ratio"] for k, v in self.rows.items()}
        self.assertAlmostEqual(r["hq4_0"], r["q4_0"], places=9)
        self.assertAlmostEqual(r["tq2.5"], (2.5 + 16 / 64) / 16, places=6)  # + an fp16 norm
        self.assertLess(r["kivi2"], r["kivi4"])
        self.assertGreater(r["q4_0:sw"], r["q4_0"])  # the window at fp16
        # tc at B bits: sinks and window at fp16, the rest at B / 16 of fp16's bytes.
        self.assertLess(r["tc:2"], r["tc:4"])
        self.assertLess(r["tc:4"], 1.0)
        self.assertGreater(r["tc:2"], 2 / 16)

    def test_finer_quantization_diverges_less(self):
        self.assertLess(self.rows["q8_0"]["kld"], self.rows["q4_0"]["kld"])
        self.assertLess(self.rows["tc:4"]["kld"], self.rows["tc:2"]["kld"])
        self.assertLessEqual(self.rows["q4_0:sw"]["kld"], self.rows["q4_0"]["kld"])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
