"""Decode bandwidth: op.with_kvcache next to SDPA's flash, cuDNN and efficient backends and a plain
read-only pass over the same bytes, in one run on one device, sweeping page sizes and split counts.

    python3 scripts/bench_decode.py [--spec causal] [--shapes 1x32768,16x8192,64x4096,128x1024]
                                    [--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16] [--sq 1[,4...]]
                                    [--param NAME=VALUE ...] [--mixed B:MAX]
                                    [--paged 0,16,256] [--splits 0] [--family sm80] [--reps 100]
                                    [--graphs] [--device cuda] [--json out.json]

A thin layer over flashgen/bench_decode.py (what `flashgen bench SPEC --decode` runs; its
docstring defines the bytes, rows and timing): this adds explicit B x cache shapes and several
ours rows per shape, flashgen[-paged<P>][-s<n>] for each page size P (0: the contiguous cache;
1 to 256, dividing every cache length, else an error) and num_splits n. GB/s
throughout: K and V bytes of the attended positions (the module's definition) per second, 1e9
bytes a GB; ms: the median of --reps calls.

  * --param NAME=VALUE (repeatable): a spec parameter, parsed as `flashgen bench --param` parses
    it (flashgen.params.parse_params), given to ours and to the peers' masks (peers that cannot
    express the spec's mask are rows with an 'unavailable: ...' note, as the module does).
  * --sq 1,4: every shape (and --mixed) timed at each Sq; then, per ours row and shape, the GB/s
    at each further Sq over the GB/s at the first Sq listed ("Sq 4 over Sq 1").
  * shapes sharing B and d at several cache lengths: per ours row, the time at each longer cache
    over the time at the shortest (for a sliding window, ~1 when the cost follows the window).
  * --mixed B:MAX: B sequences with cache lengths drawn log-uniformly from 1 to MAX
    (round(exp(u)), u uniform on [0, ln MAX), torch.Generator seed 0, printed) in a cache of
    capacity MAX, next to B sequences all at the mean length rounded (same capacity, the same
    total of attended bytes for masks attending every cached key); rows flashgen-mixed[...] and
    flashgen-uniform[...] timed as the others, and mixed GB/s over uniform GB/s.

JSON out: {"device", "torch", "rows"}, each row flashgen.bench_decode.DecodeRow's fields plus, on
ours rows, vs_read_only and vs_cudnn (ours GB/s over theirs; None where that row is absent), and
on flashgen-mixed rows vs_uniform; with several --sq also "sq_ratios" [{impl, batch, cache_len,
head_dim, seqlen_q, over_seqlen_q, ratio}] (GB/s over GB/s); with shapes sharing B "cache_len_ratios"
[{impl, batch, head_dim, seqlen_q, cache_len, over_cache_len, time_ratio}] (ms over ms); with --mixed
"mixed": [run_mixed's summary per Sq: batch, capacity, seqlen_q, seed, distribution, lengths,
uniform_length, mixed_bytes, uniform_bytes, ratios {variant: mixed / uniform GB/s}].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import bench_decode, paths  # noqa: E402
from flashgen.lang import ir  # noqa: E402
from flashgen.params import parse_params  # noqa: E402


def sq_list(text: str) -> list[int]:
    """--sq: comma-separated query counts, each ≥ 1, no repeats."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints ≥ 1, got {text!r}") from None
    if any(x < 1 for x in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct ints ≥ 1, got {text!r}")
    return values


def mixed_arg(text: str) -> tuple[int, int]:
    """--mixed B:MAX: the batch and the cache capacity, both ≥ 1."""
    b, sep, cap = text.partition(":")
    try:
        B, L = int(b), int(cap)
    except ValueError:
        B = L = 0
    if not sep or B < 1 or L < 1:
        raise argparse.ArgumentTypeError(f"expected B:MAX with B ≥ 1 sequences and MAX ≥ 1 slots, got {text!r}")
    return B, L


def options(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--spec", default="causal",
                    help="a .attn file, or the name of one in specs/ (causal, alibi, ...)")
    ap.add_argument("--shapes", default="1x32768,16x8192,64x4096,128x1024", help="B x cache, comma separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sq", type=sq_list, default=[1],
                    help="queries per sequence, comma separated (several: each timed, and the GB/s at each further "
                         "Sq over the first printed per shape)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="spec parameter, repeatable (as `flashgen bench --param`; default: example values)")
    ap.add_argument("--mixed", type=mixed_arg, default=None, metavar="B:MAX",
                    help="also time B sequences of cache lengths drawn log-uniformly from 1 to MAX (round(exp(u)), "
                         f"u uniform on [0, ln MAX), seed {bench_decode.MIXED_SEED}) in a cache of capacity MAX, next "
                         "to B sequences at the mean length rounded, and print mixed GB/s over uniform GB/s")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--paged", default="0", help="page sizes to time (0: the contiguous cache), comma separated")
    ap.add_argument("--splits", default="0", help="num_splits values to time (0: the family's choice)")
    ap.add_argument("--family", default=None, help="kernel family (default: sm80 on cuda, cpu on cpu)")
    ap.add_argument("--reps", type=int, default=100, help="timed calls per row (median)")
    ap.add_argument("--graphs", action="store_true",
                    help="CUDA: time the replays of each call captured in a CUDA graph (no host work per call)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    try:
        args.shape_list = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in args.shape_list):
            raise ValueError
    except ValueError:
        ap.error(f"argument --shapes: expected BxCACHE,... with values ≥ 1, got {args.shapes!r}")
    for name, floor in (("heads", 1), ("kv_heads", 1), ("head_dim", 1), ("reps", 1)):
        if getattr(args, name) < floor:
            ap.error(f"argument --{name.replace('_', '-')}: {getattr(args, name)} is out of range (expected ≥ 1)")
    if args.heads % args.kv_heads:
        ap.error(f"argument --kv-heads: {args.kv_heads} does not divide {args.heads} query heads (--heads)")
    caps = [L for _, L in args.shape_list] + ([args.mixed[1]] if args.mixed else [])
    if max(args.sq) > min(caps):
        ap.error(f"argument --sq: {max(args.sq)} queries exceed the shortest cache length {min(caps)}")
    try:
        args.pages = [int(x) for x in args.paged.split(",")]
        args.split_list = [int(x) for x in args.splits.split(",")]
    except ValueError:
        ap.error("argument --paged / --splits: expected comma-separated ints")
    bad = [p for p in args.pages if not 0 <= p <= 256]
    if bad:
        ap.error(f"argument --paged: page size {bad[0]} is out of range (0: a contiguous cache, else 1 to 256)")
    for p in args.pages:
        caps_off = [L for L in caps if p and L % p]
        if caps_off:
            ap.error(f"argument --paged: page size {p} does not divide the cache length {caps_off[0]} "
                     f"(--shapes / --mixed): pick sizes that divide every cache length")
    if any(n < 0 for n in args.split_list):
        ap.error("argument --splits: expected ints >= 0 (0: the family's choice)")
    try:
        args.op = flashgen.compile(paths.example_spec(args.spec))
    except ValueError as e:
        ap.error(f"argument --spec: {e}")
    try:
        args.params = parse_params(args.op.spec, args.param)
    except ValueError as e:
        ap.error(f"argument {e}")
    return args


def sq_ratios(rows: list[bench_decode.DecodeRow], sqs: list[int]) -> list[dict]:
    """Per ours row at each Sq after the first of ``sqs``: its GB/s over the same impl and shape's
    GB/s at sqs[0] (rows that failed are left out)."""
    base = {(r.impl, r.batch, r.cache_len, r.head_dim): r for r in rows
            if r.impl.startswith("flashgen") and r.seqlen_q == sqs[0] and r.gbps}
    out = []
    for r in rows:
        b = base.get((r.impl, r.batch, r.cache_len, r.head_dim))
        if b is not None and r.seqlen_q != sqs[0] and r.gbps:
            out.append({"impl": r.impl, "batch": r.batch, "cache_len": r.cache_len, "head_dim": r.head_dim,
                        "seqlen_q": r.seqlen_q, "over_seqlen_q": sqs[0], "ratio": r.gbps / b.gbps})
    return out


def cache_len_ratios(rows: list[bench_decode.DecodeRow], shapes: list[tuple[int, int]]) -> list[dict]:
    """Per ours row of a shape whose B has several cache lengths in ``shapes``: its ms over the
    same impl, B, d and Sq's ms at the shortest of those lengths."""
    shortest = {}
    for B, L in shapes:
        shortest[B] = min(shortest.get(B, L), L)
    several = {B for B in shortest if sum(1 for b, _ in shapes if b == B) > 1}
    ours = [r for r in rows if r.impl.startswith("flashgen") and r.batch in several and r.ms
            and (r.batch, r.cache_len) in shapes]
    base = {(r.impl, r.batch, r.head_dim, r.seqlen_q): r for r in ours if r.cache_len == shortest[r.batch]}
    out = []
    for r in ours:
        b = base.get((r.impl, r.batch, r.head_dim, r.seqlen_q))
        if b is not None and r is not b:
            out.append({"impl": r.impl, "batch": r.batch, "head_dim": r.head_dim, "seqlen_q": r.seqlen_q,
                        "cache_len": r.cache_len, "over_cache_len": b.cache_len, "time_ratio": r.ms / b.ms})
    return out


def main(argv=None) -> int:
    args = options(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode: needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    family = args.family or ("sm80" if dev.type == "cuda" else dev.type)
    op, dtype = args.op, ir.DType(args.dtype)
    rows, mixed = [], []
    with flashgen.use_family(family):
        for sq in args.sq:
            for B, cap in args.shape_list:
                variants = [(p, s) for p in args.pages for s in args.split_list]
                rows += bench_decode.run(op, [(B, cap, args.head_dim)], dtype, dev, heads=args.heads,
                                         kv_heads=args.kv_heads, seqlen_q=sq, variants=variants, reps=args.reps,
                                         params=args.params, graphs=args.graphs)
            if args.mixed:
                B, cap = args.mixed
                variants = [(p, s) for p in args.pages for s in args.split_list]
                got, summary = bench_decode.run_mixed(op, B, cap, args.head_dim, dtype, dev, heads=args.heads,
                                                      kv_heads=args.kv_heads, seqlen_q=sq, variants=variants,
                                                      reps=args.reps, params=args.params, graphs=args.graphs)
                rows += got
                mixed.append(summary)
    extra = {}
    if len(args.sq) > 1:
        extra["sq_ratios"] = sq_ratios(rows, args.sq)
        for r in extra["sq_ratios"]:
            print(f"Sq {r['seqlen_q']} over Sq {r['over_seqlen_q']} GB/s: {r['impl']} B={r['batch']} "
                  f"L={r['cache_len']} d={r['head_dim']} {r['ratio']:.2f}×")
    lens = cache_len_ratios(rows, args.shape_list)
    if lens:
        extra["cache_len_ratios"] = lens
        for r in lens:
            print(f"time at L={r['cache_len']} over L={r['over_cache_len']}: {r['impl']} B={r['batch']} "
                  f"d={r['head_dim']} Sq={r['seqlen_q']} {r['time_ratio']:.2f}×")
    if args.mixed:
        extra["mixed"] = mixed
        for m in mixed:
            for name, x in m["ratios"].items():
                shown = "failed" if x is None else f"{x:.2f}×"
                print(f"mixed over uniform GB/s: {name} B={m['batch']} MAX={m['capacity']} Sq={m['seqlen_q']} "
                      f"({m['distribution']}, seed {m['seed']}, uniform length {m['uniform_length']}) {shown}")
    out = []
    for r in rows:
        d = r.as_dict()
        if r.impl.startswith("flashgen-mixed"):
            d["vs_uniform"] = next(iter(r.ratios.values()), None)
        elif r.impl.startswith("flashgen") and not r.impl.startswith("flashgen-uniform"):
            d["vs_read_only"] = r.ratios.get(bench_decode.READ_ONLY)
            d["vs_cudnn"] = r.ratios.get("sdpa-cudnn")
        out.append(d)
    if args.json:
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": out, **extra},
                                              indent=1) + "\n")
    ours = [r for r in rows if r.impl.startswith("flashgen")]
    if ours and not any(r.gbps for r in ours):
        print("bench_decode: every flashgen row failed (see the rows above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
