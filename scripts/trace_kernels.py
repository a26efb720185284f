#!/usr/bin/env python3
"""Where one call's time goes, kernel by kernel: ``torch.profiler`` over a few steps of flashgen
(as a user calls it, and given the spec's block mask) and of peers, at one shape, printing each
implementation's table of device kernels (and host operators) sorted by device time.

    python3 scripts/trace_kernels.py --spec document --seqlen 4096 [--head-dim 128] [--backward]
        [--impls flashgen,flashgen-bm,flex] [--param NAME=VALUE ...] [--steps 3] [--device cuda]
    python3 scripts/trace_kernels.py --spec sliding_window --decode 1x4096,1x32768 --param window=4096
        [--heads 32 --kv-heads 8] [--sq 1]

Prefill shapes follow ``flashgen bench`` (bf16 on CUDA, fp32 on the CPU; B = max(1, 16384 // N),
H 16; example parameters of flashgen.params.example_params with ``--param`` overrides). A step
is one forward, or with ``--backward`` one forward and the gradients of q, k, v for a random
dout. ``flashgen-bm`` is the op given ``flashgen.block_mask`` of the spec (block size 128),
built before the trace. ``--decode BxL,...``: one ``op.with_kvcache`` call per step (``--sq`` queries, a
contiguous cache of L slots with L - 1 keys cached, H ``--heads`` / ``--kv-heads``, parameters
sized for positions up to L as with_kvcache takes them) per shape;
``--impls`` is then ignored. Each table comes after ``--warmup`` untraced steps; the line above
it gives the median wall time of a step measured with a device synchronisation around each of
``--steps`` steps (outside the trace, no cache flush: a diagnostic, not a benchmark figure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import bench, bench_decode, paths  # noqa: E402
from flashgen import params as fg_params  # noqa: E402

IMPLS = ("flashgen", "flashgen-bm", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "sdpa", "eager")


def options(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--spec", default="causal", help="a spec name in specs/, or a .attn file")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim of q, k, v")
    ap.add_argument("--seqlen", type=int, default=4096,
                    help="N of a prefill step (batch 16384 // N, 16 heads, as flashgen bench)")
    ap.add_argument("--backward", action="store_true", help="forward and backward per step")
    ap.add_argument("--impls", default="flashgen,flashgen-bm,flex",
                    help=f"comma-separated, of {', '.join(IMPLS)} (peers unavailable here are reported and skipped)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--decode", type=bench_decode.shape_list, default=None, metavar="BxL,...",
                    help="trace op.with_kvcache at these batch x cache shapes instead")
    ap.add_argument("--heads", type=int, default=32, help="query heads of --decode")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of --decode")
    ap.add_argument("--sq", type=int, default=1, help="queries per sequence of --decode (the last Sq positions)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps, then traced steps")
    ap.add_argument("--warmup", type=int, default=5, help="untraced steps first")
    ap.add_argument("--rows", type=int, default=12, help="table rows per implementation")
    ap.add_argument("--device", default="cuda", help="cpu or cuda[:N]")
    a = ap.parse_args(argv)
    a.impl_list = [x for x in a.impls.split(",") if x]
    if not a.impl_list:
        ap.error(f"argument --impls: expected at least one of {', '.join(IMPLS)}")
    bad = [x for x in a.impl_list if x not in IMPLS]
    if bad:
        ap.error(f"argument --impls: unknown implementation {bad[0]!r} (expected some of {', '.join(IMPLS)})")
    for name in ("head_dim", "seqlen", "steps", "heads", "kv_heads", "rows", "sq"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        ap.error(f"argument --warmup: expected >= 0, got {a.warmup}")
    if a.heads % a.kv_heads:
        ap.error(f"argument --kv-heads: {a.kv_heads} does not divide {a.heads} query heads (--heads)")
    try:
        a.op = flashgen.compile(paths.example_spec(a.spec))
    except ValueError as e:
        ap.error(f"argument --spec: {e}")
    try:
        a.params = fg_params.parse_params(a.op.spec, a.param)
    except ValueError as e:
        ap.error(f"argument {e}")
    try:
        a.dev = torch.device(a.device)
    except (RuntimeError, ValueError):
        a.dev = None
    if a.dev is None or a.dev.type not in ("cpu", "cuda"):
        ap.error(f"argument --device: expected cpu or cuda[:N], got {a.device!r}")
    if a.dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("argument --device: cuda is not available here")
    dims = a.op.head_dims(a.dev.type)
    if a.head_dim not in dims:
        shown = ", ".join(map(str, dims)) if len(dims) <= 6 else f"{dims[0]}, {dims[1]}, ..., {dims[-1]}"
        ap.error(f"argument --head-dim: {a.head_dim} is not a head dim of spec '{a.op.spec.name}' on "
                 f"{a.dev.type} (it takes {shown or 'none'})")
    return a


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def trace(name: str, step, a: argparse.Namespace) -> None:
    """Warm-up, timed steps, then the traced steps and the table."""
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        sync(a.dev)
        t0 = time.perf_counter()
        step()
        sync(a.dev)
        times.append((time.perf_counter() - t0) * 1e3)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            step()
        sync(a.dev)
    key = "cuda_time_total" if a.dev.type == "cuda" else "cpu_time_total"
    print(f"=== {name}: {a.steps} step(s), median {statistics.median(times):.3f} ms a step (synchronised, no flush)")
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=72))


def prefill(a: argparse.Namespace) -> None:
    op, dev, n, d = a.op, a.dev, a.seqlen, a.head_dim
    b, h = max(1, 16384 // n), 16
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    pv = fg_params.example_params(op.spec, b, h, n, n, dev, gen, **a.params)
    if a.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    peers = bench.peers(op.spec, dev)
    print(f"# {op.name} B={b} H={h} N={n} d={d} {str(dtype).removeprefix('torch.')} "
          f"{'forward+backward' if a.backward else 'forward'} on {dev}")
    for name in a.impl_list:
        if name == "flashgen":
            def fn():
                return op(q, k, v, **pv)
        elif name == "flashgen-bm":
            if op.spec.mask is None:
                print(f"=== {name}: skipped (the spec has no mask)")
                continue
            bm = flashgen.block_mask(op, n, n, batch=b, heads=h, block_size=128, device=dev, **pv)

            def fn(bm=bm):
                return op(q, k, v, block_mask=bm, **pv)
        else:
            peer = peers.get(name)
            if peer is None:
                print(f"=== {name}: skipped (not available here)")
                continue

            def fn(peer=peer):
                return peer(q, k, v, pv)
        if a.backward:
            def step(fn=fn):
                torch.autograd.grad(fn(), (q, k, v), dout)
        else:
            def step(fn=fn):
                with torch.no_grad():
                    fn()
        trace(name, step, a)


def decode(a: argparse.Namespace) -> None:
    op, dev, d = a.op, a.dev, a.head_dim
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for B, L in a.decode:
        gen = torch.Generator(device=dev).manual_seed(0)
        kc, vc = (torch.randn(B, a.kv_heads, L, d, device=dev, dtype=dtype, generator=gen) for _ in range(2))
        q = torch.randn(B, a.heads, a.sq, d, device=dev, dtype=dtype, generator=gen)
        lens = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
        pv = fg_params.example_params(op.spec, B, a.heads, L, L, dev, gen, **a.params)  # positions up to L
        print(f"# {op.name} decode B={B} cache={L} Sq={a.sq} H={a.heads}/{a.kv_heads} d={d} on {dev}")

        def step():
            op.with_kvcache(q, kc, vc, cache_seqlens=lens, **pv)
        trace(f"with_kvcache B={B} L={L} Sq={a.sq}", step, a)


def main(argv=None) -> int:
    a = options(argv)
    try:
        if a.decode:
            decode(a)
        else:
            prefill(a)
    except (TypeError, ValueError) as e:  # the op refused an argument (a parameter value, a shape)
        print(f"trace_kernels.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
