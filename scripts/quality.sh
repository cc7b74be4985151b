#!/usr/bin/env bash
# Regenerates docs/quality.md: builds subspace-eval, measures static (offline-calibrated) bases
# on the default model and writes the tables and the measured answers. ~2-3 minutes on 2 cores.
#   scripts/quality.sh            (BUILD=build-eval JOBS=2 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-eval}
JOBS=${JOBS:-2}
MODEL=${MODEL:-models/subspace-tiny.gguf}
TEXT=models/data/test.txt
OUT_DIR=$BUILD/quality
DOC=docs/quality.md

cmake -S . -B "$BUILD" -G Ninja -DSUBSPACE_CUDA=OFF >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target subspace-eval
EVAL=$BUILD/bin/subspace-eval
# OpenMP threads must not spin: on a shared 2-core machine busy-waiting makes runs 10x slower.
export OMP_WAIT_POLICY=passive
mkdir -p "$OUT_DIR"

# The test split is its documents joined by blank lines: the 52 KJV chapters first (one verse
# per line, no blank line inside a chapter), then the 512 fortunes (models/README.md).
awk 'BEGIN{RS="";ORS="\n\n"} NR<=52' "$TEXT" > "$OUT_DIR/kjv.txt"
awk 'BEGIN{RS="";ORS="\n\n"} NR>52' "$TEXT" > "$OUT_DIR/fortunes.txt"
n_fort=$(awk 'BEGIN{RS=""} END{print NR}' "$OUT_DIR/fortunes.txt")
awk -v h=$((n_fort / 2)) 'BEGIN{RS="";ORS="\n\n"} NR<=h' "$OUT_DIR/fortunes.txt" > "$OUT_DIR/fortunes_a.txt"
awk -v h=$((n_fort / 2)) 'BEGIN{RS="";ORS="\n\n"} NR>h' "$OUT_DIR/fortunes.txt" > "$OUT_DIR/fortunes_b.txt"

COMMON=(--model "$MODEL" --max-tokens 4096 --calib-tokens 4096 --error-tokens 511)
MAIN_ARGS=(--text "$TEXT" --methods ksvd,eigen,kqsvd --ranks 2,4,8,16,32 --energies 0.9,0.99
           --dtypes fp16,int8)
echo "main run: ${MAIN_ARGS[*]}" >&2
"$EVAL" "${COMMON[@]}" "${MAIN_ARGS[@]}" --label main --csv "$OUT_DIR/main.csv" > "$OUT_DIR/main.txt"
SHIFT_ARGS=(--methods ksvd,kqsvd --ranks 2,4,8,16 --dtypes fp16 --refresh none,pca,kqsvd,oja,fd
            --refresh-every-tokens 64 --refresh-half-life-tokens 256 --refresh-oja-lr 1.0)
echo "domain shift: calibrate on fortunes (first half), evaluate on fortunes (second half)" >&2
"$EVAL" "${COMMON[@]}" "${SHIFT_ARGS[@]}" --calib "$OUT_DIR/fortunes_a.txt" \
  --text "$OUT_DIR/fortunes_b.txt" --label in_domain --csv "$OUT_DIR/in_domain.csv" > "$OUT_DIR/in_domain.txt"
echo "domain shift: calibrate on KJV, evaluate on fortunes (second half)" >&2
"$EVAL" "${COMMON[@]}" "${SHIFT_ARGS[@]}" --calib "$OUT_DIR/kjv.txt" \
  --text "$OUT_DIR/fortunes_b.txt" --label kjv_to_fortunes --csv "$OUT_DIR/shift.csv" > "$OUT_DIR/shift.txt"

# --- Derived answers from the CSVs ---
# Method comparison at equal rank (fixed ranks, fp16 rows): lowest logit / attention-output error.
methods_table=$(awk -F, '
  NR > 1 && $7 == "all" && $4 > 0 && $6 == "fp16" {
    if ($18 != "none") next
    key = $4; m = $2; logit[key, m] = $15; attn[key, m] = $16; ppl[key, m] = $10; ranks[key] = 1
  }
  END {
    print "| rank | logit err ksvd / eigen / kqsvd | attn-out err ksvd / eigen / kqsvd | ppl ksvd / eigen / kqsvd | lowest logit err | lowest attn-out err |"
    print "|---|---|---|---|---|---|"
    n = 0; for (r in ranks) list[++n] = r + 0
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (list[j] < list[i]) { t = list[i]; list[i] = list[j]; list[j] = t }
    for (i = 1; i <= n; i++) {
      r = list[i]; bl = ""; ba = ""; vl = 1e9; va = 1e9
      split("ksvd eigen kqsvd", ms, " ")
      for (k = 1; k <= 3; k++) { m = ms[k]
        if (logit[r, m] + 0 < vl) { vl = logit[r, m] + 0; bl = m }
        if (attn[r, m] + 0 < va) { va = attn[r, m] + 0; ba = m } }
      printf "| %d | %.4f / %.4f / %.4f | %.4f / %.4f / %.4f | %.3f / %.3f / %.3f | %s | %s |\n", r,
        logit[r, "ksvd"], logit[r, "eigen"], logit[r, "kqsvd"], attn[r, "ksvd"], attn[r, "eigen"],
        attn[r, "kqsvd"], ppl[r, "ksvd"], ppl[r, "eigen"], ppl[r, "kqsvd"], bl, ba
    }
  }' "$OUT_DIR/main.csv")
shift_table=$(awk -F, '
  FNR == 1 { next }
  $7 == "all" && $2 == "full" { full[$1] = $10 }
  $7 == "all" && $2 != "full" && $18 == "none" { key = $2 " r" $4; p[$1, key] = $10; a[$1, key] = $16; keys[key] = 1; order[++n] = key }
  END {
    print "| config | ppl full cache (fortunes B) | ppl, calibrated on fortunes A | ppl, calibrated on KJV | shift cost (ppl) | attn-out err in-domain / KJV |"
    print "|---|---|---|---|---|---|"
    for (i = 1; i <= n; i++) { k = order[i]; if (seen[k]++) continue
      printf "| %s | %.3f | %.3f (%+.2f%%) | %.3f (%+.2f%%) | %+.2f%% | %.4f / %.4f |\n", k, full["in_domain"],
        p["in_domain", k], 100 * (p["in_domain", k] / full["in_domain"] - 1),
        p["kjv_to_fortunes", k], 100 * (p["kjv_to_fortunes", k] / full["kjv_to_fortunes"] - 1),
        100 * (p["kjv_to_fortunes", k] / p["in_domain", k] - 1), a["in_domain", k], a["kjv_to_fortunes", k] }
  }' "$OUT_DIR/in_domain.csv" "$OUT_DIR/shift.csv")
# Online refresh: the residual-energy ratio of the keys as the cache compressed them, and the
# perplexity, static (the calibrated basis throughout) vs each online method starting from it.
online_table() {
  awk -F, -v want="$1" '
    FNR == 1 { next }
    $1 == want && $7 == "all" && $2 != "full" {
      key = $2 " r" $4; rer[key, $18] = $19; ppl[key, $18] = $10; if (!(key in seen)) { seen[key] = 1; order[++n] = key }
    }
    END {
      print "| keys, rank | RER static | RER pca | RER kqsvd | RER oja | RER fd | ppl static | ppl pca | ppl kqsvd | ppl oja | ppl fd |"
      print "|---|---|---|---|---|---|---|---|---|---|---|"
      for (i = 1; i <= n; i++) { k = order[i]
        printf "| %s | %.4f | %.4f | %.4f | %.4f | %.4f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", k,
          rer[k, "none"], rer[k, "pca"], rer[k, "kqsvd"], rer[k, "oja"], rer[k, "fd"],
          ppl[k, "none"], ppl[k, "pca"], ppl[k, "kqsvd"], ppl[k, "oja"], ppl[k, "fd"] }
    }' "$2"
}
online_shift=$(online_table kjv_to_fortunes "$OUT_DIR/shift.csv")
online_in=$(online_table in_domain "$OUT_DIR/in_domain.csv")
smallest=$(grep '^smallest footprint\|^no configuration' "$OUT_DIR/main.txt")

{
  cat <<'HDR'
# Basis quality on the default model

Generated by `scripts/quality.sh` (do not edit by hand; rerun it). It builds `subspace-eval`
(`tools/eval_main.cc`, metrics in `tools/eval/eval_metrics.{h,cc}`) and measures **static** bases —
one offline calibration installed as the compressed cache's default epoch — on
`models/subspace-tiny.gguf` (6 layers, 4 query / 2 KV heads, head_dim 64, context 512).

The main table is static bases only. The domain-shift runs add **online** rows: the same
calibrated basis is each sequence's first epoch, then the refresher (`core/compress/refresher.h`, inline
so runs are deterministic) publishes a new epoch every 64 compressed tokens from that sequence's
own keys and values — `pca` (decayed Gram, half-life 256 tokens), `kqsvd` (decayed key and query
Grams), `oja` (learning rate 1), `fd` (frequent directions) — and the compactor keeps at most 2
epochs live. Each 512-token perplexity window is a fresh sequence, so statistics start empty in
every window.

> **Read these numbers with care.** This model uses little context beyond ~100 tokens: evicting
> everything but 4 sinks and the last 64 tokens moves its perplexity by +0.33 %, about what the
> compressed rows below cost. So these tables measure the bases' fidelity, not whether
> compression keeps what eviction loses. That comparison -- retrieval, long-range perplexity and
> KLD against eviction and quantized K/V at equal bytes -- is `scripts/longctx.sh`
> (`build/bin/subspace-longctx`): on this model in [tiny/longctx.md](tiny/longctx.md), where
> eviction loses no retrieval (there is none to lose) and +4.8 % long-range perplexity, so the
> gate fails as expected. On the long-context model (`models/subspace-long.gguf`) the gate
> passes and the answer is in [longctx.md](longctx.md): at equal bytes, llama.cpp-style q4_0
> and KIVI-style int4 K/V beat the low-rank cache on this model.

## Method

- **Data.** Only the committed test split (`models/data/test.txt`) is used; train/val are not
  committed. Main run: the split's tokens are cut in two, the first half calibrates (first
  4,096 tokens), the second half is evaluated (first 4,096 tokens) — disjoint text. The split is
  52 KJV chapters followed by 512 fortunes, so the main run's calibration half is KJV and its
  evaluation half is KJV then fortunes (the boundary is at ~55% of the tokens; 4,096 evaluation
  tokens starting at the middle are mostly KJV with the fortune start) — see the domain-shift
  section for a controlled comparison.
- **Calibration.** `CollectCalibrationStats` (windows of 512 = [BOS] + 511 tokens), then
  `ComputeCalibratedBasis` per configuration. Keys: `ksvd`, `eigen`, `kqsvd`; values: `kqsvd` with
  `kqsvd` keys, `ksvd` otherwise (Eigen is a key-only method). Ranks: fixed (same r_k = r_v in every
  layer) or per-layer by energy of the method's spectrum.
- **Perplexity.** `ComputeChunkedPerplexity`: the same windows as `ComputePerplexity` ([BOS] +
  511 tokens, each a fresh sequence), but each window is fed in steps of 16 tokens with all
  logits. Within one step attention sees the step's own tokens full-rank; between steps the cache
  commits and compresses every block that left the recent window, so later queries attend over
  compressed blocks (the tool fails if no compressed block was used). Compressed cache: S = 4
  sinks, W = 64 recent tokens, blocks of 16, fp16 full blocks, outliers off, the coefficient
  dtype of the row. The **full** row is `PagedKvCache` (fp32) with the same 16-token steps.
- **Footprint.** `bytes/tok vs fp16 (window)`: cache bytes in use (full + compressed pages) at
  the end of each 512-token window, over the fp16 full-rank size of the same tokens
  (`KvCacheStats`), summed over windows — includes the sinks, the 64-token window and the
  partially filled last block, so it is what a 512-token sequence really costs. `compressed
  blocks vs fp16`: one compressed block's bytes over a full fp16 block — the ratio long sequences
  approach. The full row's 2.0 is the fp32 reference cache.
- **Errors** (per layer, heads pooled; tables show all layers pooled, CSV has each layer), on
  the post-RoPE Q, K, V captured from a full-rank prefill of the first 511 evaluation tokens
  (+ BOS), with fp32 coefficients (independent of the coefficient dtype):
  - `K err` = ‖K − P_q P_kᵀ K‖_F / ‖K‖_F: the key as the query sees it.
  - `logit err` = ‖QKᵀ − (QP_q)(KP_k)ᵀ‖_F / ‖QKᵀ‖_F over causal pairs (j ≤ i), every query head
    of the GQA group against its KV head.
  - `attn-out err` = ‖O − Ô‖_F / ‖O‖_F, O the exact causal softmax attention output per query
    head, Ô the same with **every** key replaced by its low-rank form (logit (P_qᵀq)·(P_kᵀk)/√d)
    and every value by R_vᵀP_vᵀv — no sinks or window kept full-rank. This isolates the basis; the
    cache's perplexity keeps sinks and the window exact, so these errors are far larger than what
    the served model sees.
  - `RER` = energy of K outside span(P_q) / total energy (orthogonal projector; for orthogonal
    bases RER = K err², for KQ-SVD's oblique pair it is at most K err²). These four columns are
    the calibrated basis's, also on online rows (where it is only the first epoch).
  - `RER as compressed` = Σ‖k − P_q P_kᵀ k‖² / Σ‖k‖² over every key the cache compressed during
    the perplexity run, each under the epoch in use when its block was compressed
    (`CompressedKvCacheDetail`): the residual the cache really incurred, comparable between
    static and online rows. `epochs installed` counts the refreshes over all windows.

HDR
  echo "## Main table"
  echo
  echo '```'
  echo "$ $EVAL ${COMMON[*]} ${MAIN_ARGS[*]}"
  echo '```'
  echo
  sed -n '1,/^total/p' "$OUT_DIR/main.txt" | grep -v '^total'
  echo
  echo "## KQ-SVD vs Eigen vs K-SVD at equal rank (fp16 coefficients)"
  echo
  echo "$methods_table"
  echo
  echo "## Domain shift: calibrate on KJV, evaluate on fortunes"
  echo
  echo "Fortunes B (second half of the test split's fortunes by document) is evaluated with a basis"
  echo "calibrated on fortunes A (first half, in-domain) and on the test split's KJV chapters"
  echo "(4,096 tokens each), fp16 coefficients. \`shift cost\` = ppl(KJV basis) / ppl(fortunes basis) − 1."
  echo
  echo "$shift_table"
  echo
  echo "## Online refresh: does it lower the residual under domain shift?"
  echo
  echo "RER as compressed (lower is better) and perplexity on fortunes B; every online row starts"
  echo "each window from the same calibrated basis as the static row. Calibrated on KJV (shifted):"
  echo
  echo "$online_shift"
  echo
  echo "Calibrated on fortunes A (in-domain), for reference:"
  echo
  echo "$online_in"
  echo
  echo "## Smallest footprint at ≤ 1 % perplexity increase (main run)"
  echo
  echo "$smallest"
  echo
  echo "CSV files: \`$OUT_DIR/{main,in_domain,shift}.csv\` (per-layer rows included)."
  cat <<'NOTES'

## Reading the numbers (written for the run above; the tables are regenerated, this text is not)

- **KQ-SVD vs Eigen vs K-SVD.** At equal fixed rank KQ-SVD has the lowest logit error at every
  rank measured (2-32) and the lowest attention-output error at ranks 2-16; at rank 32 Eigen is
  marginally lower on attention output (0.2010 vs 0.2028). The margins are small (a few % relative)
  and show up in perplexity only at ranks ≤ 8. At equal *energy* threshold KQ-SVD chooses much
  lower ranks (its spectrum is that of KQᵀ), so its energy rows are cheaper and less accurate: the
  energy rows are not an equal-rank comparison.
- **Perplexity is very insensitive on this model.** With S = 4 sinks and a W = 64 full-rank
  window, even rank 2 (attention-output error ≈ 1.0 when *all* keys are compressed) costs < 1.2 %
  perplexity: the tiny model's attention is mostly sinks and recent tokens, which stay exact. So
  the error columns say far more about basis quality than perplexity does here; do not expect
  this slack on a larger model or longer contexts.
- **Smallest footprint at ≤ 1 % perplexity:** see the line above — every fixed-rank configuration
  down to rank 4 (and KQ-SVD rank 2) stays within 1 %; the footprint of a 512-token sequence is
  then dominated by the full-rank sinks, window and partial blocks (≈ 0.19 of fp16), while the
  compressed blocks themselves are ≈ 0.03 of fp16. int8 coefficients never changed perplexity by
  more than 0.001 here; at rank 2 int8 saves nothing (the per-token fp16 scales cost as much as
  the codes save).
- **Domain shift** (KJV basis on fortunes): at most ≈ +0.4 % perplexity vs an in-domain basis at
  rank 2-4, and nothing measurable at rank ≥ 8; attention-output errors rise by 0.01-0.07. Small
  on this model, for the same reason as above.
- **Online refresh does not lower RER here — the seed-003 claim (0.255 → 0.097) does not hold
  on this model.** Under the KJV → fortunes shift every online method compresses with a
  *higher* residual than the static calibrated basis it starts from: at rank 8 (K-SVD start)
  static 0.594, Oja 0.605, FD 0.667, PCA 0.676, KQ-SVD 0.799; the same ordering holds at every
  rank and in-domain. Oja, which moves slowly away from the calibrated basis, stays within
  0.02 of static and is the only method that is neutral; perplexity moves by less than 0.2 % for
  pca/oja/fd (sometimes slightly down: values adapt too) and rises ~2 % for online KQ-SVD, whose
  query Gram from a few hundred tokens overfits. The shift itself is small on this model (static
  RER at rank 8: 0.535 in-domain → 0.594 shifted), so there is little to recover. Our
  explanation, not measured further: statistics from one sequence's past blocks (≤ 448 tokens,
  fewer positions) fit the RoPE phases already seen, while the next blocks sit at later
  positions; a calibration over 4,096 tokens at all positions 0–511 averages over the phases.
  Static bases (`--refresh-method=none`) therefore stay the default.
NOTES
} > "$DOC"
echo "wrote $DOC" >&2
