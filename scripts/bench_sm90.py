#!/usr/bin/env python3
"""Forward TFLOP/s of the sm90 and sm80 families next to SDPA and FlexAttention, in one process.

Every implementation is timed the same way (flashgen.bench.time_fn: CUDA events per call,
median). Shapes follow the FlashAttention benchmarks: batch · seqlen = 16K tokens,
heads · head_dim = 2048, bf16. FLOPs count visible pairs only (flashgen.flops). Usage:
    python3 scripts/bench_sm90.py [--specs dense,causal] [--head-dims 64,128]
        [--seqlens 1024,4096,16384] [--reps 20] [--peers sdpa-flash,sdpa-cudnn,flex]
        [--tiles 128x2,128x2x1,128x2x1x1] [--json OUT.json]
Needs a CUDA device of compute capability 9.0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys

import torch

import flashgen
from flashgen import bench, families, flops
from flashgen.families import sm90 as sm90_family
from flashgen.lang import ir
from flashgen.runtime import loader

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="dense,causal", help="spec names in specs/ (comma-separated)")
    ap.add_argument("--head-dims", default="64,128", help="head dims (comma-separated)")
    ap.add_argument("--seqlens", default="1024,4096,16384", help="sequence lengths (comma-separated)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per case (median reported)")
    ap.add_argument("--peers", default="sdpa-flash,sdpa-cudnn,flex", help="peers of flashgen.bench.peers to time")
    ap.add_argument("--tiles", default="128x2,64x2", help="sm90 tiles to time: keys x stages [x overlap [x ping-pong [x persistent]]] (0/1 each), "
                    "e.g. 128x2,128x2x1x1,128x2x1x0x1")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs a CUDA device of compute capability 9.0 (the sm90 family)")
    dev = torch.device("cuda")
    for knob in ("cache_size_limit", "recompile_limit"):  # FlexAttention recompiles per shape
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    sm90 = families.get("sm90")
    tile_sets = [(t, sm90_family.tiles_from_text(t)) for t in a.tiles.split(",")]
    # Every timed instantiation built first, in parallel (one process, as a tuner would).
    insts = {}
    for name in a.specs.split(","):
        spec = flashgen.compile(ROOT / "specs" / f"{name}.attn").spec
        for d in map(int, a.head_dims.split(",")):
            for t, tiles in tile_sets:
                try:
                    insts[name, d, t] = sm90.instantiation(spec, "sm_90a", ir.DType.BF16, d, tiles=tiles)
                except ValueError:
                    pass  # over shared memory at this head dim
    with concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2)) as pool:
        libs = dict(zip(insts, pool.map(loader.load, insts.values()), strict=True))
    rows = []
    for name in a.specs.split(","):
        op = flashgen.compile(ROOT / "specs" / f"{name}.attn")
        peer_fns = bench.peers(op.spec, dev)
        peer_params: dict = {}  # one dict per spec: FlexAttention's block mask is built once per shape
        for d in map(int, a.head_dims.split(",")):
            for n in map(int, a.seqlens.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                g = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
                fl = flops.call_flops(op.spec, n, n, d, batch=b, heads=h)
                row = {"spec": name, "d": d, "n": n, "b": b, "h": h}
                with torch.no_grad():
                    for fam in ("sm90", "sm80"):
                        with flashgen.use_family(fam):
                            ms = bench.time_fn(lambda: op(q, k, v), dev, warmup=3, reps=a.reps)
                        row[fam] = fl / ms / 1e9
                    with flashgen.use_family("sm80"):
                        want = op(q, k, v).float()
                    for t, _tiles in tile_sets:
                        lib = libs.get((name, d, t))
                        if lib is None:
                            continue
                        sc = d ** -0.5
                        # Each timed tile config is checked against the sm80 family's output first.
                        got = op.launch_forward(q, k, v, sc, lib=lib)[0].float()
                        err = (got - want).abs().max().item()
                        if not err <= 2e-2:
                            row[f"sm90:{t}"] = f"wrong: max |sm90 - sm80| = {err:.3g}"
                            continue
                        ms = bench.time_fn(lambda lib=lib, sc=sc: op.launch_forward(q, k, v, sc, lib=lib), dev,
                                           warmup=3, reps=a.reps)
                        row[f"sm90:{t}"] = fl / ms / 1e9
                    for peer in a.peers.split(","):
                        fn = peer_fns.get(peer)
                        if fn is None:
                            continue
                        try:
                            ms = bench.time_fn(lambda fn=fn: fn(q, k, v, peer_params), dev, warmup=3, reps=a.reps)
                            row[peer] = fl / ms / 1e9
                        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
                            row[peer] = f"failed: {type(e).__name__}"
                rows.append(row)
                cells = " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                print(cells, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
