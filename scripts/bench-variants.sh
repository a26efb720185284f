#!/usr/bin/env bash
# Every example spec next to FlexAttention (same mask_mod/score_mod and block mask) and SDPA (with
# the materialised mask a user would build), from one run on one machine. Logs/JSON under $OUT.
# DIRS: "fwd" (default), "bwd" (forward+backward) or "fwd bwd"; SEQLENS, HEAD_DIM override shapes;
# SPECS a subset of the specs (and causal for scale); PEERS the peers (default: all four).
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
declare -A P=(
  [sliding_window]="--param window=1024"
  [alibi]=""
  [softcap]="--param softcap=50"
  [prefix_lm]=""
  [document]=""
  [key_padding]=""
  [bias]=""
  [relative_bias]="--param max_distance=128"
  [gemma]="--param window=1024 --param softcap=50"
)
for dir in ${DIRS:-fwd}; do
  flag=$([ "$dir" = bwd ] && echo --backward)
  for s in ${SPECS:-sliding_window alibi softcap prefix_lm document key_padding bias relative_bias gemma}; do
    FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-.fgcache-tests} python3 -m flashgen bench specs/$s.attn --device cuda \
      --reps ${REPS:-20} $flag --head-dim ${HEAD_DIM:-128} --seqlen ${SEQLENS:-2048 4096 8192 16384} \
      --peers ${PEERS:-sdpa-flash sdpa-cudnn sdpa-efficient flex} ${P[$s]:-} --json "$out/variant-$dir-$s.json" 2>&1 \
      | grep -v Warning | tee "$out/variant-$dir-$s.txt"
  done
done
