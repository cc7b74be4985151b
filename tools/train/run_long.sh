#!/bin/sh
# Recipe for models/subspace-long.gguf, CPU part: subspace-tiny continued on long-range
# documents (tools/train/longctx.py) in three phases: 0, the induction curriculum at 128 tokens (natural
# passages that recur a few tokens later: cheap steps, so the copying circuit forms -- it did
# not within 250 steps of the long mix at 512, nor within 800 of random-id repeats; with this
# mix the gain on a repeated passage jumped from 0.2 to 3 nats between steps 350 and 450);
# 1, the long mix at 512; 2, the long mix at 2048 (the positions the model serves). Phase 0
# keeps the lr schedule of 1500 steps but stops at P0_STOP, once copying has formed (more of
# it only trades natural-text perplexity for copying). Each phase resumes its checkpoint when
# rerun, so the recipe can be stopped and restarted at any point. Same packages as run.sh; run
# from the repository root after run.sh has made models/data (or with models/data from
# build_corpus.py). THREADS=1 leaves a core free on a 2-core machine; P0_STOP, P1_STEPS and
# P2_STEPS size the phases.
set -eu
PY=${PYTHON:-/usr/bin/python3}
THREADS=${THREADS:-1}
P0_STOP=${P0_STOP:-600}
P1_STEPS=${P1_STEPS:-500}
P2_STEPS=${P2_STEPS:-200}
export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456
cd "$(dirname "$0")/../.."
mkdir -p models/work
[ -f models/data/train.txt ] || $PY tools/train/build_corpus.py --out-dir models/data
TOK=models/subspace-tiny.tokenizer.model
$PY tools/train/train.py --data longctx --mix induct --tokenizer $TOK \
  --init-gguf models/subspace-tiny.gguf --seq 128 --context 2048 --batch 32 --steps 1500 \
  --stop-at "$P0_STOP" --lr 2e-3 --warmup 30 --threads "$THREADS" --eval-every 50 \
  --eval-chunks 8 --eval-retrieval 8 --out models/work/induct.pt --resume \
  2>&1 | tee -a models/work/induct.log
$PY tools/train/train.py --data longctx --tokenizer $TOK --init-ckpt models/work/induct.pt \
  --seq 512 --context 2048 --batch 16 --steps "$P1_STEPS" --lr 1e-3 --warmup 40 \
  --threads "$THREADS" --eval-every 50 --out models/work/long-p1.pt --resume \
  2>&1 | tee -a models/work/long-p1.log
$PY tools/train/train.py --data longctx --tokenizer $TOK --init-ckpt models/work/long-p1.pt \
  --seq 2048 --context 2048 --batch 4 --steps "$P2_STEPS" --lr 5e-4 --warmup 20 \
  --threads "$THREADS" --eval-every 50 --eval-chunks 8 --out models/work/long-p2.pt --resume \
  2>&1 | tee -a models/work/long-p2.log
# Phase 2's weights as a GGUF: where phase 3 on a GPU (tools/train/run_long_gpu.sh, which
# makes the committed models/subspace-long.gguf) starts.
$PY tools/train/export_gguf.py --ckpt models/work/long-p2.pt --tokenizer $TOK \
  --out models/work/long-p2.gguf
