#!/usr/bin/env python3
"""`subspace-run --tokenize` against llama.cpp's llama-tokenize: the ids it printed for the same
vocab-only GGUF and texts are committed in tests/data/gguf/llama-tokenize-ids.json.

    tokenize_cli_test.py SUBSPACE_RUN REPO_ROOT
"""
import json
import os
import subprocess
import sys
import unittest

RUN, ROOT = sys.argv[1], sys.argv[2]


class TokenizeCli(unittest.TestCase):
    def test_ids_equal_llama_tokenize(self):
        with open(os.path.join(ROOT, "tests/data/gguf/llama-tokenize-ids.json"),
                  encoding="utf-8") as f:
            cases = json.load(f)["cases"]
        vocab = os.path.join(ROOT, "tests/data/gguf/ggml-vocab-llama-spm.gguf")
        for case in cases:
            with self.subTest(text=case["text"], parse_special=case["parse_special"]):
                cmd = [RUN, "--model", vocab, "--tokenize", case["text"]]
                if not case["parse_special"]:
                    cmd.append("--noparse_special")
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                self.assertEqual([int(t) for t in out.split()], case["ids"])

    def test_bad_model_is_a_clear_error(self):
        r = subprocess.run([RUN, "--model", "/nonexistent.gguf", "--tokenize", "x"],
                           capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("nonexistent.gguf", r.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
