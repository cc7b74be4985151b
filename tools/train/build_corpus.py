#!/usr/bin/python3
"""Builds the Subspace-tiny text corpus from public-domain / permissively licensed Debian data.

Sources (--sources): the King James Bible (package bible-kjv, via the `bible` program) and a
curated list of BSD-licensed fortune-cookie sets (packages fortunes, fortunes-min), the default
and the corpus of models/subspace-tiny.gguf; for the wide corpus (models/data-wide, the
evaluation model of issue 36) also The Devil's Dictionary (dict-devil, public domain), the
Jargon File 4.4.7 (dict-jargon, public domain) and the Python 3.11 documentation's reST sources
(python3.11-doc, PSF licence): definitions, hacker lore and technical prose, so that text from
outside scripture and fortunes is not foreign to the model. Every document (a Bible chapter, a
fortune, a dictionary entry, a documentation page) is cleaned to printable ASCII and assigned to
train / val / test by hashing its identity, so the split is deterministic and independent of
document order.
"""
import argparse
import gzip
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


DICTD_DIR = "/usr/share/dictd"
PYDOC_DIR = "/usr/share/doc/python3.11/html/_sources"
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(text):
    n = 0
    for c in text:
        n = n * 64 + B64.index(c)
    return n


def dictd_documents(name):
    """Entries of a dictd database (NAME.index: headword, base-64 offset and length)."""
    with gzip.open(os.path.join(DICTD_DIR, name + ".dict.dz"), "rb") as f:
        data = f.read()
    with open(os.path.join(DICTD_DIR, name + ".index"), encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
                continue
            off, size = dictd_number(parts[1]), dictd_number(parts[2])
            text = to_ascii(data[off:off + size].decode("utf-8", errors="replace"))
            if len(text) >= 16:
                yield "%s:%s:%d" % (name, parts[0], off), text


def pydoc_documents():
    """The Python documentation's pages (reST sources), the changelog excepted (a list of
    issue numbers)."""
    for root, dirs, files in os.walk(PYDOC_DIR):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), PYDOC_DIR)
            if not name.endswith(".rst.txt") or rel.startswith("whatsnew/changelog"):
                continue
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                text = to_ascii(f.read())
            if len(text) >= 64:
                yield "pydoc:" + rel, text


SOURCES = {
    "kjv": bible_documents,
    "fortunes": fortune_documents,
    "devil": lambda: dictd_documents("devil"),
    "jargon": lambda: dictd_documents("jargon"),
    "pydoc": pydoc_documents,
}


def bucket(doc_id):
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "little") % 100


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out-dir", default="models/data")
    ap.add_argument("--sources", default="kjv,fortunes",
                    help="comma-separated, of %s (models/data-wide: all)" % ",".join(SOURCES))
    args = ap.parse_args()
    sources = args.sources.split(",")
    unknown = [x for x in sources if x not in SOURCES]
    if unknown:
        ap.error("unknown --sources: " + ",".join(unknown))
    os.makedirs(args.out_dir, exist_ok=True)
    splits = {"train": [], "val": [], "test": []}
    seen = set()
    stats = {}
    for source in sources:
        for doc_id, text in SOURCES[source]():
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
