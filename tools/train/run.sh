#!/bin/sh
# One-command recipe for models/subspace-tiny.gguf (CPU only, about 40-75 min on one shared core).
# Needs the Debian packages: python3-torch python3-numpy python3-sentencepiece
# libopenblas0-pthread bible-kjv fortunes fortunes-min. Run from the repository root.
# Intermediate files (tokenizer, checkpoint, train/val splits) go to models/work and
# models/data; only models/data/test.txt, the GGUF and the expected JSON are meant for git.
set -eu
PY=${PYTHON:-/usr/bin/python3}
STEPS=${STEPS:-800}
# One thread: on a shared 2-core machine two OpenMP/OpenBLAS threads stall at barriers whenever
# another process holds a core (measured 2x slower); results do not depend on the thread count.
# Keeping freed activations in the heap instead of returning them to the kernel saves ~15% sys time.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456
cd "$(dirname "$0")/../.."
mkdir -p models/work
$PY tools/train/build_corpus.py --out-dir models/data
$PY tools/train/train_tokenizer.py --train models/data/train.txt --prefix models/work/tokenizer
cp models/work/tokenizer.model models/subspace-tiny.tokenizer.model
rm -f models/work/ckpt.pt  # tee hides a training failure; a stale checkpoint must not be exported
$PY tools/train/train.py --steps "$STEPS" --threads 1 --out models/work/ckpt.pt 2>&1 | tee models/work/train.log
$PY tools/train/export_gguf.py --ckpt models/work/ckpt.pt --tokenizer models/subspace-tiny.tokenizer.model \
  --out models/subspace-tiny.gguf
$PY tools/train/reference.py --gguf models/subspace-tiny.gguf \
  --tokenizer models/subspace-tiny.tokenizer.model --ckpt models/work/ckpt.pt \
  --out models/subspace-tiny.expected.json
