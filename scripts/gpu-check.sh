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
if [ "${SUITE-1}" = 1 ]; then  # SUITE=0: skip the cold/cached run and the GPU test suite
run=(python3 -m flashgen run specs/causal.attn --batch 4 --heads 16 --seqlen 4096 --head-dim 128 --dtype bf16 --device cuda)
FLASHGEN_CACHE_DIR=.fgcache-run "${run[@]}" 2>&1 | tee "$out/run-cold.txt"
FLASHGEN_CACHE_DIR=.fgcache-run "${run[@]}" 2>&1 | tee "$out/run-cached.txt"
[ -d .minilm ] && export FLASHGEN_TEST_MINILM=$PWD/.minilm  # fp16 copy of the MiniLM test model, if carried
start=$(date +%s)
FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m pytest -m gpu -q -s -rf --durations=8 ${PYTEST_ARGS:-} tests 2>&1 | tee "$out/pytest-gpu.txt"
echo "gpu suite wall time (builds included): $(( $(date +%s) - start )) s" | tee -a "$out/pytest-gpu.txt"
fi
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
# "soak" (scripts/soak.py's load, threads and soak phases on the GPU), "first-build" (first build and
# cached load of causal d 128, forward and forward+backward, each in a new process on a fresh cache),
# "profile" (Nsight Compute sections of the forward next to SDPA cuDNN at the shapes in PROFILE_CASES,
# "spec:head_dim:seqlen[:bwd] ..."), "window64k" (sliding window 1024/4096/16384 and dense at N = 64K, with
# block masks, next to FlexAttention; WINDOW_BWD=1 times forward+backward), "ab-paged" (the paged decode
# gather's A/B, scripts/ab_paged_decode.py), "bwd-flex" (forward+backward of every example spec at N 4K and
# 16K next to FlexAttention, block masks built once), "dropout-share" (FLASHGEN_DROPOUT_BWD_SHARE's GPU
# tests, then four alternated bench processes with it 0 and 1 next to SDPA cuDNN), "d64-tile" (the sm90
# backward's 128-row query tile at d 64 against the 64-row default, one bench process per arm), "trace"
# (scripts/trace_kernels.py: kernel tables of document ids forward+backward at 4K, with and without
# a block mask, next to FlexAttention, and of the sliding-window decode at cache 4K and 32K), "e2e"
# (transformers end to end: scripts/e2e_gpt2.py compiled at 1K with loss curves, scripts/e2e_gemma2.py
# training and decoding at 4K; each script stops itself inside 10 minutes), "decode-graphs" (the decode
# bandwidth table with every row timed as CUDA-graph replays: the kernels without host time, Sq 1 and 4),
# "read-ceiling" (scripts/read_ceiling.py: the read rate of the decode's shapes by load method, ld.global,
# cp.async with and without the L2 prefetch hint, TMA bulk copies, next to torch.sum and SDPA cuDNN, at
# stages of 64 x 3 and 128 x 2 rows), "decode-bulk" (the decode kernel's bulk-copy variant: its GPU tests, then
# the decode-graphs table with FLASHGEN_CUDA_DECODE_BULK 0, 1 and 2, contiguous and paged by 16), "decode-keys"
# (the keys-major decode kernel: its GPU tests with FLASHGEN_CUDA_DECODE_KEYS=1, then the decode-graphs table in
# processes alternating FLASHGEN_CUDA_DECODE_KEYS 0 and 1, three each at Sq 1, one each at Sq 4 and paged by 16).
# SAN_ARGS passes options to sanitize.py (e.g. --tools racecheck).
for extra in ${EXTRA-}; do
  case $extra in
    sanitize) FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/sanitize.py --family all ${SAN_ARGS:-} --out "$out/sanitize" \
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
    first-build) python3 scripts/first_build.py --spec causal --head-dim 128 --json "$out/first-build.json" \
                   2>&1 | grep -v Warning | tee "$out/first-build.txt" ;;
    profile)
      for case in ${PROFILE_CASES:-dense:128:1024 causal:128:1024 causal:64:1024 dense:128:16384}; do
        IFS=: read -r s d n pass <<< "$case"  # pass: empty (forward) or bwd
        for impl in flashgen sdpa-cudnn; do
          FLASHGEN_CACHE_DIR=.fgcache-tests ncu --profile-from-start off --clock-control none --csv --page details \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
            --section WarpStateStats python3 scripts/profile_fwd.py --spec "$s" --head-dim "$d" --seqlen "$n" \
            --impl "$impl" ${pass:+--backward} 2>&1 | grep -v Warning | sed "s/^/$case:$impl,/" >> "$out/ncu.csv"
        done
      done
      grep -c . "$out/ncu.csv" ;;
    window64k)
      wb=$([ "${WINDOW_BWD:-0}" = 1 ] && echo --backward)
      for w in 1024 4096 16384; do
        FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/sliding_window.attn --device cuda \
          --seqlen 65536 --batch 1 --heads 16 --head-dim 128 --param window=$w --block-mask --peers flex \
          --reps 10 $wb --json "$out/window64k-$w.json" 2>&1 | grep -v Warning | tee -a "$out/window64k.txt"
      done
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/dense.attn --device cuda --seqlen 65536 \
        --batch 1 --heads 16 --head-dim 128 --peers flex --reps 5 $wb --json "$out/window64k-dense.json" 2>&1 \
        | grep -v Warning | tee -a "$out/window64k.txt" ;;
    bwd-flex)
      for s in sliding_window document alibi prefix_lm key_padding gemma softcap relative_bias bias; do
        FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/$s.attn --device cuda --backward \
          --head-dim 128 --seqlen 4096 16384 --peers flex --block-mask --json "$out/bwd-flex-$s.json" 2>&1 \
          | grep -v Warning | tee -a "$out/bwd-flex.txt"
      done ;;
    dropout-share)
      FLASHGEN_DROPOUT_BWD_SHARE=1 FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m pytest -m gpu -q \
        tests/test_gpu_dropout.py tests/test_gpu_sm90_bwd.py -k dropout 2>&1 | tail -5 | tee "$out/dropout-share.txt"
      for share in 0 1 0 1; do
        FLASHGEN_DROPOUT_BWD_SHARE=$share FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench \
          specs/dropout.attn --device cuda --backward --head-dim 128 --seqlen 4096 16384 --dropout-p 0.1 \
          --peers sdpa-cudnn --json "$out/dropout-share-$share-$RANDOM.json" 2>&1 | grep -v Warning \
          | sed "s/^/share=$share /" | tee -a "$out/dropout-share.txt"
      done ;;
    d64-tile)
      for bm in 64 128 64 128; do
        for s in causal dense; do
          FLASHGEN_CACHE_DIR=.fgcache-tests python3 -c "import sys; import flashgen.families.sm90 as f
f.bwd_block_m = lambda spec, d, _f=f.bwd_block_m: $bm if d == 64 else _f(spec, d)  # before the first build: the tile is part of the library's key
from flashgen.cli import main
sys.exit(main(['bench', 'specs/$s.attn', '--device', 'cuda', '--backward', '--head-dim', '64',
               '--seqlen', '4096', '--peers', 'sdpa-cudnn']))" 2>&1 | grep -v Warning | sed "s/^/bm=$bm /" \
            | tee -a "$out/d64-tile.txt"
        done
      done ;;
    trace)
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/trace_kernels.py --spec document --seqlen 4096 \
        --backward --impls flashgen,flashgen-bm,flex 2>&1 | grep -v "Warning\|USDT" | tee "$out/trace-document.txt"
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/trace_kernels.py --spec sliding_window \
        --decode 1x4096,1x32768,16x4096,16x32768 --param window=4096 2>&1 | grep -v "Warning\|USDT" \
        | tee "$out/trace-window-decode.txt" ;;
    e2e)  # transformers end to end (issue 21): the kernels first (not timed), then each script in its limit
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 -c "import flashgen.integrations.transformers as f
f.build('cuda', ['bf16'], [64, 256])" 2>&1 | tail -2 | tee "$out/e2e-build.txt"
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/e2e_gpt2.py --out "$out/e2e" --seqlens 1024 \
        --tokenizer bytes --curve fgen:0,sdpa:0,sdpa:1 --tag s1024-compiled 2>&1 | grep -v Warning | tail -12 \
        | tee "$out/e2e-gpt2.txt"
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 scripts/e2e_gemma2.py --out "$out/e2e" --part train,generate \
        --train-seqlens 4096 --gen-contexts 4096 2>&1 | grep -v Warning | tail -16 | tee "$out/e2e-gemma2.txt" ;;
    decode-graphs)
      for sq in 1 4; do
        FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/causal.attn --decode --graphs --device cuda \
          --sq $sq --json "$out/decode-graphs-sq$sq.json" 2>&1 | grep -v Warning | tee -a "$out/decode-graphs.txt"
      done ;;
    read-ceiling)
      for st in "64 3" "128 2"; do
        set -- $st
        python3 scripts/read_ceiling.py --rows "$1" --stages "$2" --json "$out/read-ceiling-$1x$2.json" 2>&1 \
          | grep -v Warning | tee -a "$out/read-ceiling.txt"
      done ;;
    decode-bulk)
      FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m pytest -m gpu -q tests/test_decode_bulk.py 2>&1 | tail -5 \
        | tee "$out/decode-bulk.txt"
      for page in 0 16; do
        for bulk in 0 1 2; do
          FLASHGEN_CUDA_DECODE_BULK=$bulk FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/causal.attn \
            --decode --graphs --device cuda --page-size $page --peers sdpa-cudnn \
            --json "$out/decode-bulk-$bulk-page$page.json" 2>&1 | grep -v Warning | sed "s/^/bulk=$bulk page=$page /" \
            | tee -a "$out/decode-bulk.txt"
        done
      done ;;
    decode-keys)
      FLASHGEN_CUDA_DECODE_KEYS=1 FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m pytest -m gpu -q ${PYTEST_ARGS:-} \
        tests/test_decode_keys.py tests/test_decode_cuda.py tests/test_kvcache.py 2>&1 | tail -5 | tee "$out/decode-keys.txt"
      for arm in "1 " "1 " "1 " "4 " "1 --page-size 16"; do
        for keys in 0 1; do
          FLASHGEN_CUDA_DECODE_KEYS=$keys FLASHGEN_CACHE_DIR=.fgcache-tests python3 -m flashgen bench specs/causal.attn \
            --decode --graphs --device cuda --peers sdpa-cudnn --sq $arm --json "$out/decode-keys-$keys-$RANDOM.json" 2>&1 \
            | grep -v Warning | sed "s/^/keys=$keys sq=$arm /" | tee -a "$out/decode-keys.txt"
        done
      done ;;
    ab-paged) python3 scripts/ab_paged_decode.py --out "$out/ab-paged.json" 2>&1 | grep -v Warning \
                | tee "$out/ab-paged.txt" ;;
    *) echo "EXTRA: unknown step $extra (sanitize nonfinite decode bwd-specs soak first-build profile window64k" \
            "ab-paged bwd-flex dropout-share d64-tile trace e2e decode-graphs read-ceiling decode-bulk decode-keys)" >&2 ;;
  esac
done
