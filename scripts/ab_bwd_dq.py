"""A/B of the sm90 backward's dQ path in one process: the dQ writer warp's tensor reduce-adds from
shared-memory staging (default) against the consumers' own fp32 atomics
(FLASHGEN_SM90_BWD_DQ=atomic, with FLASHGEN_SM90_BWD_SPLIT=0: the kernel before both changes),
the writer with the key tiles ordered slowest in the grid (FLASHGEN_SM90_BWD_ORDER=lpt), and the
writer without the bare path's split waits (FLASHGEN_SM90_BWD_SPLIT=0); all read per launch,
alternating the arms (--rounds each),
median forward+backward TFLOP/s per case (CUDA events with an L2 flush before each call,
flashgen.bench.time_fn; bf16, B·N = 16K,
H·d = 2048; FLOPs 3.5x the forward's), with SDPA cuDNN timed the same way in the same process.
Also the deterministic mode (--det) in both arms. The arms' gradients are compared (allclose
at bf16 tolerances; the deterministic arms bitwise across two calls each).

    python3 scripts/ab_bwd_dq.py [--rounds 5] [--seqlens 1024 4096 16384] [--head-dims 64 128]
                                 [--specs dense causal] [--det | --det-only] [--sm80] [--json F]
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
from flashgen.params import example_params

ROOT = Path(__file__).resolve().parent.parent
# arm -> (FLASHGEN_SM90_BWD_DQ, FLASHGEN_SM90_BWD_ORDER, FLASHGEN_SM90_BWD_SPLIT)
VARS = ("FLASHGEN_SM90_BWD_DQ", "FLASHGEN_SM90_BWD_ORDER", "FLASHGEN_SM90_BWD_SPLIT")
ARMS = (("writer", ("writer", "tile", "1")), ("atomic", ("atomic", "tile", "0")), ("writer-lpt", ("writer", "lpt", "1")),
        ("writer-nosplit", ("writer", "tile", "0")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--specs", nargs="+", default=["dense", "causal"])
    ap.add_argument("--det", action="store_true", help="also the deterministic mode (every arm)")
    ap.add_argument("--det-only", action="store_true", help="the deterministic mode alone")
    ap.add_argument("--sm80", action="store_true", help="also the sm80 family's backward (the same call)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in a.specs:
        op = flashgen.compile(ROOT / "specs" / f"{name}.attn")
        cudnn = bench.peers(op.spec, dev)["sdpa-cudnn"]
        for d in a.head_dims:
            for n in a.seqlens:
                b, h = max(1, 16384 // n), 2048 // d
                g = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                                 for _ in range(4))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                pv = example_params(op.spec, b, h, n, n, dev, g)
                fl = flops.call_flops(op.spec, n, n, d, batch=b, heads=h, kind="fwd+bwd", **pv)
                modes = (True,) if a.det_only else (False, True) if a.det else (False,)
                for det in modes:
                    res = {arm: [] for arm, _ in ARMS}
                    res["cudnn"], res["sm80"] = [], []
                    grads = {}
                    with flashgen.use_family("sm90"):
                        for _ in range(a.rounds):
                            for arm, val in ARMS:
                                for var, x in zip(VARS, val):
                                    if x is None:
                                        os.environ.pop(var, None)
                                    else:
                                        os.environ[var] = x

                                def step(det=det):
                                    return torch.autograd.grad(op(q, k, v, deterministic=det, **pv), (q, k, v), dout)

                                grads[arm] = step()
                                if det:
                                    again = step()
                                    grads[arm + "-repeat"] = all(torch.equal(x, y) for x, y in zip(grads[arm], again))
                                ms = bench.time_fn(step, dev, warmup=2, reps=a.reps, flush_l2=True, min_ms=30)
                                res[arm].append(fl / ms / 1e9)
                            if a.sm80:
                                for var in VARS:
                                    os.environ.pop(var, None)
                                with flashgen.use_family("sm80"):
                                    grads["sm80"] = step()
                                    ms = bench.time_fn(step, dev, warmup=2, reps=a.reps, flush_l2=True, min_ms=30)
                                res["sm80"].append(fl / ms / 1e9)
                            if not det and cudnn is not None:
                                ms = bench.time_fn(lambda: torch.autograd.grad(cudnn(q, k, v, pv), (q, k, v), dout),
                                                   dev, warmup=2, reps=a.reps, flush_l2=True, min_ms=30)
                                res["cudnn"].append(fl / ms / 1e9)
                    for var in VARS:
                        os.environ.pop(var, None)
                    close = all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2)
                                for arm, _ in ARMS[1:] for x, y in zip(grads["writer"], grads[arm]))
                    row = {"spec": name, "d": d, "n": n, "deterministic": det, "close": close,
                           **{arm: statistics.median(res[arm]) for arm, _ in ARMS}}
                    for peer in ("cudnn", "sm80"):
                        if res[peer]:
                            row[peer] = statistics.median(res[peer])
                    if det:
                        row["repeatable"] = {arm: grads[arm + "-repeat"] for arm, _ in ARMS}
                    row["ratio"] = row["writer"] / row["atomic"]
                    rows.append(row)
                    print(f"{name:7s} d{d:<4d} N{n:<6d} det {int(det)}  writer {row['writer']:6.1f}  atomic "
                          f"{row['atomic']:6.1f}  lpt {row['writer-lpt']:6.1f}  nosplit {row['writer-nosplit']:6.1f}  ratio {row['ratio']:.3f}  "
                          f"cudnn {row.get('cudnn', float('nan')):6.1f}  sm80 {row.get('sm80', float('nan')):6.1f}  close {close}  {row.get('repeatable', '')}",
                          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
