"""The ``flashgen`` command (also ``python -m flashgen``): generate, build, run, bench."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import bench, check, env, families, reference
from . import bench_decode as decode_bench
from . import explain as ex
from . import flops as flop_count
from .bench import time_fn
from .build import aot, cache
from .errors import FlashgenError
from .lang import ir
from .ops import TORCH_DTYPE, announce
from .ops import compile as fg_compile
from .params import example_params, parse_params
from .runtime.checks import ranges_text
from .tools import aot_build, generate
from .tune import tuner

DTYPE_ARG = {"fp16": ir.DType.FP16, "bf16": ir.DType.BF16, "fp32": ir.DType.FP32}


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default (where it has one and its text does not say it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or default is argparse.SUPPRESS \
                or "default" in text or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashgen", description="Compile attention-variant specs into fused "
                                "FlashAttention kernels for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", formatter_class=_Help, help="render specs into generated/<spec>/ (the committed reviewable sources)")
    g.add_argument("specs", nargs="+", type=Path)
    g.add_argument("--out", type=Path, default=Path("generated"), help="output root (default: generated)")

    b = sub.add_parser("build", formatter_class=_Help, help="compile a spec's kernels into the cache (prints paths and build time), or "
                       "with --out into an ahead-of-time directory (FLASHGEN_AOT_DIR)")
    b.add_argument("specs", nargs="+", type=Path)
    b.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu; with --arch, none)")
    b.add_argument("--dtype", nargs="+", choices=DTYPE_ARG, help="default: every dtype the spec allows")
    b.add_argument("--head-dim", nargs="+", type=int, help="CUDA head dims (default 64 128)")
    b.add_argument("--out", type=Path, help="write an ahead-of-time directory here (kernels, index.json, tuning/) "
                   "for processes run with FLASHGEN_AOT_DIR=DIR (and FLASHGEN_JIT=0)")
    b.add_argument("--arch", nargs="+", action="extend", help="CUDA architectures to build for (sm_80 sm_90a ...), with or "
                   "without that GPU here; implies CUDA")
    b.add_argument("--layouts", nargs="+", choices=("padded", "packed"), default=["padded"],
                   help="CUDA layouts (default padded; packed: varlen batches)")
    b.add_argument("--sparse", action="store_true", help="CUDA: also the block-sparse kernels (block_mask=) and "
                   "the block classifier")
    b.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: the decode kernels of op.with_kvcache too, one per dtype and head dim (default; "
                   "--no-decode: prefill kernels only). The CPU's decode runs in its forward kernels")

    r = sub.add_parser("run", formatter_class=_Help, help="run a spec on random inputs, check against the float64 reference, time it")
    r.add_argument("spec", type=Path, help="a .attn file")
    r.add_argument("--batch", type=int, default=2, help="batch size")
    r.add_argument("--heads", type=int, default=8, help="query heads")
    r.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: kv heads (default: --heads)")
    r.add_argument("--seqlen", type=int, default=1024, help="query length (and key length without --seqlen-k)")
    r.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    r.add_argument("--head-dim", type=int, default=64, help="head dimension")
    r.add_argument("--dtype", choices=DTYPE_ARG, default="bf16", help="input dtype")
    r.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    r.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="spec parameter (repeatable; default: example values, tensors drawn at random)")
    r.add_argument("--dropout-p", type=float, default=0.0,
                   help="dropout probability (specs that declare dropout; seed 0, checked with that mask)")
    r.add_argument("--reps", type=int, default=10, help="timed calls (median)")

    be = sub.add_parser("bench", formatter_class=_Help, help="time ours next to torch SDPA (and FlexAttention on "
                        "CUDA) in one run; with --decode, decode calls (op.with_kvcache) in GB/s next to SDPA and "
                        "a read-only ceiling")
    be.add_argument("spec", type=Path)
    be.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    be.add_argument("--dtype", choices=DTYPE_ARG, default=None, help="default bf16 on cuda, fp32 on cpu")
    be.add_argument("--seqlen", nargs="+", type=int,
                    help="default cpu: 1024 4096; cuda: 512 … 16384 (not with --decode)")
    be.add_argument("--head-dim", nargs="+", type=int, help="default cpu: 64; cuda: 64 128 (--decode on cuda: 128)")
    be.add_argument("--batch", type=int,
                    help="default cpu: 2; cuda: 16384 // seqlen (--decode on cuda: 131072 // cache length)")
    be.add_argument("--heads", type=int, help="default cpu: 8; cuda: 2048 // head_dim (--decode on cuda: 32)")
    be.add_argument("--peers", nargs="+", help="only these peers (cuda: " + " ".join(bench.PEERS["cuda"]) + "; cpu: "
                    + " ".join(bench.PEERS["cpu"]) + "; --decode: cuda " + " ".join(decode_bench.PEERS["cuda"])
                    + ", cpu " + " ".join(decode_bench.PEERS["cpu"]) + "; default: all)")
    be.add_argument("--reps", type=int, default=10, help="timed calls per implementation (median)")
    be.add_argument("--backward", action="store_true", help="time forward+backward instead of the forward")
    be.add_argument("--json", type=Path, help="also write the rows as JSON here")
    be.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="spec parameter")
    be.add_argument("--dropout-p", type=float, default=0.0,
                    help="dropout probability for ours and SDPA (specs that declare dropout); adds a "
                         "flashgen-p0 row (p = 0) for the overhead; FlexAttention has no dropout")
    be.add_argument("--block-mask", action="store_true",
                    help="also time ours given the spec's own block mask (flashgen.block_mask, block 128), built "
                         "once per shape outside the timing as FlexAttention's is: row flashgen-bm next to the "
                         "per-call row flashgen; adds nothing for specs without a mask")
    be.add_argument("--decode", action="store_true",
                    help="time decode calls (op.with_kvcache, every sequence holding --cache-len keys) instead of the "
                         "prefill: GB/s of the attended K and V bytes, next to SDPA on the same cache and a read-only "
                         "pass over the same bytes (row read-only: the ceiling on CUDA; on the CPU only a reference, as "
                         "torch.sum there does not reach the memory bandwidth)")
    be.add_argument("--cache-len", nargs="+", type=int, help="--decode: cached keys per sequence (default cpu: 1024 "
                    "4096; cuda: 1024 4096 8192 32768)")
    be.add_argument("--kv-heads", type=int, help="--decode: KV heads (default: --heads // 4 where 4 divides it, else "
                    "--heads)")
    be.add_argument("--sq", type=int, help="--decode: queries per sequence (default 1)")
    be.add_argument("--page-size", type=int, help="--decode: 0 a contiguous cache (default), else a paged one with "
                    "pages of this size (1 to 256, dividing every --cache-len) shuffled in the pool")
    be.add_argument("--num-splits", type=int, help="--decode: with_kvcache's num_splits (default 0: the family "
                    "chooses; 1 no split)")
    be.add_argument("--graphs", action="store_true", default=None,
                    help="--decode on CUDA: time each row's call as CUDA-graph replays (ours, the peers and the "
                         "read-only pass alike): the kernels' rate without the host's per-call work")

    tu = sub.add_parser("tune", formatter_class=_Help, help="time candidate CUDA tiles of a spec and store the fastest (later calls use it)")
    tu.add_argument("spec", type=Path)
    tu.add_argument("--seqlen", nargs="+", type=int, default=[1024, 4096, 16384],
                    help="sequence lengths to tune at (default 1024 4096 16384)")
    tu.add_argument("--head-dim", nargs="+", type=int, help="default: 64 128 (those the spec allows)")
    tu.add_argument("--dtype", choices=("bf16", "fp16"), default=None, help="default bf16 (if the spec allows it)")
    tu.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
    tu.add_argument("--kinds", nargs="+", choices=("fwd", "bwd"), default=None,
                    help="passes to tune, each apart (default: every pass the family tunes: fwd bwd, sm90 fwd)")
    tu.add_argument("--family", choices=("auto", *families.FAMILIES), default="auto",
                    help="whose tiles to tune: auto (each pass's family on this GPU: on Hopper the sm90 forward "
                         "and the sm80 backward), sm80 (both its passes) or sm90 (its forward)")
    tu.add_argument("--json", type=Path, help="also write the full results (every candidate's time) as JSON here")
    tu.add_argument("--reps", type=int, default=10, help="timed calls per candidate (median; default 10)")
    tu.add_argument("--max-candidates", type=int, default=None,
                    help="candidates per pass (default 8 forward, 6 backward; the default and derived tiles always)")
    tu.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: the CPU count)")
    tu.add_argument("--no-prebuild", action="store_true",
                    help="do not build the winners' instantiations now (then the first call builds them)")

    ex = sub.add_parser("explain", formatter_class=_Help, help="tiles, FLOPs, predicted HBM bytes (ours vs standard attention) and the "
                        "roofline floor of one call; optionally measured")
    ex.add_argument("spec", type=Path)
    ex.add_argument("--seqlen", type=int, required=True)
    ex.add_argument("--seqlen-k", type=int, default=None, help="default: --seqlen")
    ex.add_argument("--head-dim", type=int, required=True)
    ex.add_argument("--batch", type=int, default=1)
    ex.add_argument("--heads", type=int, default=1)
    ex.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: kv heads (default: --heads)")
    ex.add_argument("--dtype", choices=DTYPE_ARG, default=None,
                    help="default bf16, or the first dtype the spec allows on the target when not bf16")
    ex.add_argument("--arch", default=None, help="a CUDA architecture (e.g. sm_90a): tiles and peaks from the tables "
                    "(default: the live GPU, else this CPU)")
    ex.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    ex.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="spec parameter")
    ex.add_argument("--backward", action="store_true", help="forward + backward instead of the forward")
    ex.add_argument("--measure", action="store_true", help="also time the call on random inputs on the device")
    ex.add_argument("--reps", type=int, default=10, help="timed calls with --measure (median; default 10)")
    ex.add_argument("--build", action="store_true",
                    help="compile the CUDA kernels if not cached, for ptxas' register counts")
    ex.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    for cmd in (b, r, be, ex):  # (tune has a --family of its own: whose tiles it tunes)
        cmd.add_argument("--family", choices=tuple(families.FAMILIES), default=None,
                         help="force this kernel family (as FLASHGEN_FAMILY); a call it cannot serve fails "
                              "(default: the first family that serves each call)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if isinstance(getattr(args, "json", None), Path):  # before any work: a run that cannot write its rows
            _check_writable(args.json, "--json")
        # --family forces that kernel family for everything the command runs or builds (tune's
        # names the family whose tiles it tunes instead).
        forced = getattr(args, "family", None) if args.command != "tune" else None
        with families.use_family(forced, origin="--family"):
            return {"generate": cmd_generate, "build": cmd_build, "run": cmd_run, "bench": cmd_bench,
                    "tune": cmd_tune, "explain": cmd_explain}[args.command](args)
    except FlashgenError as e:
        print(f"flashgen: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, NotImplementedError, OSError, RuntimeError, AssertionError) as e:
        print(f"flashgen: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _check_writable(path: Path, option: str) -> None:
    """ValueError naming ``option`` unless ``path`` can be written: not a directory, its folder
    there, the file opened for appending (which leaves an existing file as it is)."""
    if str(path) in ("", ".") or path.is_dir():
        raise ValueError(f"{option}: {str(path)!r} is a directory (expected a file path)")
    if not path.parent.is_dir():
        raise ValueError(f"{option}: {path.parent} does not exist (expected a file in an existing folder)")
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{option}: cannot write {path}: {e.strerror or e}") from None


def _device(text: str, option: str = "--device", *, available: bool = True) -> torch.device:
    """``text`` as a torch device: ValueError naming ``option`` for text that names no device,
    a device type flashgen does not run on, or (``available``) CUDA where this torch or machine
    has none."""
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        hint = " (did you mean cuda?)" if text.strip().lower().startswith(("gpu", "nvidia")) else ""
        raise ValueError(f"{option} {text}: not a device; expected cpu or cuda[:N]{hint}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{option} {text}: flashgen runs on cpu or cuda[:N], not {dev.type}")
    if available and dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} {text}: CUDA is not available in this torch build or machine")
    return dev


def _drawn_index_error(op, given: dict, e: IndexError) -> ValueError:
    """A one-line error for a parameter read outside its shape, usually through an index drawn at
    random for an int tensor parameter: it names them and suggests --param."""
    drawn = [p.name for p in op.spec.params if p.is_tensor and p.dtype in ("i32", "i64") and p.name not in given]
    hint = (f"; the values of {', '.join(drawn)} were drawn at random (uniform in [0, seqlen_k]): give values in "
            f"range with --param {drawn[0]}=N" if drawn else "; give values in range with --param NAME=VALUE")
    return ValueError(f"--param: {e}{hint}")


# ---------------------------------------------------------------- generate


def cmd_generate(args) -> int:
    written = generate.generate(args.specs, args.out)
    for p in written:
        print(f"wrote {p}")
    print(f"{len(written)} file(s) changed under {args.out}")
    return 0


# ---------------------------------------------------------------- build


def cmd_build(args) -> int:
    console = Console(stderr=True)
    if args.device is not None:
        _device(args.device, available=False)  # a CUDA device without CUDA: aot_build says what to pass
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out: {args.out} exists and is not a directory")
    try:
        if args.out is not None or args.arch:
            return _build_aot(args, console)
        return _build_cache(args, console, torch, fg_compile)
    except ValueError as e:  # the API names its arguments; name the options instead
        text = str(e)
        for api, opt in (("dtypes:", "--dtype:"), ("head_dims:", "--head-dim:"), ("layouts:", "--layouts:"),
                         ("arch:", "--arch:"), ("device:", "--device:")):
            if text.startswith(api):
                raise ValueError(opt + text[len(api):]) from None
        raise


def _build_cache(args, console, torch, fg_compile) -> int:
    """``build`` into the kernel cache (no --out, no --arch)."""
    device = _device(args.device or "cpu")
    if device.type == "cpu" and (args.head_dim or args.layouts != ["padded"] or args.sparse):
        print("note: --head-dim, --layouts and --sparse apply to CUDA builds; the CPU kernels take the head dim, "
              "the layout and block masks at run time", file=sys.stderr)
    ops = [fg_compile(sp) for sp in args.specs]  # every spec parsed (a missing or bad one named) before any build
    for op in ops:
        dtypes = [DTYPE_ARG[d] for d in args.dtype] if args.dtype else None
        t0 = time.perf_counter()
        with console.status(f"building {op.spec.name} for {device} …"):
            insts = op.build(device, dtypes, args.head_dim, layouts=args.layouts,
                             sparse=(False, True) if args.sparse else (False,), decode=args.decode)
        dt = time.perf_counter() - t0
        for inst in insts:
            entry = env.cache_dir() / inst.name
            print(f"{inst.name}\n    {entry / 'lib.so'}")
        print(f"{op.spec.name}: {len(insts)} instantiation(s) ready in {dt:.1f} s")
    return 0


def _build_aot(args, console) -> int:
    """``build --out DIR`` (an ahead-of-time directory) or ``build --arch ...`` (into the cache)."""
    dtypes = [DTYPE_ARG[d] for d in args.dtype] if args.dtype else None
    sparse = (False, True) if args.sparse else (False,)
    where = args.out if args.out is not None else env.cache_dir()
    t0 = time.perf_counter()
    with console.status(f"building {len(args.specs)} spec(s) into {where} …"):
        if args.out is None:  # --arch without --out: into the cache
            planned = aot_build.plan(args.specs, device=args.device, arches=args.arch or (), dtypes=dtypes,
                               head_dims=args.head_dim, layouts=args.layouts, sparse=sparse, decode=args.decode)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=len(planned) or 1) as pool:
                list(pool.map(lambda p: cache.load_cached(p.inst, announce), planned))
            rows = [(p.inst.spec.name, p.inst.name, aot.describe_instantiation(p.inst)) for p in planned]
        else:
            entries = aot_build.build_dir(args.specs, args.out, device=args.device, arches=args.arch or (),
                                    dtypes=dtypes, head_dims=args.head_dim, layouts=args.layouts, sparse=sparse,
                                    decode=args.decode, announce=announce)
            rows = [(e["spec"], e["artifact"], aot.describe(e["spec"], e["target"], e["dtype"], e["head_dim"],
                                                            e["config"])) for e in entries]
    dt = time.perf_counter() - t0
    counts: dict[str, int] = {}
    for spec, artifact, text in rows:
        counts[spec] = counts.get(spec, 0) + 1
        print(f"{artifact}\n    {where / artifact / 'lib.so'}\n    {text}")
    for spec, n in counts.items():
        print(f"{spec}: {n} instantiation(s) ready")
    if args.out is not None:
        index = json.loads((args.out / aot.INDEX).read_text())
        print(f"wrote {args.out / aot.INDEX} ({len(index['entries'])} kernel(s) in all)")
        for t in sorted((args.out / "tuning").glob("*.json")):
            print(f"tuning: {t}")
        print(f"use it with: FLASHGEN_AOT_DIR={args.out} (add FLASHGEN_JIT=0 to forbid compiling)")
    print(f"done in {dt:.1f} s")
    return 0


# ---------------------------------------------------------------- run




def cmd_run(args) -> int:
    for name in ("batch", "heads", "seqlen", "head_dim", "reps"):
        if getattr(args, name) < (1 if name in ("heads", "reps") else 0):
            raise ValueError(f"--{name.replace('_', '-')}: {getattr(args, name)} is out of range")
    if args.kv_heads is not None and args.kv_heads < 1:
        raise ValueError(f"--kv-heads: {args.kv_heads} is out of range (expected ≥ 1)")
    if args.seqlen_k is not None and args.seqlen_k < 0:
        raise ValueError(f"--seqlen-k: {args.seqlen_k} is out of range")
    device = _device(args.device)
    op = fg_compile(args.spec)
    given = parse_params(op.spec, args.param)
    try:
        return _run(args, op, given, device)
    except IndexError as e:  # a parameter read outside its shape: a usage error (exit 2), not a traceback
        raise _drawn_index_error(op, given, e) from None


def _run(args, op, given: dict, device: torch.device) -> int:
    dtype = TORCH_DTYPE[DTYPE_ARG[args.dtype]]
    hkv = args.kv_heads or args.heads
    nk = args.seqlen if args.seqlen_k is None else args.seqlen_k
    q = torch.randn(args.batch, args.heads, args.seqlen, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, hkv, nk, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    params = example_params(op.spec, args.batch, args.heads, args.seqlen, nk, device, **given)
    drop = {"dropout_p": args.dropout_p, "dropout_seed": 0} if args.dropout_p else {}
    reference.check_reads(op.spec, args.batch, args.heads, args.seqlen, nk, **params)  # before any build
    shown = " ".join(f"{n}={x if not isinstance(x, torch.Tensor) else tuple(x.shape)}" for n, x in params.items())
    print(f"{op.name}: batch={args.batch} heads={args.heads} kv_heads={hkv} seqlen_q={args.seqlen} "
          f"seqlen_k={nk} head_dim={args.head_dim} dtype={args.dtype} device={device}"
          + (f" params: {shown}" if shown else "") + (f" dropout_p={args.dropout_p}" if drop else ""))
    t0 = time.perf_counter()
    with torch.no_grad():
        out, lse = op(q, k, v, return_lse=True, **drop, **params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    first = time.perf_counter() - t0
    print(f"first call (build or cache load included): {first:.2f} s")
    cpu_params = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in params.items()}
    cmp = check.compare(op.spec, q.cpu(), k.cpu(), v.cpu(), out.cpu(), lse.cpu(), **drop, **cpu_params)
    print(f"check against float64 reference: {cmp}")
    with torch.no_grad():
        ms = time_fn(lambda: op(q, k, v, **drop, **params), device, reps=args.reps)
    flops = flop_count.call_flops(op.spec, args.seqlen, nk, args.head_dim, batch=args.batch, heads=args.heads,
                                  **cpu_params)
    print(f"time: {ms:.3f} ms   {flops / ms / 1e6:.1f} GFLOP/s ({flops / ms / 1e9:.2f} TFLOP/s)")
    return 0 if cmp.ok else 1


# ---------------------------------------------------------------- bench


_DECODE_ONLY = {"cache_len": "--cache-len", "kv_heads": "--kv-heads", "sq": "--sq", "page_size": "--page-size",
                "num_splits": "--num-splits", "graphs": "--graphs"}


def cmd_bench(args) -> int:
    if not args.decode:
        for name, option in _DECODE_ONLY.items():
            if getattr(args, name) is not None:
                raise ValueError(f"{option}: applies with --decode only")
    else:
        for given, option, why in ((args.backward, "--backward", "decode calls are inference only"),
                                   (args.block_mask, "--block-mask", "decode calls take no block mask"),
                                   (args.dropout_p, "--dropout-p", "decode calls apply no dropout"),
                                   (args.seqlen is not None, "--seqlen", "the cache lengths are --cache-len")):
            if given:
                raise ValueError(f"{option}: not with --decode ({why})")
    device = _device(args.device)
    if args.decode:
        return _bench_decode(args, device)
    try:
        bench.check_include(args.peers, device, args.dropout_p)
    except ValueError as e:
        raise ValueError("--peers:" + str(e).removeprefix("include:")) from None
    op = fg_compile(args.spec)
    dtype = DTYPE_ARG[args.dtype] if args.dtype else (ir.DType.BF16 if device.type == "cuda" else ir.DType.FP32)
    allowed = op.head_dims(device.type)
    for d in args.head_dim or ():  # before any timing, rather than a failed row per shape
        if d not in allowed:
            raise ValueError(f"--head-dim: {d} is not served for spec '{op.spec.name}' on {device.type} (expected "
                             f"one of {ranges_text(allowed)})")
    shapes = bench.default_shapes(device, args.head_dim, args.seqlen, args.batch, args.heads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# {op.name} {'forward+backward' if args.backward else 'forward'} on {where}, torch {torch.__version__}, {dtype.value}, "
          f"threads={torch.get_num_threads()}")
    given = parse_params(op.spec, args.param)
    if args.dropout_p and not op.spec.dropout:
        raise ValueError(f"--dropout-p {args.dropout_p}: spec '{op.spec.name}' declares no dropout; add a line "
                         "`dropout` to the spec to enable it")
    sparse = (False, True) if args.block_mask and op.spec.mask is not None else (False,)
    op.build(device, [dtype], sorted({s[3] for s in shapes}) if device.type == "cuda" else None, sparse=sparse,
             decode=False)  # prefill only (--decode times with_kvcache, built at its first call)
    try:
        rows = bench.run(op, shapes, dtype, device, reps=args.reps, include=set(args.peers) if args.peers else None,
                         backward=args.backward, params=given, dropout_p=args.dropout_p, block_mask=args.block_mask)
    except IndexError as e:
        raise _drawn_index_error(op, given, e) from None
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    return 0


def _bench_decode(args, device: torch.device) -> int:
    """``bench --decode``: flashgen.bench_decode.run on the options' shapes."""
    try:
        decode_bench.check_peers(args.peers, device)
    except ValueError as e:
        raise ValueError("--peers:" + str(e).removeprefix("include:")) from None
    for name in ("batch", "heads", "kv_heads", "sq", "reps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: {value} is out of range (expected ≥ 1)")
    for name in ("cache_len", "head_dim"):
        if any(n < 1 for n in getattr(args, name) or ()):
            raise ValueError(f"--{name.replace('_', '-')}: expected positive values, got {getattr(args, name)}")
    heads, kv_heads = decode_bench.default_heads(device, args.heads, args.kv_heads)
    if heads % kv_heads:
        raise ValueError(f"--kv-heads: {kv_heads} does not divide {heads} query heads (--heads)")
    shapes = decode_bench.default_shapes(device, args.head_dim, args.cache_len, args.batch)
    sq, page_size, splits = args.sq or 1, args.page_size or 0, args.num_splits or 0
    if sq > min(L for _, L, _ in shapes):
        raise ValueError(f"--sq: {sq} queries exceed the shortest cache length {min(L for _, L, _ in shapes)}")
    if not 0 <= page_size <= 256 or any(page_size and L % page_size for _, L, _ in shapes):
        raise ValueError(f"--page-size: {page_size} must be 0 (contiguous) or 1 to 256 dividing every --cache-len")
    if splits < 0:
        raise ValueError(f"--num-splits: {splits} is out of range (expected ≥ 0: 0 chooses, 1 no split)")
    op = fg_compile(args.spec)
    dtype = DTYPE_ARG[args.dtype] if args.dtype else (ir.DType.BF16 if device.type == "cuda" else ir.DType.FP32)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# {op.name} decode (Sq={sq}, " + (f"paged {page_size}" if page_size else "contiguous cache")
          + f", num_splits {splits}) on {where}, torch {torch.__version__}, {dtype.value}, "
          f"threads={torch.get_num_threads()}; GB/s: K and V bytes of the attended positions per second")
    given = parse_params(op.spec, args.param)
    try:
        rows = decode_bench.run(op, shapes, dtype, device, heads=heads, kv_heads=kv_heads, seqlen_q=sq,
                                variants=((page_size, splits),), reps=args.reps,
                                include=set(args.peers) if args.peers else None, params=given,
                                graphs=bool(args.graphs))
    except IndexError as e:
        raise _drawn_index_error(op, given, e) from None
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=1))
    return 0


# ---------------------------------------------------------------- tune


def cmd_tune(args) -> int:
    device = _device(args.device, available=False)
    if device.type != "cuda":
        raise ValueError(f"--device {args.device}: tuning times CUDA kernels (expected cuda or cuda:N)")
    if args.family != "auto" and families.get(args.family).tuning is None:
        tunable = " ".join(n for n, f in families.FAMILIES.items() if f.tuning is not None)
        raise ValueError(f"--family {args.family}: family {args.family} has no tunable pass (it chooses its tiles per "
                         f"call); expected auto or one of: {tunable}")
    if not torch.cuda.is_available():
        raise ValueError("--device: CUDA is not available in this torch build or machine (tuning needs a GPU)")
    for name in ("reps", "max_candidates", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: {value} is out of range (expected ≥ 1)")
    if any(n < 1 for n in args.seqlen):
        raise ValueError(f"--seqlen: expected positive lengths, got {args.seqlen}")
    op = fg_compile(args.spec)
    allowed = op.dtypes("cuda")
    dtype = DTYPE_ARG[args.dtype] if args.dtype else (ir.DType.BF16 if ir.DType.BF16 in allowed else allowed[0])
    head_dims = args.head_dim or [d for d in (64, 128) if d in op.head_dims("cuda")] or [op.head_dims("cuda")[0]]
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:  # the family of each pass, checked before anything is compiled
        fams = tuner.tuning_families(op, index, dtype, head_dims[0], args.kinds, args.family)
    except ValueError as e:
        name, _, rest = str(e).partition(":")
        option = {"family": f"--family {args.family}", "kinds": "--kinds"}.get(name)
        raise ValueError(f"{option}:{rest}" if option else str(e)) from None
    kinds = tuple(fams)
    gpu = torch.cuda.get_device_name(device)
    print(f"# tuning {op.name} on {gpu}: {dtype.value}, head dims {' '.join(map(str, head_dims))}, seqlens "
          f"{' '.join(map(str, sorted(set(args.seqlen))))}, "
          + " and ".join(f"{k} ({f.name})" for k, f in fams.items()))
    console = Console(stderr=True)
    labels = {"compile": "compiling candidates", "time": "timing", "prebuild": "building winners"}
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[detail]}"), console=console) as bar:
        tasks: dict = {}

        def progress(stage: str, done: int, total: int, detail: str) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(labels.get(stage, stage), total=total, detail="")
            bar.update(tasks[stage], completed=done, total=total, detail=detail)

        results = tuner.tune_many(op, device, dtype, head_dims, args.seqlen, kinds, progress,
                                 limit=args.max_candidates, reps=args.reps, jobs=args.jobs,
                                 prebuild=not args.no_prebuild, family=args.family)
    wall = time.perf_counter() - t0
    table = Table(title=f"{op.spec.name} on {gpu} ({dtype.value})")
    for col in ("d", "pass", "family", "seqlen", "default", "ms", "TFLOP/s", "winner", "ms", "TFLOP/s", "speedup"):
        table.add_column(col, justify="left" if col in ("pass", "family", "default", "winner") else "right")
    ok = True

    def num(x, fmt):
        return format(x, fmt) if x is not None else "—"

    for res in results:
        for kind in kinds:
            fam = res.get("families", {}).get(kind, "—")
            for n, e in sorted(res.get(kind, {}).items()):
                if "winner" not in e:
                    ok = False
                    table.add_row(str(res["head_dim"]), kind, fam, str(n), e.get("default", "—"), "", "",
                                  f"[red]{e.get('error', 'failed')}[/red]", "", "", "")
                    continue
                speed = e["default_ms"] / e["ms"] if e.get("default_ms") else None
                table.add_row(str(res["head_dim"]), kind, fam, str(n), e["default"], num(e["default_ms"], ".3f"),
                              num(e["default_tflops"], ".1f"), e["winner"], num(e["ms"], ".3f"),
                              num(e["tflops"], ".1f"), num(speed, ".2f") + ("×" if speed else ""))
    out = Console()
    (out if out.is_terminal else Console(width=160)).print(table)  # a pipe: no truncated cells
    stores = sorted({r["store"] for r in results if r.get("store")})
    print(f"stored in {', '.join(stores) if stores else '(nothing stored)'}")
    print(f"tuning took {wall:.1f} s (compiling {results[0]['compile_s']:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


# ---------------------------------------------------------------- explain

# explain()'s argument names → the options that set them (error messages name the option).
_EXPLAIN_OPTIONS = {"seqlen_q": "--seqlen", "seqlen_k": "--seqlen-k", "head_dim": "--head-dim", "batch": "--batch",
                    "heads": "--heads", "kv_heads": "--kv-heads", "dtype": "--dtype", "arch": "--arch",
                    "device": "--device", "params": "--param", "measure": "--measure", "build": "--build"}


def cmd_explain(args) -> int:
    if args.reps < 1:
        raise ValueError(f"--reps: {args.reps} is out of range (expected ≥ 1)")
    try:
        rep = ex.explain(args.spec, args.seqlen, args.seqlen_k, head_dim=args.head_dim, batch=args.batch,
                         heads=args.heads, kv_heads=args.kv_heads, dtype=args.dtype, arch=args.arch,
                         device=args.device, params=args.param, backward=args.backward, measure=args.measure,
                         build=args.build, reps=args.reps)
    except (ValueError, TypeError) as e:
        name, sep, rest = str(e).partition(":")
        if sep and name in _EXPLAIN_OPTIONS:
            raise type(e)(f"{_EXPLAIN_OPTIONS[name]}:{rest}") from None
        raise
    except IndexError as e:  # a parameter indexed out of its bounds: a usage error (exit 2), not a traceback
        raise ValueError(f"--param: {e}") from None
    if args.json:
        print(ex.to_json(rep))
    else:
        ex.render(rep)
    return 0
