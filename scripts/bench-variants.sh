#!/usr/bin/env bash
# Every example spec next to FlexAttention (same mask_mod/score_mod and block mask) and SDPA (with
# the materialised mask a user would build), from one run on one machine. Logs/JSON under $OUT.
# DIRS: "fwd" (default), "bwd" (forward+backward) or "fwd bwd"; SEQLENS, HEAD_DIM override shapes;
# SPECS a subset of the specs (and causal for scale); PEERS the peers (default: all four).
# The forward passes --block-mask (BLOCK_MASK=0: not): masked specs get a row flashgen-bm, ours given
# the spec's block mask built once per shape as FlexAttention's is, next to the per-call row flashgen.
# dropout runs with --dropout-p 0.1 against SDPA flash and cuDNN only (FlexAttention has no dropout).
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
  [dropout]="--dropout-p 0.1"
)
declare -A PEERS_OF=(
  [dropout]="sdpa-flash sdpa-cudnn"
)
for dir in ${DIRS:-fwd}; do
  flag=$([ "$dir" = bwd ] && echo --backward)
  bm=$([ "$dir" = fwd ] && [ "${BLOCK_MASK:-1}" != 0 ] && echo --block-mask)
  for s in ${SPECS:-sliding_window alibi softcap prefix_lm document key_padding bias relative_bias gemma dropout}; do
    FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-.fgcache-tests} python3 -m flashgen bench specs/$s.attn --device cuda \
      --reps ${REPS:-20} $flag $bm --head-dim ${HEAD_DIM:-128} --seqlen ${SEQLENS:-2048 4096 8192 16384} \
      --peers ${PEERS_OF[$s]:-${PEERS:-sdpa-flash sdpa-cudnn sdpa-efficient flex}} ${P[$s]:-} \
      --json "$out/variant-$dir-$s.json" 2>&1 | grep -v Warning | tee "$out/variant-$dir-$s.txt"
  done
done
