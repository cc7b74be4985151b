"""What the long-context tests share: writing a suite with tools/train/longctx_suite.py from the
held-out test split, and running subspace-longctx on it with its rows read back from --json."""
import json
import os
import subprocess
import sys


def write_suite(root, out, *args):
    """longctx_suite.py ARGS --out OUT on the test split, with the models' tokenizer."""
    subprocess.run([sys.executable, os.path.join(root, "tools/train/longctx_suite.py"), *args,
                    "--out", out,
                    "--tokenizer", os.path.join(root, "models/subspace-tiny.tokenizer.model"),
                    "--text", os.path.join(root, "models/data/test.txt")],
                   check=True, capture_output=True)


def run_longctx(binary, args, json_out, timeout):
    """subspace-longctx ARGS --json JSON_OUT: (the finished process, {cache name: row})."""
    proc = subprocess.run([binary, *args, "--json", json_out], capture_output=True, text=True,
                          timeout=timeout)
    rows = {}
    if proc.returncode == 0:
        with open(json_out) as f:
            for line in f:
                r = json.loads(line)
                rows[r["cache"]] = r
    return proc, rows
