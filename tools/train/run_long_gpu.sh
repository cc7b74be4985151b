#!/bin/sh
# Phase 3 of models/subspace-long.gguf, on a GPU: the CPU recipe's phase-2 weights
# (tools/train/run_long.sh exports them as models/work/long-p2.gguf) trained on far more of the
# long mix at 2048 tokens than two CPU cores can give in a day (bf16 autocast, the fused
# attention kernel, sequences made by WORKERS processes). MINUTES fits the step count to the
# time a lease allows (from the first steps' speed; the log records the count, and STEPS=N
# repeats a run's schedule without a budget). Writes the last weights and those with the
# lowest validation loss as GGUF files into OUTDIR (default models/work), with the checkpoint
# history. Needs PyTorch >= 2.0 with CUDA, numpy and sentencepiece; models/data from
# build_corpus.py. Run from the repository root.
# Phase 4, the evaluation model of issue 36 (copying at every distance, of any text):
#   DATA=models/data-wide MIX=wide INIT=models/subspace-long.gguf NAME=wide MINUTES=4
# (on 2026-11-28 a first call stopped at the then default STEPS=1000; the second resumed)
# with models/data-wide from `build_corpus.py --sources kjv,fortunes,devil,jargon,pydoc`.
set -eu
PY=${PYTHON:-python3}
OUTDIR=${OUTDIR:-models/work}
MINUTES=${MINUTES:-0}
# With a time budget the budget sets the step count (train.py takes the smaller of the two).
if [ "$MINUTES" = 0 ]; then STEPS=${STEPS:-1000}; else STEPS=${STEPS:-1000000}; fi
WORKERS=${WORKERS:-10}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-32}
INIT=${INIT:-models/work/long-p2.gguf}
NAME=${NAME:-long-gpu}
DATA=${DATA:-models/data}
MIX=${MIX:-long}
TOK=models/subspace-tiny.tokenizer.model
cd "$(dirname "$0")/../.."
mkdir -p models/work "$OUTDIR"
[ -f "$DATA/train.txt" ] || $PY tools/train/build_corpus.py --out-dir "$DATA"
$PY tools/train/train.py --data longctx --mix "$MIX" --data-dir "$DATA" --tokenizer $TOK \
  --init-gguf "$INIT" \
  --seq 2048 --context 2048 --batch "$BATCH" --steps "$STEPS" --time-budget-min "$MINUTES" \
  --lr 1e-3 --warmup 100 --device "$DEVICE" --workers "$WORKERS" --threads 4 --eval-every 250 \
  --eval-chunks 16 --eval-retrieval 48 --out models/work/$NAME.pt --resume
for which in "" -best; do
  ck=models/work/$NAME$which.pt
  [ -f "$ck" ] && $PY tools/train/export_gguf.py --ckpt "$ck" --tokenizer $TOK \
    --out "$OUTDIR/subspace-$NAME$which.gguf"
done
cp models/work/$NAME.json "$OUTDIR/"
