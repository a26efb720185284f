"""Host overhead per call: the time an eager loop spends per flashgen call at a tiny shape (where
the kernel itself is a few microseconds), next to PyTorch SDPA in the same loop.

    python scripts/bench_host_overhead.py [--device cuda] [--calls 10000] [--json FILE]
        [--family sm80] [--profile]

Method: ``time.perf_counter`` around ``--calls`` back-to-back eager calls (no gradient),
synchronised at both ends, causal, B 1, H 8, N 128, d 64, bf16 on CUDA (fp32 on the CPU, where
the kernel's own time is included); three rounds, the best kept. Also the same loop through the
registered torch op (``op.torch_op``: the dispatcher path torch.compile and autograd take) and
with inputs that require grad (autograd records the call).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import flashgen


def per_call_us(fn, calls: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--family", default=None, help="force this kernel family (flashgen.use_family)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the cProfile of 2,000 calls of the eager and autograd cases (top 15 by own time)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print("flashgen from", flashgen.__file__, file=sys.stderr)
    op = flashgen.compile("specs/causal.attn")
    q, k, v = (torch.randn(1, 8, 128, 64, dtype=dtype, device=device) for _ in range(3))
    qg = q.clone().requires_grad_()
    cases = {
        "flashgen": lambda: op(q, k, v),
        "flashgen torch op": lambda: op.torch_op(q, k, v, 0.125, False),
        "flashgen (grad)": lambda: op(qg, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa (grad)": lambda: F.scaled_dot_product_attention(qg, k, v, is_causal=True),
    }
    with flashgen.use_family(args.family) if args.family else contextlib.nullcontext():
        for fn in cases.values():  # build, load, warm up
            for _ in range(100):
                fn()
        rows = {name: per_call_us(fn, args.calls, device) for name, fn in cases.items()}
        if args.profile:
            for name in ("flashgen", "flashgen (grad)"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(2000):
                    cases[name]()
                prof.disable()
                print(f"cProfile of 2,000 calls: {name}")
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fam = f", family {args.family}" if args.family else ""
    print(f"host time per call, {args.calls} eager calls, causal B1 H8 N128 d64 {dtype} on {where}{fam}:")
    for name, us in rows.items():
        print(f"  {name:20s} {us:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "dtype": str(dtype), "calls": args.calls, "family": args.family,
                       "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
