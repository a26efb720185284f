"""Decode bandwidth: op.with_kvcache next to SDPA's flash, cuDNN and efficient backends and a plain
read-only pass over the same bytes, in one run on one GPU, sweeping page sizes and split counts.

    python3 scripts/bench_decode.py [--spec specs/causal.attn] [--shapes 1x32768,16x8192,64x4096,128x1024]
                                    [--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16] [--sq 1]
                                    [--paged 0,16,256] [--splits 0] [--family sm80] [--reps 100]
                                    [--device cuda] [--json out.json]

A thin layer over flashgen/bench_decode.py (what `flashgen bench SPEC --decode` runs; its
docstring defines the bytes, rows and timing): this adds explicit B x cache shapes and several
ours rows per shape, flashgen[-paged<P>][-s<n>] for each page size P (0: the contiguous cache;
sizes that do not divide a shape's cache length are skipped there) and num_splits n. JSON out:
{"device", "torch", "rows"}, each row flashgen.bench_decode.DecodeRow's fields plus, on ours
rows, vs_read_only and vs_cudnn (ours GB/s over theirs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import bench_decode  # noqa: E402
from flashgen.lang import ir  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(Path(__file__).resolve().parent.parent / "specs" / "causal.attn"))
    ap.add_argument("--shapes", default="1x32768,16x8192,64x4096,128x1024", help="B x cache, comma separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sq", type=int, default=1, help="queries per sequence")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--paged", default="0", help="page sizes to time (0: the contiguous cache), comma separated")
    ap.add_argument("--splits", default="0", help="num_splits values to time (0: the family's choice)")
    ap.add_argument("--family", default="sm80")
    ap.add_argument("--reps", type=int, default=100, help="timed calls per row (median)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    op = flashgen.compile(args.spec)
    pages = [int(x) for x in args.paged.split(",")]
    splits = [int(x) for x in args.splits.split(",")]
    rows = []
    with flashgen.use_family(args.family):
        for shape in args.shapes.split(","):
            B, cap = (int(x) for x in shape.lower().split("x"))
            variants = [(p, s) for p in pages if not p or cap % p == 0 for s in splits]
            rows += bench_decode.run(op, [(B, cap, args.head_dim)], ir.DType(args.dtype), dev, heads=args.heads,
                                     kv_heads=args.kv_heads, seqlen_q=args.sq, variants=variants, reps=args.reps)
    out = []
    for r in rows:
        d = r.as_dict()
        if r.impl.startswith("flashgen"):
            d["vs_read_only"] = r.ratios.get(bench_decode.READ_ONLY)
            d["vs_cudnn"] = r.ratios.get("sdpa-cudnn")
        out.append(d)
    if args.json:
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": out},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
