#!/usr/bin/python3
"""Builds the Subspace-tiny text corpus from public-domain / permissively licensed Debian data.

Sources: the King James Bible (package bible-kjv, via the `bible` program) and a curated list of
BSD-licensed fortune-cookie sets (packages fortunes, fortunes-min). Every document (a Bible
chapter or a single fortune) is cleaned to printable ASCII and assigned to train / val / test by
hashing its identity, so the split is deterministic and independent of document order.
"""
import argparse
import hashlib
import os
import re
import subprocess
import unicodedata

FORTUNE_DIR = "/usr/share/games/fortunes"
# Excluded on purpose: art, ascii-art (layout-only ASCII drawings), translate-me (not English),
# ethnic, men-women, drugs (stereotype-prone jokes). The offensive sets (fortunes-off) are not
# used at all.
FORTUNE_SETS = [
    "computers", "cookie", "debian", "definitions", "disclaimer", "education", "food",
    "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie",
    "literature", "love", "magic", "medicine", "miscellaneous", "news", "paradoxum", "people",
    "perl", "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems",
    "sports", "startrek", "tao", "wisdom", "work", "zippy",
]
TEST_BUCKETS = range(0, 4)   # 4% of documents
VAL_BUCKETS = range(4, 8)    # 4% of documents
DOC_SEPARATOR = "\n\n"       # documents are joined with one blank line in the split files


def to_ascii(text):
    text = re.sub(r".\x08", "", text)  # overstrike sequences (char, backspace)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = text.expandtabs(8)
    lines = []
    for line in text.split("\n"):
        line = "".join(c for c in line if 32 <= ord(c) < 127)
        line = re.sub(r" {2,}", " ", line).rstrip()  # column layout adds nothing but spaces
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n ")


def bible_documents():
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    chapters = {}
    order = []
    for line in out.split("\n"):
        m = re.match(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = "%s%s" % (m.group(1), m.group(2))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(m.group(4).strip())
    for key in order:
        yield "kjv:" + key, to_ascii("\n".join(chapters[key]))


def fortune_documents():
    for name in FORTUNE_SETS:
        path = os.path.join(FORTUNE_DIR, name)
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read()
        for piece in re.split(r"^%$", raw, flags=re.M):
            text = to_ascii(piece)
            if len(text) >= 8:
                # Identity by content: duplicates across sets land in the same split.
                yield "fortune:" + text, text


def bucket(doc_id):
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "little") % 100


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out-dir", default="models/data")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    splits = {"train": [], "val": [], "test": []}
    seen = set()
    stats = {}
    for source, docs in (("kjv", bible_documents()), ("fortunes", fortune_documents())):
        for doc_id, text in docs:
            if doc_id in seen:
                continue
            seen.add(doc_id)
            b = bucket(doc_id)
            split = "test" if b in TEST_BUCKETS else "val" if b in VAL_BUCKETS else "train"
            splits[split].append(text)
            st = stats.setdefault((source, split), [0, 0])
            st[0] += 1
            st[1] += len(text)
    for split, docs in splits.items():
        with open(os.path.join(args.out_dir, split + ".txt"), "w", encoding="ascii") as f:
            f.write(DOC_SEPARATOR.join(docs) + "\n")
    for (source, split), (n, chars) in sorted(stats.items()):
        print("%-9s %-5s docs=%6d chars=%9d" % (source, split, n, chars), flush=True)


if __name__ == "__main__":
    main()
