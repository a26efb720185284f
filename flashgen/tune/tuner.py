"""The autotuner: measures tile candidates of an op on a GPU and records the fastest in the
tuning store (flashgen.tune.store).

``tune_op`` / ``tune_many`` (``flashgen tune``), and ``ensure_tuned`` for FLASHGEN_AUTOTUNE=1: per
(spec, GPU, dtype, head dim) it compiles the candidate tiles of the forward and of the backward
apart, each pass's of the kernel family that runs it (``tuning_families``: on sm_90a the sm90
forward and the sm80 backward; ``family.tuning.candidates``: sm80's default, derived tile, table
rows and a small grid of legal shapes, sm90's default and one-knob variations; pruned by shared
memory before compiling and by the compiler's spill report after, flashgen.tune.resources), in
parallel, then times each on the GPU at each sequence length (flashgen.tune.timing: CUDA events,
median, inputs rotated past the L2) and records the fastest under that family's store key. A
failing candidate scores infinite.

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


def tuning_families(op, index: int, dtype: ir.DType, head_dim: int, kinds=None,
                    family: str | None = None) -> dict[str, families.Family]:
    """{kind: the kernel family whose tiles of that pass are tuned} for ``op`` on CUDA device
    ``index`` at (dtype, head_dim), in ``kinds`` order.

    ``family`` None or 'auto': each pass's the family that runs it there (``op.choose_family``,
    so a forced family counts: on sm_90a the sm90 forward and the sm80 backward); ``kinds`` None
    means every pass, less those no family tunes there. A family name: that family's passes
    (``family.tuning.kinds``) among ``kinds`` (None: all of them).

    Raises:
        ValueError: naming ``family`` for an unknown family, one without tunable tiles or one
            that does not run on the device; naming ``kinds`` for an unknown pass, a pass the
            named family does not tune (sm90's backward: it runs on sm80), or (auto) a pass no
            family here runs.
    """
    arch = artifact.cuda_arch_of(index)
    wanted = None if kinds is None else tuple(dict.fromkeys(kinds))
    for k in wanted or ():
        if k not in KINDS:
            raise ValueError(f"kinds: expected 'fwd' and/or 'bwd', got {k!r}")
    if family not in (None, "auto"):
        fam = families.get(family, "family")
        if fam.tuning is None:
            raise ValueError(f"family: {fam.name} has no tunable tiles (the {fam.name} family chooses its tiles "
                             f"per call); tunable: {', '.join(n for n, f in families.FAMILIES.items() if f.tuning)}")
        why = fam.arch_reason(arch) if fam.device == "cuda" else f"runs on {fam.device} tensors"
        if why:
            raise ValueError(f"family: {fam.name} does not run on this GPU ({arch}): it {why}")
        if wanted is None:
            return {k: fam for k in fam.tuning.kinds}
        lacks = [k for k in wanted if k not in fam.tuning.kinds]
        if lacks:
            raise ValueError(f"kinds: family {fam.name} has no tunable {lacks[0]} pass (it tunes "
                             f"{', '.join(fam.tuning.kinds)}"
                             + ("; its backward runs on sm80: --family sm80 tunes it" if lacks[0] == "bwd" else "")
                             + ")")
        return {k: fam for k in wanted}
    device = torch.device("cuda", index)
    out: dict[str, families.Family] = {}
    for k in wanted or KINDS:
        try:
            fam = op.choose_family(device, dtype, head_dim, False, False, False, backward=k == "bwd").family
        except NotImplementedError as e:
            if wanted is None:
                continue
            raise ValueError(f"kinds: no family tunes the {k} pass here ({e})") from None
        if fam.tuning is None or k not in fam.tuning.kinds:
            # A partial family's untuned pass (sm90's backward, which serves padded calls at head
            # dims 64 and 128): the device's complete family runs that pass's other calls
            # (deterministic, packed, block lists, other head dims) and tunes it.
            full = families.for_arch("cuda", arch)
            if full is not fam and full.tuning is not None and k in full.tuning.kinds:
                out[k] = full
                continue
            if wanted is None:
                continue
            raise ValueError(f"kinds: family {fam.name}, which runs the {k} pass here, does not tune it")
        out[k] = fam
    if not out:
        raise ValueError(f"kinds: no family tunes any pass on this GPU ({arch})")
    return out


def tune_op(op, device, dtype, head_dim: int, seqlens, kinds=None, progress=True, **kw) -> dict:
    """Tune ``op``'s CUDA tiles for one head dim; see ``tune_many`` (this is its one-head-dim
    form) for the arguments, the result and the errors. Returns that head dim's result dict."""
    return tune_many(op, device, dtype, [head_dim], seqlens, kinds, progress, **kw)[0]


def tune_many(op, device, dtype, head_dims, seqlens, kinds=None, progress=True, *, limit: int | None = None,
              reps: int = 10, tokens: int | None = None, jobs: int | None = None, save: bool = True,
              prebuild: bool = False, family: str | None = None) -> list[dict]:
    """Measure candidate tiles (``tuning.candidates`` of the kernel family of each pass,
    ``tuning_families``) of ``op`` on a CUDA ``device`` and store the fastest per (family, kind,
    head dim, seqlen).

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
        kinds: 'fwd' and/or 'bwd' (None: every pass the family tunes; ``tuning_families``).
        family: whose tiles to tune: None / 'auto' (each pass's the family that runs it on this
            GPU: on sm_90a the sm90 forward and the sm80 backward) or a family name ('sm80',
            'sm90': that family's passes).
        progress: True (a line on stderr per finished stage), False, or a callable
            ``progress(stage, done, total, detail)`` with stage 'compile' or 'time'.
        limit: cap on candidates per kind (default the family's tuning.fwd_limit / bwd_limit).
        reps: timed calls per candidate (median); jobs: parallel builds; save: record winners.

    Returns one dict per head dim: spec, fingerprint, gpu, arch, dtype, head_dim, families
    ({kind: family name}), store (the
    file written, or None), wall seconds compile_s (the shared compile phase), time_s (this head
    dim's timing), prebuild_s and total_s (the whole run), and per kind a dict seqlen →
    {winner, config, ms, tflops, default, default_ms, default_tflops, shape [B, H, N, d],
    candidates: [{tile, roles, ms, tflops, regs, local, error?, pruned?}]} (ms in
    milliseconds, None where a candidate failed or was pruned; tflops in TFLOP/s; regs per
    thread and local bytes per thread from the resource report, None where unknown), or
    {error, ...} where no candidate ran.

    Raises:
        ValueError: no CUDA device, a device that is not CUDA, or a dtype / head dim / kind /
            seqlen the spec or the CUDA family does not take; a family that cannot be tuned
            here or lacks a requested pass (``tuning_families``, naming family / kinds).
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
    fams = {hd: tuning_families(op, index, dtype, hd, kinds, family) for hd in head_dims}
    kinds = tuple(dict.fromkeys(k for hd in head_dims for k in fams[hd]))
    tokens = tokens or timing.TOKENS
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    info = tiles.device_info(index)
    plans: dict[int, dict[str, list[Candidate]]] = {}
    helpers: dict[int, Candidate] = {}  # the default forward, for the backward's out and lse
    for hd in head_dims:
        plans[hd] = {}
        for kind, fam in fams[hd].items():
            target = fam.device_target(index)
            refs = fam.tuning.reference_tiles(op.spec, target.arch, hd, kind, info)
            plans[hd][kind] = [Candidate(kind, t, _roles(t, refs),
                                         fam.tuning.instantiation(op.spec, target.arch, dtype, hd, t, kind, info))
                               for t in fam.tuning.candidates(op.spec, target.arch, hd, kind, info, limit,
                                                              seqlens=seqlens)]
        if "bwd" in fams[hd]:
            fam = fams[hd]["bwd"]
            target = fam.device_target(index)
            default_fwd = fam.tuning.reference_tiles(op.spec, target.arch, hd, "fwd", info)["default"]
            helpers[hd] = next((c for c in plans[hd].get("fwd", []) if "default" in c.roles), None) or Candidate(
                "fwd", default_fwd, ("default",),
                fam.tuning.instantiation(op.spec, target.arch, dtype, hd, default_fwd, "fwd", info))
    every = [c for hd in head_dims for k in plans[hd] for c in plans[hd][k]] + list(helpers.values())
    compile_s = _compile(every, jobs, progress)
    results = []
    total = sum(len(plans[hd][k]) for hd in head_dims for k in plans[hd]) * len(seqlens)
    step = [0, total]
    t_time = time.perf_counter()
    for hd in head_dims:
        t0 = time.perf_counter()
        res: dict = {"spec": op.spec.name, "fingerprint": op.fingerprint, "gpu": info.name,
                     "arch": artifact.cuda_arch_of(index), "dtype": dtype.value, "head_dim": hd,
                     "families": {k: f.name for k, f in fams[hd].items()}, "store": None,
                     "compile_s": round(compile_s, 2)}
        for kind in fams[hd]:
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
                        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, family=fams[hd][kind].name)
                    res["store"] = str(path)
                del w
        res["time_s"] = round(time.perf_counter() - t0, 2)
        results.append(res)
    torch.cuda.empty_cache()
    t_pre = time.perf_counter()
    if save and prebuild:
        _prebuild(op, device, dtype, head_dims, seqlens, jobs, progress,
                  {f for hd in head_dims for f in fams[hd].values()})
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


def _prebuild(op, device, dtype, head_dims, seqlens, jobs, progress, fams) -> None:
    """Compile (or load) the instantiations of the tuned families ``fams`` that calls at the
    tuned lengths will use, in parallel."""
    insts = list(dict.fromkeys(op.instantiation(device, dtype, hd, seqlen=n, family=fam)
                               for fam in sorted(fams, key=lambda f: f.name) for hd in head_dims for n in seqlens))
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


def _covered(fingerprint: str, index: int, dtype: ir.DType, head_dim: int, kind: str, seqlen: int | None,
             family: str | None = None) -> bool:
    """Whether a stored winner of ``family`` serves the bucket ``seqlen`` (one tuned within a
    factor of 2 of it; any, for None)."""
    ns = store.tuned_seqlens(fingerprint, index, dtype, head_dim, kind, family)
    if seqlen is None or seqlen <= 0:
        return bool(ns)
    return any(abs(math.log2(n) - math.log2(seqlen)) <= 1 for n in ns)


def _runs(op, device, dtype: ir.DType, head_dim: int, fam, kind: str) -> bool:
    """Whether ``fam`` runs the ``kind`` pass of a padded call of ``op`` on ``device``."""
    try:
        return op.choose_family(device, dtype, head_dim, False, False, False, backward=kind == "bwd").family is fam
    except NotImplementedError:
        return False


def ensure_tuned(op, device, dtype: ir.DType, head_dim: int, seqlen: int | None, kinds=None, *,
                 family=None) -> None:
    """FLASHGEN_AUTOTUNE=1: tune ``op`` at its first CUDA call for a (device, dtype, head dim,
    seqlen bucket, kernel family) without a stored winner: ``store.seqlen_bucket(seqlen)`` of
    the call's max(seqlen_q, seqlen_k) = ``seqlen`` counts as tuned when a winner is stored
    within a factor of 2 of it (None, as block-sparse calls pass: when any length is stored).

    ``family``: the family (object or name) whose library the call chooses; its passes that it
    runs for this op on the device are tuned (on sm_90a: sm90's forward, sm80's backward), or
    ``kinds`` when given. None: the sm80 family's ('fwd', 'bwd', or ``kinds``).

    Tunes those passes at ``store.seqlen_bucket(seqlen)`` with ``tune_op`` (a line on stderr unless
    FLASHGEN_QUIET=1) and records the winners; later calls use them. Each key is looked at once
    per process (later calls cost one set lookup), and tuned at most once, also when tuning
    fails (a warning; the call goes on with the default tiles). A pass whose tile is forced by
    FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE is not tuned; nothing is with FLASHGEN_JIT=0
    (candidates could not be compiled). Thread-safe: a second thread
    with the same key waits for the first. Skipped (not remembered) while torch.compile traces
    or a CUDA graph is being captured. Never raises for a tuning failure."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    n = store.seqlen_bucket(seqlen)
    at = n if seqlen is not None and seqlen > 0 else None  # the bucket (None: any stored length will do)
    fam = families.of(family) if family is not None else families.get(store.UNNAMED_FAMILY)
    key = (op.fingerprint, index, dtype, head_dim, at, fam.name)
    if key in _attempted:
        return
    if torch.compiler.is_compiling() or not env.jit():  # FLASHGEN_JIT=0: nothing may be compiled
        return
    with _tune_lock:
        if key in _attempted:
            return
        if fam.tuning is None:
            _attempted.add(key)
            return
        if kinds is None:
            kinds = fam.tuning.kinds
            if family is not None:  # only the passes this family runs here (sm80 on Hopper: the backward)
                kinds = tuple(k for k in kinds if _runs(op, device, dtype, head_dim, fam, k))
        kinds = [k for k in kinds if k in fam.tuning.kinds]
        missing = [k for k in kinds if not fam.tuning.forced(k)  # an environment override wins anyway
                   and not _covered(op.fingerprint, index, dtype, head_dim, k, at, fam.name)]
        if not missing:
            _attempted.add(key)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        _attempted.add(key)  # before tuning: never twice, and no recursion from the op's own calls
        quiet = env.quiet()
        if not quiet:
            print(f"flashgen: tuning {op.spec.name} ({dtype.value}, head_dim {head_dim}, seqlen {n}: "
                  f"{', '.join(missing)}) on cuda:{index}, family {fam.name} (FLASHGEN_AUTOTUNE=1; once, stored in "
                  f"{env.cache_dir() / 'tuning'})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            res = tune_op(op, device, dtype, head_dim, [n], kinds=missing, progress=False, family=fam.name)
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
