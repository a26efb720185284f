"""A/B of the sm90 forward's epilogue in one process: the TMA store against direct stores
(FLASHGEN_SM90_TMA_STORE=0, read per launch), alternating A, B, A, B, ... (--rounds each),
median TFLOP/s per case (CUDA events, flashgen.bench.time_fn; bf16, B·N = 16K, H·d = 2048).

    python3 scripts/ab_tma_store.py [--rounds 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen
from flashgen import bench, flops

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in ("dense", "causal"):
        op = flashgen.compile(ROOT / "specs" / f"{name}.attn")
        for d in (64, 128, 256):
            for n in (1024, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                g = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
                fl = flops.call_flops(op.spec, n, n, d, batch=b, heads=h)
                res = {"tma": [], "direct": []}
                outs = {}
                with torch.no_grad(), flashgen.use_family("sm90"):
                    for _ in range(a.rounds):
                        for arm, val in (("tma", "1"), ("direct", "0")):
                            os.environ["FLASHGEN_SM90_TMA_STORE"] = val
                            outs[arm] = op(q, k, v)
                            ms = bench.time_fn(lambda op=op, q=q, k=k, v=v: op(q, k, v), dev, warmup=3, reps=a.reps)
                            res[arm].append(fl / ms / 1e9)
                os.environ.pop("FLASHGEN_SM90_TMA_STORE", None)
                same = torch.equal(outs["tma"], outs["direct"])
                row = {"spec": name, "d": d, "n": n, "tma": statistics.median(res["tma"]),
                       "direct": statistics.median(res["direct"]), "bit_equal": same}
                row["ratio"] = row["tma"] / row["direct"]
                rows.append(row)
                print(f"{name:7s} d{d:<4d} N{n:<6d} tma {row['tma']:6.1f}  direct {row['direct']:6.1f}  "
                      f"ratio {row['ratio']:.3f}  bit-equal {same}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
