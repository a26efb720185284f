"""The autotuner: measures tile candidates of an op on a GPU and records the fastest in the
tuning store (flashgen.tune.store).

``tune_op`` / ``tune_many`` (``flashgen tune``), and ``ensure_tuned`` for FLASHGEN_AUTOTUNE=1: per
(spec, GPU, dtype, head dim) it compiles the kernel family's candidate tiles of the forward and of
the backward apart (``family.tuning.candidates``: the default, the derived tile, table rows, a
small grid of legal shapes; pruned by shared memory before compiling and by the compiler's spill
report after, flashgen.tune.resources), in parallel, then times each on the GPU at each sequence
length (flashgen.tune.timing: CUDA events, median, inputs rotated past the L2) and records the
fastest. A failing candidate scores infinite.

The op runtime does not import this module: importing it plugs ``ensure_tuned`` into
the op runtime (``runtime.op.plug_first_use_tuner``; flashgen/__init__.py imports this module).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from .. import env, families, ops, tiles
from ..build import artifact
from ..lang import ir
from ..runtime import loader
from ..runtime import op as runtime_op
from . import resources, store, timing
from .resources import KernelResources

KINDS = ("fwd", "bwd")
SPILL_LIMIT = 256  # bytes of local memory per thread (spills) beyond which a candidate is not timed
MARGIN = 0.01  # another tile must beat the default by this fraction to win (timing noise)


# ---------------------------------------------------------------- compiling candidates


@dataclass
class Candidate:
    """One tile of one kind being tuned: its instantiation (built alone: config fwd_only or
    bwd_only), roles ('default', 'derived', 'table'), and what building and timing found."""

    kind: str
    tile: object
    roles: tuple[str, ...]
    inst: object
    lib: object = None
    resources: KernelResources | None = None
    error: str | None = None  # build or run failure: scores infinite
    pruned: str | None = None  # not timed (spills)
    build_s: float = 0.0

    @property
    def protected(self) -> bool:
        """The default and the derived/table tiles are always timed (unless they fail)."""
        return bool(self.roles)

    def row(self, ms: float, flops: float | None) -> dict:
        ok = math.isfinite(ms)
        return {"tile": str(self.tile), "roles": list(self.roles), "ms": ms if ok else None,
                "tflops": (flops / ms / 1e9) if ok and flops else None,
                "regs": self.resources.regs if self.resources else None,
                "local": self.resources.local_bytes if self.resources else None,
                **({"error": self.error} if self.error else {}), **({"pruned": self.pruned} if self.pruned else {})}


def _roles(tile, refs: dict) -> tuple[str, ...]:
    return tuple(r for r in ("default", "derived", "table") if refs.get(r) == tile)


def _compile(cands: list[Candidate], jobs: int | None, progress) -> float:
    """Build every candidate in parallel (one nvcc process each); fills lib / error / resources /
    pruned. Returns the wall time (s)."""
    def one(c: Candidate) -> Candidate:
        t0 = time.perf_counter()
        try:
            c.lib = loader.load(c.inst)
        except Exception as e:  # noqa: BLE001 - BuildError, or no compiler (FLASHGEN_JIT=0): infinite
            c.error = f"build failed: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
            return c
        finally:
            c.build_s = time.perf_counter() - t0
        c.resources = resources.main_kernel(resources.resource_usage(c.lib.path, c.inst.target.arch), c.kind)
        if c.resources is not None and c.resources.local_bytes > SPILL_LIMIT and not c.protected:
            c.pruned = f"spills: {c.resources.local_bytes} bytes of local memory per thread"
        return c

    t0 = time.perf_counter()
    todo = list({id(c): c for c in cands}.values())
    timing.report(progress, "compile", 0, len(todo), "")
    workers = max(1, min(len(todo), jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, c) for c in todo]
        for i, f in enumerate(as_completed(futures), 1):
            c = f.result()
            timing.report(progress, "compile", i, len(todo), f"{c.kind} {c.tile}" + (" (failed)" if c.error else ""))
    return time.perf_counter() - t0


# ---------------------------------------------------------------- tuning


def tune_op(op, device, dtype, head_dim: int, seqlens, kinds=KINDS, progress=True, **kw) -> dict:
    """Tune ``op``'s CUDA tiles for one head dim; see ``tune_many`` (this is its one-head-dim
    form) for the arguments, the result and the errors. Returns that head dim's result dict."""
    return tune_many(op, device, dtype, [head_dim], seqlens, kinds, progress, **kw)[0]


def tune_many(op, device, dtype, head_dims, seqlens, kinds=KINDS, progress=True, *, limit: int | None = None,
              reps: int = 10, tokens: int | None = None, jobs: int | None = None, save: bool = True,
              prebuild: bool = False) -> list[dict]:
    """Measure candidate tiles (the kernel family's ``tuning.candidates``) of ``op`` on a CUDA
    ``device`` and store the fastest per (kind, head dim, seqlen).

    For each head dim, the candidates of each kind are compiled once (all head dims and kinds
    in one pool of ``jobs`` parallel builds, default os.cpu_count()), those that spill heavily
    (cuobjdump's report, over SPILL_LIMIT bytes) are pruned unless they are the default/derived/
    table tiles, and the rest are timed at each sequence length in ``seqlens`` on q, k, v (and
    dout) of shape [B, H, N, d] with B = max(1, tokens // N) (``tokens`` default
    timing.TOKENS = 16384), H = max(1, 2048 // d), random spec
    parameters (flashgen.params), several input sets rotated between repeats so together they
    exceed twice the L2: CUDA events, median of ``reps``. The backward is timed apart from the
    forward and includes everything ``AttentionOp._backward`` launches. A candidate that fails to
    build or run, or whose output differs from the default tile's beyond round-off, scores
    infinite. The winner (the default unless another is MARGIN faster) is recorded in the store
    with its timings (``save``; ``store.record``); ``prebuild`` then compiles (or loads) the
    instantiations calls at the tuned lengths will use, so their first use compiles nothing.

    Args:
        op: an AttentionOp, or a spec path/text (flashgen.compile).
        device: a CUDA device ('cuda', 'cuda:1', torch.device).
        dtype: bf16 or fp16 (flashgen, torch or spelled).
        head_dims: head dims to tune; seqlens: sequence lengths (max(seqlen_q, seqlen_k)).
        kinds: 'fwd' and/or 'bwd'.
        progress: True (a line on stderr per finished stage), False, or a callable
            ``progress(stage, done, total, detail)`` with stage 'compile' or 'time'.
        limit: cap on candidates per kind (default the family's tuning.fwd_limit / bwd_limit).
        reps: timed calls per candidate (median); jobs: parallel builds; save: record winners.

    Returns one dict per head dim: spec, fingerprint, gpu, arch, dtype, head_dim, store (the
    file written, or None), wall seconds compile_s (the shared compile phase), time_s (this head
    dim's timing), prebuild_s and total_s (the whole run), and per kind a dict seqlen →
    {winner, config, ms, tflops, default, default_ms, default_tflops, shape [B, H, N, d],
    candidates: [{tile, roles, ms, tflops, regs, local, error?, pruned?}]} (ms in
    milliseconds, None where a candidate failed or was pruned; tflops in TFLOP/s; regs per
    thread and local bytes per thread from the resource report, None where unknown), or
    {error, ...} where no candidate ran.

    Raises:
        ValueError: no CUDA device, a device that is not CUDA, or a dtype / head dim / kind /
            seqlen the spec or the CUDA family does not take.
    """
    if not isinstance(op, ops.AttentionOp):
        op = ops.compile(op)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: the tuner times CUDA kernels, got '{device}'")
    if not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available in this torch build or machine (tuning needs a GPU)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    dtype = ops.as_dtype(dtype)
    if dtype not in op.dtypes("cuda"):
        raise ValueError(f"dtype: {dtype.value} is not supported by spec '{op.spec.name}' on cuda "
                         f"(expected one of {', '.join(d.value for d in op.dtypes('cuda'))})")
    head_dims = [int(h) for h in head_dims]
    for hd in head_dims:
        if hd not in op.head_dims("cuda"):
            raise ValueError(f"head_dim: {hd} is not supported by spec '{op.spec.name}' on cuda")
    seqlens = sorted({int(n) for n in seqlens})
    if not seqlens or seqlens[0] < 1:
        raise ValueError(f"seqlens: expected positive sequence lengths, got {seqlens}")
    fam = families.for_arch("cuda", artifact.cuda_arch_of(index))
    if fam.tuning is None:
        raise ValueError(f"family: {fam.name} has no tuning candidates (its tiles are not tuned)")
    kinds = tuple(dict.fromkeys(kinds))
    for k in kinds:
        fam.tuning.check_kind(k)
    tokens = tokens or timing.TOKENS
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    target = fam.device_target(index)
    info = tiles.device_info(index)
    plans: dict[int, dict[str, list[Candidate]]] = {}
    helpers: dict[int, Candidate] = {}  # the default forward, for the backward's out and lse
    for hd in head_dims:
        plans[hd] = {}
        for kind in kinds:
            refs = fam.tuning.reference_tiles(op.spec, target.arch, hd, kind, info)
            plans[hd][kind] = [Candidate(kind, t, _roles(t, refs),
                                         fam.tuning.instantiation(op.spec, target.arch, dtype, hd, t, kind, info))
                               for t in fam.tuning.candidates(op.spec, target.arch, hd, kind, info, limit)]
        if "bwd" in kinds:
            default_fwd = fam.tuning.reference_tiles(op.spec, target.arch, hd, "fwd", info)["default"]
            helpers[hd] = next((c for c in plans[hd].get("fwd", []) if "default" in c.roles), None) or Candidate(
                "fwd", default_fwd, ("default",),
                fam.tuning.instantiation(op.spec, target.arch, dtype, hd, default_fwd, "fwd", info))
    every = [c for hd in head_dims for k in kinds for c in plans[hd][k]] + list(helpers.values())
    compile_s = _compile(every, jobs, progress)
    results = []
    total = sum(len(plans[hd][k]) for hd in head_dims for k in kinds) * len(seqlens)
    step = [0, total]
    t_time = time.perf_counter()
    for hd in head_dims:
        t0 = time.perf_counter()
        res: dict = {"spec": op.spec.name, "fingerprint": op.fingerprint, "gpu": info.name, "arch": target.arch,
                     "dtype": dtype.value, "head_dim": hd, "store": None, "compile_s": round(compile_s, 2)}
        for kind in kinds:
            res[kind] = {}
            cands = plans[hd][kind]
            for n in seqlens:
                helper = helpers.get(hd)
                if kind == "bwd" and (helper is None or helper.lib is None):
                    res[kind][n] = {"error": "the default forward did not build: no out/lse to time the backward"}
                    step[0] += len(cands)
                    continue
                try:
                    w = timing.workload(op, device, dtype, hd, n, kind, tokens, helper.lib if helper else None,
                                  info.l2_bytes)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    res[kind][n] = {"error": "out of GPU memory for the inputs"}
                    step[0] += len(cands)
                    continue
                with torch.cuda.device(device):
                    ms = timing.time_kind(op, w, cands, device, reps, progress, step)
                flops = w.flops
                rows = [c.row(m, flops) for c, m in zip(cands, ms, strict=True)]
                for c in cands:  # a run failure is per seqlen; the next length tries again
                    if c.error and c.lib is not None:
                        c.error = None
                entry = _winner(cands, ms, rows, flops)
                entry["shape"] = [w.B, w.H, w.N, w.d]
                res[kind][n] = entry
                if save and "config" in entry:
                    path = store.record(op.fingerprint, index, dtype, hd, kind, n, entry["config"], {
                        "ms": entry["ms"], "tflops": entry["tflops"], "default": entry["default"],
                        "default_ms": entry["default_ms"], "shape": entry["shape"], "candidates": rows,
                        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                    res["store"] = str(path)
                del w
        res["time_s"] = round(time.perf_counter() - t0, 2)
        results.append(res)
    torch.cuda.empty_cache()
    t_pre = time.perf_counter()
    if save and prebuild:
        _prebuild(op, device, dtype, head_dims, seqlens, jobs, progress)
    for res in results:
        res["prebuild_s"] = round(time.perf_counter() - t_pre, 2)
        res["total_s"] = round(compile_s + (time.perf_counter() - t_time), 2)
    return results


def _winner(cands: list[Candidate], ms: list[float], rows: list[dict], flops) -> dict:
    default = next(i for i, c in enumerate(cands) if "default" in c.roles)
    finite = [i for i, m in enumerate(ms) if math.isfinite(m)]
    entry = {"default": str(cands[default].tile), "default_ms": rows[default]["ms"],
             "default_tflops": rows[default]["tflops"], "candidates": rows}
    if not finite:
        entry["error"] = "no candidate ran (every build or run failed)"
        return entry
    best = min(finite, key=lambda i: (ms[i], i))
    if math.isfinite(ms[default]) and ms[best] > ms[default] * (1 - MARGIN):
        best = default
    entry.update(winner=str(cands[best].tile), config=cands[best].tile.config(), ms=ms[best],
                 tflops=rows[best]["tflops"])
    return entry


def _prebuild(op, device, dtype, head_dims, seqlens, jobs, progress) -> None:
    """Compile (or load) the instantiations of the tuned family (the complete one of the device)
    that calls at the tuned lengths will use, in parallel."""
    fam = families.for_arch("cuda", artifact.cuda_arch_of(torch.device(device).index))
    insts = list(dict.fromkeys(op.instantiation(device, dtype, hd, seqlen=n, family=fam)
                               for hd in head_dims for n in seqlens))
    timing.report(progress, "prebuild", 0, len(insts), "")
    done = [0]

    def one(inst):
        try:
            loader.load(inst)
        finally:
            done[0] += 1
            timing.report(progress, "prebuild", done[0], len(insts), inst.name)

    with ThreadPoolExecutor(max_workers=max(1, min(len(insts), jobs or os.cpu_count() or 1))) as pool:
        list(pool.map(one, insts))


# ---------------------------------------------------------------- tuning at first use

_tune_lock = threading.RLock()
_attempted: set = set()


def _covered(fingerprint: str, index: int, dtype: ir.DType, head_dim: int, kind: str, seqlen: int | None) -> bool:
    """Whether a stored winner serves the bucket ``seqlen`` (one tuned within a factor of 2 of
    it; any, for None)."""
    ns = store.tuned_seqlens(fingerprint, index, dtype, head_dim, kind)
    if seqlen is None or seqlen <= 0:
        return bool(ns)
    return any(abs(math.log2(n) - math.log2(seqlen)) <= 1 for n in ns)


def ensure_tuned(op, device, dtype: ir.DType, head_dim: int, seqlen: int | None, kinds=KINDS) -> None:
    """FLASHGEN_AUTOTUNE=1: tune ``op`` at its first CUDA call for a (device, dtype, head dim,
    seqlen bucket) without a stored winner: ``store.seqlen_bucket(seqlen)`` of the call's
    max(seqlen_q, seqlen_k) = ``seqlen`` counts as tuned when a winner is stored within a factor
    of 2 of it (None, as block-sparse calls pass: when any length is stored).

    Tunes ``kinds`` at ``store.seqlen_bucket(seqlen)`` with ``tune_op`` (a line on stderr unless
    FLASHGEN_QUIET=1) and records the winners; later calls use them. Each key is looked at once
    per process (later calls cost one set lookup), and tuned at most once, also when tuning
    fails (a warning; the call goes on with the default tiles). A pass whose tile is forced by
    FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE is not tuned; nothing is with FLASHGEN_JIT=0
    (candidates could not be compiled). Thread-safe: a second thread
    with the same key waits for the first. Skipped (not remembered) while torch.compile traces
    or a CUDA graph is being captured. Never raises for a tuning failure."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = store.seqlen_bucket(seqlen)
    at = n if seqlen is not None and seqlen > 0 else None  # the bucket (None: any stored length will do)
    key = (op.fingerprint, index, dtype, head_dim, at)
    if key in _attempted:
        return
    if torch.compiler.is_compiling() or not env.jit():  # FLASHGEN_JIT=0: nothing may be compiled
        return
    with _tune_lock:
        if key in _attempted:
            return
        forced = {"fwd": bool(env.cuda_fwd_tile()), "bwd": bool(env.cuda_bwd_tile())}  # the override wins anyway
        missing = [k for k in kinds
                   if not forced[k] and not _covered(op.fingerprint, index, dtype, head_dim, k, at)]
        if not missing:
            _attempted.add(key)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        _attempted.add(key)  # before tuning: never twice, and no recursion from the op's own calls
        quiet = env.quiet()
        if not quiet:
            print(f"flashgen: tuning {op.spec.name} ({dtype.value}, head_dim {head_dim}, seqlen {n}: "
                  f"{', '.join(missing)}) on cuda:{index} (FLASHGEN_AUTOTUNE=1; once, stored in "
                  f"{env.cache_dir() / 'tuning'})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            res = tune_op(op, torch.device("cuda", index), dtype, head_dim, [n], kinds=missing, progress=False)
        except Exception as e:  # noqa: BLE001 - a failed tuning must not fail the call
            if not quiet:
                print(f"flashgen: tuning {op.spec.name} failed ({type(e).__name__}: {e}); using the default tiles",
                      file=sys.stderr, flush=True)
            return
        if not quiet:
            got = ", ".join(f"{k} {res[k][n].get('winner', 'none')}" for k in missing)
            print(f"flashgen: tuned {op.spec.name} in {time.perf_counter() - t0:.1f} s: {got}", file=sys.stderr,
                  flush=True)


# The op runtime calls this before choosing a library (FLASHGEN_AUTOTUNE=1); it does not import
# this module, which plugs itself in here.
runtime_op.plug_first_use_tuner(ensure_tuned)
