#!/usr/bin/env bash
# Tile sweep on the GPU: flashgen alone (no peers), each spec at each tile, the tile forced with
# FLASHGEN_CUDA_FWD_TILE (KIND=fwd, the default; forward timed) or FLASHGEN_CUDA_BWD_TILE
# (KIND=bwd; forward+backward timed); "default" = the built-in choice. Builds run in parallel
# first; timings after, with nothing else running. Logs and JSON under $OUT (default gpu-logs).
#   SPECS="alibi softcap" TILES="default 128x64x4 128x32x4" SEQLENS="2048 8192" scripts/tile-sweep.sh
#   KIND=bwd SPECS=alibi TILES="default 64x8x1x2" scripts/tile-sweep.sh
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
export FLASHGEN_CACHE_DIR=${FLASHGEN_CACHE_DIR:-.fgcache-tests} FLASHGEN_QUIET=1
declare -A P=([sliding_window]="--param window=1024" [softcap]="--param softcap=50"
              [relative_bias]="--param max_distance=128" [gemma]="--param window=1024 --param softcap=50")
# PHASE: "build", "bench" or "all" (default).
phase=${PHASE:-all}
kind=${KIND:-fwd}
var=$([ "$kind" = bwd ] && echo FLASHGEN_CUDA_BWD_TILE || echo FLASHGEN_CUDA_FWD_TILE)
flag=$([ "$kind" = bwd ] && echo --backward)
for tile in ${TILES:-default}; do
  [ "$phase" = bench ] && break
  t=$([ "$tile" = default ] && echo "" || echo "$tile")
  env "$var=$t" python3 - ${SPECS:-alibi} <<'PY' > "$out/build-$kind-$tile.txt" 2>&1 &
import sys, flashgen
from concurrent.futures import ThreadPoolExecutor
ops = [flashgen.compile(f"specs/{s}.attn") for s in sys.argv[1:]]
with ThreadPoolExecutor(len(ops)) as ex:
    list(ex.map(lambda op: op.build("cuda", dtypes=["bf16"], head_dims=[128], jobs=1), ops))
print("built", sys.argv[1:])
PY
done
wait
[ "$phase" = build ] && exit 0
for s in ${SPECS:-alibi}; do
  for tile in ${TILES:-default}; do
    t=$([ "$tile" = default ] && echo "" || echo "$tile")
    echo "== $s $kind tile=$tile"
    env "$var=$t" python3 -m flashgen bench specs/$s.attn --device cuda --head-dim 128 $flag \
      --seqlen ${SEQLENS:-2048 8192} --reps ${REPS:-20} --peers none ${P[$s]:-} \
      --json "$out/sweep-$kind-$s-$tile.json" 2>&1 | grep -v Warning
  done
done
