#!/usr/bin/env bash
# GPU check from a cold cache: first build + cached load through `flashgen run`, then the GPU
# test suite (its own cold cache, timed; PYTEST_ARGS="-n 16" spreads it over workers with pytest-xdist). Logs go under $OUT (default ./gpu-logs).
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2; date -u; } 2>&1 | tee "$out/machine.txt"
rm -rf .fgcache-run .fgcache-tests
run=(python3 -m flashgen run specs/causal.attn --batch 4 --heads 16 --seqlen 4096 --head-dim 128 --dtype bf16 --device cuda)
FLASHGEN_CACHE_DIR=.fgcache-run "${run[@]}" 2>&1 | tee "$out/run-cold.txt"
FLASHGEN_CACHE_DIR=.fgcache-run "${run[@]}" 2>&1 | tee "$out/run-cached.txt"
[ -d .minilm ] && export FLASHGEN_TEST_MINILM=$PWD/.minilm  # fp16 copy of the MiniLM test model, if carried
start=$(date +%s)
FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m pytest -m gpu -q -s -rf --durations=8 ${PYTEST_ARGS:-} tests 2>&1 | tee "$out/pytest-gpu.txt"
echo "gpu suite wall time (builds included): $(( $(date +%s) - start )) s" | tee -a "$out/pytest-gpu.txt"
# BENCH: "fwd", "bwd" (forward+backward), "fwd bwd" (default) or "" (none)
for dir in ${BENCH-fwd bwd}; do
  flag=$([ "$dir" = bwd ] && echo --backward)
  for s in dense causal; do
    FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/$s.attn --device cuda --reps 30 $flag \
      ${BENCH_ARGS:-} --json "$out/bench-$dir-$s.json" 2>&1 | grep -v Warning | tee "$out/bench-$dir-$s.txt"
  done
done
# EXTRA: any of "sanitize" (compute-sanitizer's four tools over every spec on both CUDA families),
# "nonfinite" (the non-finite rule's cost A/B), "decode" (decode bandwidth next to SDPA and the
# read-only ceiling), "bwd-specs" (forward+backward of the example specs on sm90 and sm80),
# "soak" (scripts/soak.py's load, threads and soak phases on the GPU).
for extra in ${EXTRA-}; do
  case $extra in
    sanitize) FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/sanitize.py --family all --out "$out/sanitize" \
                2>&1 | tee "$out/sanitize.txt" ;;
    nonfinite) FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/ab_nonfinite.py --out "$out/ab-nonfinite.json" \
                 2>&1 | tee "$out/ab-nonfinite.txt" ;;
    decode) FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/causal.attn --decode --device cuda \
              --json "$out/decode.json" 2>&1 | grep -v Warning | tee "$out/decode.txt" ;;
    bwd-specs)
      for s in alibi sliding_window document softcap causal; do
        for fam in sm90 sm80; do
          FLASHGEN_FAMILY=$fam FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/$s.attn --device cuda \
            --backward --seqlen 4096 --head-dim 128 --peers sdpa-cudnn --reps 10 --json "$out/bwd-$s-$fam.json" \
            2>&1 | grep -v Warning | tee "$out/bwd-$s-$fam.txt"
        done
      done ;;
    soak)
      for phase in load threads soak; do
        FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/soak.py $phase --device cuda --json "$out/soak-$phase.json" \
          2>&1 | grep -v Warning | tee "$out/soak-$phase.txt"
      done ;;
    *) echo "EXTRA: unknown step $extra (sanitize nonfinite decode bwd-specs soak)" >&2 ;;
  esac
done
