"""Tile choices on one GPU: the derived tile, the per-arch table's tile and the tuned winner.

    python3 scripts/bench_tiles.py [SPECS ...] [--head-dim 64 128] [--seqlen 1024 4096 16384]
                                   [--dtype bf16] [--cache-dir DIR] [--json F]

For each spec (default specs/causal.attn specs/dense.attn specs/alibi.attn) this runs the
autotuner (flashgen.tune.tuner.tune_many, as `flashgen tune` does: candidates compiled in parallel,
timed with CUDA events, median of --reps, inputs rotated past the L2, B·N = 16K tokens, H·d =
2048) and prints, per head dim, sequence length and pass (forward; backward, everything the
backward call launches), the TFLOP/s of
  * derived: flashgen.tiles.derived, the paper's rule from the device's shared memory;
  * table:   the per-arch table's tile (flashgen.tiles.table; "—" on an arch without one);
  * tuned:   the tuner's winner (the default unless another candidate is 1% faster);
all measured in the same run (both are always among the candidates), and the spec's tuning wall
time (compile, time, build the winners). FLOPs count visible (query, key) pairs: 4 · B · H · d ·
pairs forward, 2.5× that backward.

By default the kernel cache is a fresh temporary directory (--cache-dir to reuse one), so the
wall time is that of a cold tuning run; its winners are stored there, not in the user's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def role_row(entry: dict, role: str) -> dict | None:
    """The candidate row of ``entry`` (one tuned (pass, seqlen)) that has ``role``."""
    return next((r for r in entry.get("candidates", []) if role in r["roles"]), None)


def fmt(x, spec=".1f") -> str:
    return format(x, spec) if x is not None else "—"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=["specs/causal.attn", "specs/dense.attn", "specs/alibi.attn"])
    ap.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seqlen", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-candidates", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--no-prebuild", action="store_true", help="leave the winners' full builds out of the wall time")
    ap.add_argument("--cache-dir", default=None, help="kernel cache and tuning store (default: a fresh temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    import flashgen
    from flashgen.tune import tuner

    if not torch.cuda.is_available():
        raise SystemExit("bench_tiles: needs a CUDA device")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="flashgen-bench-tiles-")
    os.environ["FLASHGEN_CACHE_DIR"] = cache  # flashgen reads it at each use
    os.environ.setdefault("FLASHGEN_QUIET", "1")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, {args.dtype}, cache {cache}")
    report = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
              "cache_dir": cache, "specs": {}}
    for path in args.specs:
        op = flashgen.compile(Path(path) if Path(path).exists() else ROOT / path)
        hds = [d for d in args.head_dim if d in op.head_dims("cuda")]
        t0 = time.perf_counter()
        results = tuner.tune_many(op, "cuda", args.dtype, hds, args.seqlen, tuple(args.kinds), progress=True,
                                 limit=args.max_candidates, reps=args.reps, jobs=args.jobs,
                                 prebuild=not args.no_prebuild)
        wall = time.perf_counter() - t0
        rows = []
        print(f"\n## {op.spec.name}: tuned in {wall:.1f} s (compile {results[0]['compile_s']:.1f} s, "
              f"prebuild {results[0]['prebuild_s']:.1f} s)")
        print(f"{'d':>4} {'pass':4} {'N':>6}  {'derived':>11} {'TFLOP/s':>8}  {'table':>11} {'TFLOP/s':>8}  "
              f"{'tuned':>11} {'TFLOP/s':>8}  {'tuned/table':>11}")
        for res in results:
            for kind in args.kinds:
                for n, e in sorted(res.get(kind, {}).items()):
                    der, tab = role_row(e, "derived"), role_row(e, "table")
                    row = {"head_dim": res["head_dim"], "pass": kind, "seqlen": n, "shape": e.get("shape"),
                           "derived": der["tile"] if der else None, "derived_tflops": der["tflops"] if der else None,
                           "table": tab["tile"] if tab else None, "table_tflops": tab["tflops"] if tab else None,
                           "tuned": e.get("winner"), "tuned_tflops": e.get("tflops"), "error": e.get("error")}
                    base = row["table_tflops"] or row["derived_tflops"]
                    row["tuned_over_table"] = row["tuned_tflops"] / base if base and row["tuned_tflops"] else None
                    rows.append(row)
                    print(f"{res['head_dim']:>4} {kind:4} {n:>6}  {fmt(row['derived'], ''):>11} "
                          f"{fmt(row['derived_tflops']):>8}  {fmt(row['table'], ''):>11} {fmt(row['table_tflops']):>8}  "
                          f"{fmt(row['tuned'], ''):>11} {fmt(row['tuned_tflops']):>8}  "
                          f"{fmt(row['tuned_over_table'], '.3f'):>11}" + (f"  {row['error']}" if row["error"] else ""))
        report["specs"][op.spec.name] = {"tune_s": round(wall, 2), "compile_s": results[0]["compile_s"],
                                        "prebuild_s": results[0]["prebuild_s"], "rows": rows, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
