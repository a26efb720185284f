"""A/B of the sm80 decode kernel's paged-cache paths in one process: the page looked up per
16-byte chunk with the split-major grid (old) against one lookup per key row per tile with the
head-major grid (new), and each change alone, on paged caches (shuffled pages) and the
contiguous cache; arms alternate A, B, C, D, A, ... (--rounds each), median GB/s per case.

    python3 scripts/ab_paged_decode.py --out ab-paged.json [--rounds 7] [--reps 40]
                                       [--shapes 128x1024,32x4096,16x8192,4x32768] [--paged 0,16,256]

The arms are the launcher's diagnostic switches (templates/include/flashgen/cuda/decode.cuh,
launch_decode; read per launch, so one build serves every arm):
  * old:   FLASHGEN_DECODE_ROW_LOOKUP=0 FLASHGEN_DECODE_HEADS_FIRST=0
  * rows:  FLASHGEN_DECODE_ROW_LOOKUP=1 FLASHGEN_DECODE_HEADS_FIRST=0 (the lookup change alone)
  * heads: FLASHGEN_DECODE_ROW_LOOKUP=0 FLASHGEN_DECODE_HEADS_FIRST=1 (the grid order alone)
  * new:   neither set (the defaults: row lookup; head-major grid for paged caches, split-major
           for contiguous ones)
On the contiguous cache the lookup switch changes nothing, and heads times the head-major grid
there.

Before any timing, every arm's out and lse are compared with the old arm's on each layout and
shape (torch.equal: the arms change the order of CTAs and how addresses are computed, never the
arithmetic); a mismatch is printed and the script exits 1 after writing the JSON. Each layout's
result is also compared with the contiguous cache's in the same arm (recorded, printed where it
differs, not a failure).

Cases: spec causal, Sq 1, --heads 32 query heads / --kv-heads 8, d 128, bf16, every sequence at
the cache length (no append), num_splits 0 (the family's choice); flashgen.bench_decode's paged
copy (page_size divides L; pages shuffled, seed 0), its GB/s definition (K and V bytes of the
attended positions per second) and timing (flashgen.bench.time_fn: L2 flushed before each call, CUDA
events, median of --reps calls after 3 warm-up calls). --device cpu with tiny shapes runs the
same code on the CPU family (which ignores the switches) for the tests.

JSON (--out): {"device", "torch", "config", "arms", "checks": [{batch, cache_len, page_size, arm,
equal_old, equal_contiguous}], "rows": [{batch, cache_len, page_size, arm, bytes, ms (the rounds'
medians), ms_median, gbps}], "summary": [{batch, cache_len, page_size, gbps {arm: GB/s},
new_over_old, over_contiguous {arm: this layout's GB/s over the contiguous cache's in the same
arm}}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import bench, bench_decode  # noqa: E402
from flashgen.lang import ir  # noqa: E402
from flashgen.ops import TORCH_DTYPE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROWS, ORDER = "FLASHGEN_DECODE_ROW_LOOKUP", "FLASHGEN_DECODE_HEADS_FIRST"
ARMS = {"old": {ROWS: "0", ORDER: "0"}, "rows": {ROWS: "1", ORDER: "0"}, "heads": {ROWS: "0", ORDER: "1"},
        "new": {}}


@contextmanager
def arm_env(arm: str):
    """The process environment of ``arm`` (the switches it does not set removed), restored after."""
    saved = {k: os.environ.get(k) for k in (ROWS, ORDER)}
    try:
        for k in (ROWS, ORDER):
            os.environ.pop(k, None)
        os.environ.update(ARMS[arm])
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def options(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write the JSON here")
    ap.add_argument("--rounds", type=int, default=7, help="alternations per arm (>= 5 for a report)")
    ap.add_argument("--reps", type=int, default=40, help="timed calls per measurement (their median)")
    ap.add_argument("--shapes", type=bench_decode.shape_list, default=bench_decode.shape_list("128x1024,32x4096,16x8192,4x32768"))
    ap.add_argument("--paged", default="0,16,256", help="page sizes, 0: the contiguous cache (always timed)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    a.paged = sorted({0, *(int(x) for x in a.paged.split(","))})
    return a


def main(argv=None) -> int:
    a = options(argv)
    dev = torch.device(a.device)
    dtype = ir.DType(a.dtype)
    tdtype = TORCH_DTYPE[dtype]
    op = flashgen.compile(ROOT / "specs" / "causal.attn")
    family = "sm80" if dev.type == "cuda" else "cpu"
    H, Hkv, d = a.heads, a.kv_heads, a.head_dim
    checks, rows, summary = [], [], []
    ok = True
    with torch.inference_mode(), flashgen.use_family(family):
        for B, L in a.shapes:
            gen = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(B, H, 1, d, device=dev, dtype=tdtype, generator=gen)
            k, v = (torch.randn(B, Hkv, L, d, device=dev, dtype=tdtype, generator=gen) for _ in range(2))
            seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
            nbytes = 2 * B * Hkv * L * d * k.element_size()  # causal at Sq 1: every cached key
            calls = {}
            for ps in a.paged:
                if ps and L % ps:
                    print(f"B {B} L {L}: page size {ps} does not divide L, skipped", flush=True)
                    continue
                kc, vc, table = bench_decode.paged_copy(k, v, ps, torch.Generator().manual_seed(0)) if ps \
                    else (k, v, None)
                calls[ps] = (lambda kc=kc, vc=vc, table=table:
                             op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, return_lse=True))
            results = {}
            for ps, fn in calls.items():  # built and checked before any timing
                for arm in ARMS:
                    with arm_env(arm):
                        results[ps, arm] = tuple(t.clone() for t in fn())
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            for ps, arm in results:
                eq_old = all(torch.equal(x, y) for x, y in zip(results[ps, arm], results[ps, "old"]))
                eq_contig = all(torch.equal(x, y) for x, y in zip(results[ps, arm], results[0, arm]))
                ok &= eq_old
                checks.append({"batch": B, "cache_len": L, "page_size": ps, "arm": arm, "equal_old": eq_old,
                               "equal_contiguous": eq_contig})
            times = {key: [] for key in results}
            for _ in range(a.rounds):
                for ps, fn in calls.items():
                    for arm in ARMS:
                        with arm_env(arm):
                            times[ps, arm].append(bench.time_fn(fn, dev, reps=a.reps, flush_l2=True))
            gbps = {}
            for (ps, arm), ms in times.items():
                med = statistics.median(ms)
                gbps[ps, arm] = nbytes / med / 1e6
                rows.append({"batch": B, "cache_len": L, "page_size": ps, "arm": arm, "bytes": nbytes, "ms": ms,
                             "ms_median": med, "gbps": gbps[ps, arm]})
            for ps in calls:
                s = {"batch": B, "cache_len": L, "page_size": ps, "gbps": {arm: gbps[ps, arm] for arm in ARMS},
                     "new_over_old": gbps[ps, "new"] / gbps[ps, "old"],
                     "over_contiguous": {arm: gbps[ps, arm] / gbps[0, arm] for arm in ARMS}}
                summary.append(s)
                print(f"B {B:4d} L {L:6d} {'paged' + str(ps) if ps else 'contiguous':11s} "
                      + "  ".join(f"{arm} {g:7.1f}" for arm, g in s["gbps"].items())
                      + f"  new/old {s['new_over_old']:.3f}"
                      + (f"  over contiguous: old {s['over_contiguous']['old']:.3f} new "
                         f"{s['over_contiguous']['new']:.3f}" if ps else ""), flush=True)
    for c in checks:
        if not c["equal_old"]:
            print(f"MISMATCH with the old arm: {c}", flush=True)
        elif not c["equal_contiguous"]:
            print(f"note: differs from the contiguous cache's result (not an A/B failure): {c}", flush=True)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "config": {"spec": "causal", "heads": H, "kv_heads": Hkv, "head_dim": d, "dtype": a.dtype, "seqlen_q": 1,
                      "rounds": a.rounds, "reps": a.reps, "family": family},
           "arms": ARMS, "checks": checks, "rows": rows, "summary": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
