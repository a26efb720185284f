"""Tuned tile configurations: the store, and the autotuner that fills it.

Store: one JSON file per GPU in ``<cache dir>/tuning/`` (``FLASHGEN_CACHE_DIR``), holding the
metadata it was measured under (GPU name, arch, CUDA runtime, torch and flashgen versions) and,
per (spec fingerprint, dtype, head dim, kind 'fwd'/'bwd'), the winning config at each tuned
sequence length. A file whose metadata differs from the running process is ignored. Ahead-of-time
directories (flashgen.aot) carry such a file too and are read first. A call uses the winner
tuned at the sequence length nearest (in log2) to its max(seqlen_q, seqlen_k).

The store is read once per process (``reload()`` re-reads it; ``record`` updates it).

Autotuner (``tune_op`` / ``tune_many``, ``flashgen tune``, and ``ensure_tuned`` for
FLASHGEN_AUTOTUNE=1): per (spec, GPU, dtype, head dim) it compiles candidate tiles of the forward
and of the backward apart (``candidates``: the default, the derived tile, table rows, a small grid
of legal shapes; pruned by shared memory before compiling and by the compiler's spill report
after), in parallel, then times each on the GPU at each sequence length (CUDA events, median,
inputs rotated past the L2) and records the fastest. A failing candidate scores infinite.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import env, ir
from . import flops as flop_count
from .runtime import loader
from .version import __version__
from .paths import write_json_atomic

_lock = threading.Lock()
_index: dict[int, dict] | None = None  # device index -> {entry key: {seqlen: record}}


@functools.cache
def meta(device_index: int) -> dict:
    """What a tuning result is only valid under: the GPU, its arch, the CUDA runtime, torch and
    flashgen versions."""
    import torch

    from .build import cuda_arch

    props = torch.cuda.get_device_properties(device_index)
    return {"gpu": props.name, "arch": cuda_arch((props.major, props.minor)), "cuda": torch.version.cuda,
            "torch": torch.__version__, "flashgen": __version__}


def _slug(m: dict) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{m['gpu']}-{m['arch']}").strip("_")


def store_path(device_index: int) -> Path:
    """The tuning file of this device in the cache directory."""
    return env.cache_dir() / "tuning" / f"{_slug(meta(device_index))}.json"


def entry_key(spec: ir.Spec | str, dtype: ir.DType, head_dim: int, kind: str) -> str:
    fp = spec if isinstance(spec, str) else spec.fingerprint()
    return f"{fp}|{dtype.value}|hd{head_dim}|{kind}"


def _read(path: Path, want: dict) -> dict:
    """The entries of a tuning file whose metadata matches ``want``; {} otherwise (missing,
    unreadable or malformed file). Entries that are not well formed (a config without the kind's
    tile keys, an illegal tile, a sequence length that is not a positive integer) are dropped."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("meta") != want or not isinstance(data.get("entries"), dict):
        return {}
    out: dict = {}
    for key, per_n in data["entries"].items():
        if not isinstance(key, str) or not isinstance(per_n, dict):
            continue
        kind = key.rsplit("|", 1)[-1]
        good = {n: r for n, r in per_n.items() if _valid_record(kind, n, r)}
        if good:
            out[key] = good
    return out


def _valid_record(kind: str, n, rec) -> bool:
    from . import tiles

    try:
        if int(n) < 1 or not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
            return False
    except (TypeError, ValueError):
        return False
    cfg = rec["config"]
    keys = tiles.KIND_KEYS.get(kind) if kind in ("fwd", "bwd") else None
    if keys is None or not all(type(cfg.get(k)) is int for k in keys):
        return False
    tile = tiles.tile_of(kind, cfg)
    return tile.legal()


def _sources(device_index: int) -> list[Path]:
    slug = _slug(meta(device_index))
    paths = [Path(d) / "tuning" / f"{slug}.json" for d in env.aot_dirs()]
    # With JIT off only what the ahead-of-time directories hold can load: their tuning only.
    return [*paths, store_path(device_index)] if env.jit() else paths


def _load(device_index: int) -> dict:
    global _index
    with _lock:
        if _index is None:
            _index = {}
        if device_index not in _index:
            merged: dict = {}
            want = meta(device_index)
            for path in reversed(_sources(device_index)):  # earlier sources (AOT dirs) win
                for key, per_n in _read(path, want).items():
                    merged.setdefault(key, {}).update(per_n)
            _index[device_index] = {k: {int(n): r for n, r in v.items()} for k, v in merged.items()}
        return _index[device_index]


def reload() -> None:
    """Forget what was read; the next lookup reads the files again."""
    global _index
    with _lock:
        _index = None


def lookup(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str,
           seqlen: int | None) -> tuple[dict, int] | None:
    """(config, tuned seqlen) of the stored winner nearest ``seqlen`` (log2 distance; ties go to
    the longer one; None: the longest), or None when nothing was tuned for this GPU and key."""
    per_n = _load(device_index).get(entry_key(spec, dtype, head_dim, kind))
    if not per_n:
        return None
    ns = sorted(per_n)
    if seqlen is None or seqlen <= 0:
        n = ns[-1]
    else:
        x = math.log2(seqlen)
        i = bisect.bisect_left(ns, seqlen)
        near = [ns[j] for j in (i - 1, i) if 0 <= j < len(ns)]
        n = min(near, key=lambda m: (abs(math.log2(m) - x), -m))
    return dict(per_n[n]["config"]), n


def bucket(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int,
           seqlen: int | None) -> tuple[int | None, int | None]:
    """The tuned lengths (forward, backward) a call at ``seqlen`` uses, None where nothing is
    stored: the part of a call's library key that tuning decides."""
    out = []
    for kind in ("fwd", "bwd"):
        hit = lookup(spec, device_index, dtype, head_dim, kind, seqlen)
        out.append(hit[1] if hit is not None else None)
    return out[0], out[1]


def tuned_seqlens(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str) -> list[int]:
    """The sequence lengths with a stored winner for this key (sorted)."""
    return sorted(_load(device_index).get(entry_key(spec, dtype, head_dim, kind), {}))


def record(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str, seqlen: int,
           config: dict, info: dict | None = None) -> Path:
    """Store ``config`` as the winner for (spec, dtype, head_dim, kind) at ``seqlen`` on this
    device, with ``info`` (timings) beside it. Atomic (write + rename) under a file lock; returns
    the file."""
    import filelock

    path = store_path(device_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    want = meta(device_index)
    with filelock.FileLock(str(path) + ".lock"):
        entries = _read(path, want)
        entries.setdefault(entry_key(spec, dtype, head_dim, kind), {})[str(int(seqlen))] = {
            "config": dict(config), **(info or {})}
        write_json_atomic(path, {"meta": want, "entries": entries})
    reload()
    return path


# ================================================================ the autotuner

KINDS = ("fwd", "bwd")
FWD_LIMIT = 8  # candidates timed per (forward) key, the default and the derived tile included
BWD_LIMIT = 6
REG_SLACK = 40  # register-model estimates above REG_LIMIT + this are not compiled
SPILL_LIMIT = 256  # bytes of local memory per thread (spills) beyond which a candidate is not timed
MARGIN = 0.01  # another tile must beat the default by this fraction to win (timing noise)
TOKENS = 16384  # B·N of the timed inputs (FlashAttention's benchmark grid, as flashgen.bench)
HIDDEN = 2048  # H·d of the timed inputs
BUCKET_MIN, BUCKET_MAX, BUCKET_DEFAULT = 256, 65536, 4096


# ---------------------------------------------------------------- candidates


def reference_tiles(spec: ir.Spec, arch: str, head_dim: int, kind: str, info=None) -> dict:
    """{'default': tile, 'derived': tile, 'table': tile or None} of ``kind`` ('fwd' / 'bwd') for
    (arch, head dim): the untuned choice (tiles.default_choice), the paper's rule
    (tiles.derived) and the per-arch table's row (None where the arch has none or it does not
    fit). ValueError for an unknown kind or architecture."""
    from . import tiles

    _check_kind(kind)
    info = info or tiles.arch_info(arch)
    cls = tiles.mask_class(spec)
    default = tiles.default_choice(spec, arch, head_dim, info)
    derived = tiles.derived(info, head_dim, cls == "score_mod")
    table = tiles.table(arch, cls, head_dim)
    i = 0 if kind == "fwd" else 1
    return {"default": default.fwd if kind == "fwd" else default.bwd, "derived": derived[i], "table": table[i]}


def candidates(spec: ir.Spec, arch: str, head_dim: int, kind: str, info=None, limit: int | None = None) -> list:
    """The tiles the tuner compiles for ``kind`` ('fwd': tiles.FwdTile, 'bwd': tiles.BwdTile) at
    (arch, head dim), in a deterministic order: the default first, then the derived tile, the
    per-arch tables' rows at this and the neighbouring head-dim bounds (both mask classes), then
    a grid of legal shapes nearest the default first (forward: Br 64 / 128 with 4 warps and 128
    with 8 warps, Bc 32 … 128; backward: queries per step 32 / 64 / 128, 4 / 8 warps, 1 / 2 warps
    per key slab, every legal dQ split). Kept: legal tiles whose shared memory fits
    ``info.smem_optin`` (``info``: a tiles.ArchInfo, default the arch's table figures) and whose
    register estimate is at most REG_LIMIT + REG_SLACK; at most ``limit`` (default FWD_LIMIT /
    BWD_LIMIT) — the default and the derived tile are always kept. ValueError for an unknown
    kind or architecture."""
    from . import tiles

    _check_kind(kind)
    arch = tiles.normalize_arch(arch)
    info = info or tiles.arch_info(arch)
    refs = reference_tiles(spec, arch, head_dim, kind, info)
    score_mod = tiles.mask_class(spec) == "score_mod"
    limit = (FWD_LIMIT if kind == "fwd" else BWD_LIMIT) if limit is None else limit
    table_rows = _table_neighbours(arch, head_dim, kind)
    if kind == "fwd":
        grid = [tiles.FwdTile(bm, bn, w) for bm, w in ((64, 4), (128, 4), (128, 8)) for bn in (32, 48, 64, 96, 128)]
    else:
        grid = [tiles.BwdTile(bm, w, wd, wq) for bm in (32, 64, 128) for w in (4, 8) for wd in (1, 2)
                for wq in (1, 2, 4, 8)]
    d = refs["default"]
    grid.sort(key=lambda t: (_distance(t, d), t.regs_estimate(head_dim, score_mod), t))

    def fits(t) -> bool:
        return t.legal() and t.smem_bytes(head_dim) <= info.smem_optin

    keep = [refs["default"]]
    if fits(refs["derived"]):
        keep.append(refs["derived"])
    keep = list(dict.fromkeys(keep))
    for t in [*table_rows, *grid]:
        if len(keep) >= limit:
            break
        if t in keep or not fits(t) or t.regs_estimate(head_dim, score_mod) > tiles.REG_LIMIT + REG_SLACK:
            continue
        keep.append(t)
    return keep


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'fwd' or 'bwd', got {kind!r}")


def _table_neighbours(arch: str, head_dim: int, kind: str) -> list:
    """The tables' tiles (both mask classes) at head dim's row and the rows either side of it."""
    from . import tiles

    fam = tiles._FAMILY.get(arch)
    if fam is None:
        return []
    tables = tiles.FWD_TABLE if kind == "fwd" else tiles.BWD_TABLE
    kd = tiles.padded_head_dim(head_dim)
    out = []
    for cls in ("plain", "score_mod"):
        rows = tables[fam][cls]
        i = next((j for j, (bound, _) in enumerate(rows) if kd <= bound), len(rows) - 1)
        out += [rows[j][1] for j in (i, i - 1, i + 1) if 0 <= j < len(rows)]
    return list(dict.fromkeys(out))


def _distance(t, d) -> float:
    """How far tile ``t`` is from the default ``d`` (log2 steps per field, 1 per other knob)."""
    from . import tiles

    if isinstance(t, tiles.BwdTile):
        return (abs(math.log2(t.block_m / d.block_m)) + abs(math.log2(t.warps / d.warps))
                + abs(t.warps_d - d.warps_d) + abs(math.log2(t.warps_mdq / d.warps_mdq)))
    return (abs(math.log2(t.block_m / d.block_m)) + abs(math.log2(t.block_n / d.block_n))
            + (0 if t.warps == d.warps else 1))


# ---------------------------------------------------------------- resource report


@dataclass(frozen=True)
class KernelResources:
    """Per-thread registers, stack frame and local memory (bytes; spills land in the stack
    frame), and static shared memory per CTA (bytes) of one kernel, from cuobjdump -res-usage."""

    regs: int
    stack: int
    shared: int
    local: int

    @property
    def local_bytes(self) -> int:
        """Local memory per thread: stack frame (register spills, local arrays) + LOCAL."""
        return self.stack + self.local


_FUNCTION = re.compile(r"^\s*Function\s+(\S+?)\s*:\s*$")
_FIELD = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")
_ARCH = re.compile(r"^\s*arch\s*=\s*(sm_\w+)\s*$")


def parse_res_usage(text: str, arch: str | None = None) -> dict[str, KernelResources]:
    """Kernel (mangled) name → KernelResources from the text of ``cuobjdump -res-usage``: lines
    ``Function <name>:`` each followed by ``REG:n STACK:n SHARED:n LOCAL:n ...``. With ``arch``
    (e.g. 'sm_90a'), only the ELF sections for that arch; a kernel listed in several sections
    keeps the largest of each figure. Unparseable lines are skipped (never raises on bad text)."""
    out: dict[str, KernelResources] = {}
    section_ok = True
    name = None
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            section_ok = arch is None or m.group(1) == arch
            name = None
            continue
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1) if section_ok else None
            continue
        if name is None:
            continue
        fields = {k: int(v) for k, v in _FIELD.findall(line)}
        if "REG" in fields:
            new = KernelResources(fields.get("REG", 0), fields.get("STACK", 0), fields.get("SHARED", 0),
                                  fields.get("LOCAL", 0))
            old = out.get(name)
            if old is not None:
                new = KernelResources(*(max(a, b) for a, b in zip(
                    (old.regs, old.stack, old.shared, old.local), (new.regs, new.stack, new.shared, new.local),
                    strict=True)))
            out[name] = new
            name = None
    return out


@functools.cache
def find_cuobjdump() -> str | None:
    """The CUDA toolkit's cuobjdump: next to nvcc in CUDA_HOME (as torch.utils.cpp_extension
    finds it), else on PATH, else beside the nvcc on PATH; None when absent."""
    import shutil

    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:  # an odd torch install only loses the resource report
        CUDA_HOME = None
    homes = [CUDA_HOME, env.cuda_home()]
    for home in homes:
        if home and (Path(home) / "bin" / "cuobjdump").is_file():
            return str(Path(home) / "bin" / "cuobjdump")
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc:
        beside = Path(nvcc).resolve().parent / "cuobjdump"
        if beside.is_file():
            return str(beside)
    return None


def resource_usage(lib_path: Path | str, arch: str | None = None) -> dict[str, KernelResources] | None:
    """Resources of every kernel in a built library (``parse_res_usage`` of ``cuobjdump
    -res-usage``); None when cuobjdump is missing or fails (resources unknown)."""
    import subprocess

    tool = find_cuobjdump()
    if tool is None:
        return None
    try:
        res = subprocess.run([tool, "-res-usage", str(lib_path)], check=False, capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return parse_res_usage(res.stdout, arch)


def main_kernel(resources: dict[str, KernelResources] | None, kind: str) -> KernelResources | None:
    """The figures of ``kind``'s main kernel (flashgen::cuda::fwd_kernel / bwd_kernel; the
    largest of each figure over its instantiations), None when unknown."""
    if not resources:
        return None
    name = f"{kind}_kernel"
    pat = re.compile(rf"(?<![0-9]){len(name)}{name}I")
    hits = [r for n, r in resources.items() if pat.search(n)]
    if not hits:
        return None
    return KernelResources(max(r.regs for r in hits), max(r.stack for r in hits), max(r.shared for r in hits),
                           max(r.local for r in hits))


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


def candidate_instantiation(spec: ir.Spec, target, dtype: ir.DType, head_dim: int, tile, kind: str, info=None):
    """The build.Instantiation that compiles only ``kind``'s translation unit with ``tile``; the
    other tile keys are the default choice's."""
    from . import families, tiles

    cfg = tiles.default_choice(spec, target.arch, head_dim, info).config()
    cfg.update(tile.config())
    return families.get(target.family).instantiation(spec, target.arch, dtype, head_dim, tiles=cfg,
                                                     extra={f"{kind}_only": 1})


def _roles(tile, refs: dict) -> tuple[str, ...]:
    return tuple(r for r in ("default", "derived", "table") if refs.get(r) == tile)


def _compile(cands: list[Candidate], jobs: int | None, progress) -> float:
    """Build every candidate in parallel (one nvcc process each); fills lib / error / resources /
    pruned. Returns the wall time (s)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed


    def one(c: Candidate) -> Candidate:
        t0 = time.perf_counter()
        try:
            c.lib = loader.load(c.inst)
        except Exception as e:  # noqa: BLE001 - BuildError, or no compiler (FLASHGEN_JIT=0): infinite
            c.error = f"build failed: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
            return c
        finally:
            c.build_s = time.perf_counter() - t0
        c.resources = main_kernel(resource_usage(c.lib.path, c.inst.target.arch), c.kind)
        if c.resources is not None and c.resources.local_bytes > SPILL_LIMIT and not c.protected:
            c.pruned = f"spills: {c.resources.local_bytes} bytes of local memory per thread"
        return c

    t0 = time.perf_counter()
    todo = list({id(c): c for c in cands}.values())
    _report(progress, "compile", 0, len(todo), "")
    workers = max(1, min(len(todo), jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, c) for c in todo]
        for i, f in enumerate(as_completed(futures), 1):
            c = f.result()
            _report(progress, "compile", i, len(todo), f"{c.kind} {c.tile}" + (" (failed)" if c.error else ""))
    return time.perf_counter() - t0


# ---------------------------------------------------------------- timing


@dataclass
class _Workload:
    """The timed inputs of one (head dim, seqlen, kind): ``sets`` of tensors rotated between
    repeats (together over 2× the L2), the spec's parameter values, scale and FLOPs."""

    B: int
    H: int
    N: int
    d: int
    sets: list
    values: list
    scale: float
    flops: float | None


def _example_params(spec: ir.Spec, B: int, H: int, N: int, device, gen) -> dict:
    """flashgen.params.example_params, with float tensors of ``dim|1`` dims drawn at size 1 (a
    bias of [1, 1, N, N] rather than [B, H, N, N]: the kernels broadcast it)."""
    import torch

    from .params import example_params, shape_of

    sizes = {"batch": B, "heads": H, "seqlen_q": N, "seqlen_k": N}
    given = {}
    for p in spec.params:
        if p.kind == "int":
            sizes[p.name] = max(1, N // 8)
    for p in spec.params:
        if p.is_tensor and p.dtype == "f32" and any(dim.broadcast for dim in p.shape):
            shape = [1 if dim.broadcast else n for dim, n in zip(p.shape, shape_of(p, sizes), strict=True)]
            given[p.name] = torch.randn(shape, generator=gen, device=gen.device).to(device)
    return example_params(spec, B, H, N, N, device, gen, **given)


def _workload(op, device, dtype: ir.DType, head_dim: int, seqlen: int, kind: str, tokens: int, fwd_lib,
              l2_bytes: int) -> _Workload:
    import torch

    from . import reference
    from .ops import TORCH_DTYPE

    N, d = seqlen, head_dim
    B, H = max(1, tokens // N), max(1, HIDDEN // d)
    gen = torch.Generator(device=device).manual_seed(1234 + N + d)
    tdt = TORCH_DTYPE[dtype]
    per = (5 if kind == "bwd" else 3) * B * H * N * d * torch.tensor([], dtype=tdt).element_size()
    nsets = max(2, min(32, math.ceil(2 * l2_bytes / max(per, 1))))
    params = _example_params(op.spec, B, H, N, device, gen)
    scale = reference.default_scale(op.spec, d)
    sets = []
    for _ in range(nsets):
        q, k, v = (torch.randn(B, H, N, d, device=device, dtype=tdt, generator=gen) for _ in range(3))
        sets.append({"q": q, "k": k, "v": v})
    values = op.check_params(sets[0]["q"], sets[0]["k"], params)
    if kind == "bwd":
        for s in sets:
            s["dout"] = torch.randn(B, H, N, d, device=device, dtype=tdt, generator=gen)
            s["out"], s["lse"] = op.launch_forward(s["q"], s["k"], s["v"], scale, values, lib=fwd_lib)
    try:
        pairs = reference.visible_pairs(op.spec, N, N, batch=B, heads=H, **params)
        flops = float(flop_count.attention_flops(B * H * pairs, d, "bwd" if kind == "bwd" else "fwd"))
    except Exception:  # noqa: BLE001 - the FLOP count is a report, never a reason to fail
        flops = None
    return _Workload(B, H, N, d, sets, values, scale, flops)


def _runner(op, w: _Workload, kind: str, lib):
    """fn(i): one call of ``lib``'s ``kind`` on input set i (everything _forward/_backward launch)."""
    if kind == "fwd":
        def fwd(i: int):
            s = w.sets[i]
            return op.launch_forward(s["q"], s["k"], s["v"], w.scale, w.values, lib=lib)
        return fwd

    def bwd(i: int):
        s = w.sets[i]
        return op.launch_backward(s["q"], s["k"], s["v"], s["out"], s["lse"], s["dout"], None, w.scale, False, w.values,
                            lib=lib)[:3]
    return bwd


def _time_calls(fn, nsets: int, device, *, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` calls with input set i rotating over
    ``nsets`` (so the L2 does not hold a call's inputs from the previous one): CUDA events around
    each call (flashgen.bench.time_fn, with the input set advancing per call)."""
    import itertools

    from .bench import time_fn

    calls = itertools.count()
    return time_fn(lambda: fn(next(calls) % nsets), device, warmup=warmup, reps=reps)


def _mismatch(got, ref) -> str | None:
    """Why ``got`` (a tuple of tensors) is not ``ref`` up to tiling round-off, or None."""
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        a, b = a.float(), b.float()
        fa, fb = a.isfinite(), b.isfinite()
        if not bool((fa == fb).all()) or not bool((a[~fb] == b[~fb]).all()):
            return f"output {i}: non-finite values differ from the default tile's"
        if bool(fb.any()):
            diff = float((a[fb] - b[fb]).abs().max())
            tol = 0.02 * float(b[fb].abs().max()) + 1e-3
            if diff > tol:
                return f"output {i}: differs from the default tile's by {diff:.3g} (tolerance {tol:.3g})"
    return None


def _time_kind(op, w: _Workload, cands: list[Candidate], device, reps: int, progress, step: list) -> list[float]:
    """Milliseconds of each candidate on workload ``w`` (inf: failed, wrong or pruned)."""
    import torch

    from .runtime import launch

    ref = None
    default = next((c for c in cands if "default" in c.roles), None)
    order = sorted(cands, key=lambda c: c is not default)  # the default first: the others are checked against it
    ms_of: dict[int, float] = {}
    for c in order:
        ms = math.inf
        if c.lib is not None and c.error is None and c.pruned is None:
            fn = _runner(op, w, c.kind, c.lib)
            try:
                got = fn(0)
                if c is default:
                    ref = got
                elif ref is not None:
                    bad = _mismatch(got, ref)
                    if bad is not None:
                        raise ValueError(bad)
                del got
                old, launch.poison_outputs = launch.poison_outputs, False  # timing: no NaN fill pass
                try:
                    ms = _time_calls(fn, len(w.sets), device, warmup=max(2, len(w.sets)), reps=reps)
                finally:
                    launch.poison_outputs = old
            except torch.cuda.OutOfMemoryError:
                c.error = "out of GPU memory"
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - any failing candidate scores infinite
                c.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ms_of[id(c)] = ms
        step[0] += 1
        _report(progress, "time", step[0], step[1], f"{c.kind} N={w.N} d={w.d} {c.tile}: "
                + (f"{ms:.3f} ms" if math.isfinite(ms) else (c.error or c.pruned or "failed")))
    return [ms_of[id(c)] for c in cands]


def _report(progress, stage: str, done: int, total: int, detail: str) -> None:
    if callable(progress):
        progress(stage, done, total, detail)
    elif progress and (done == total or detail.endswith("(failed)")):
        print(f"flashgen tune: {stage} {done}/{total} {detail}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- tuning


def seqlen_bucket(seqlen: int | None) -> int:
    """The sequence length FLASHGEN_AUTOTUNE tunes a call at: max(seqlen_q, seqlen_k) rounded to
    the nearest power of 4 in log2 (ties up), within [BUCKET_MIN, BUCKET_MAX] (256 … 65536; 1024,
    4096, 16384 are the `flashgen tune` defaults); BUCKET_DEFAULT for None."""
    if seqlen is None or seqlen <= 0:
        return BUCKET_DEFAULT
    e = math.floor(math.log2(seqlen) / 2 + 0.5)  # log2 is exact at powers of two: ties go up
    return min(BUCKET_MAX, max(BUCKET_MIN, 4 ** e))


def tune_op(op, device, dtype, head_dim: int, seqlens, kinds=KINDS, progress=True, **kw) -> dict:
    """Tune ``op``'s CUDA tiles for one head dim; see ``tune_many`` (this is its one-head-dim
    form) for the arguments, the result and the errors. Returns that head dim's result dict."""
    return tune_many(op, device, dtype, [head_dim], seqlens, kinds, progress, **kw)[0]


def tune_many(op, device, dtype, head_dims, seqlens, kinds=KINDS, progress=True, *, limit: int | None = None,
              reps: int = 10, tokens: int | None = None, jobs: int | None = None, save: bool = True,
              prebuild: bool = False) -> list[dict]:
    """Measure candidate tiles (``candidates``) of ``op`` on a CUDA ``device`` and store the
    fastest per (kind, head dim, seqlen).

    For each head dim, the candidates of each kind are compiled once (all head dims and kinds
    in one pool of ``jobs`` parallel builds, default os.cpu_count()), those that spill heavily
    (cuobjdump's report, over SPILL_LIMIT bytes) are pruned unless they are the default/derived/
    table tiles, and the rest are timed at each sequence length in ``seqlens`` on q, k, v (and
    dout) of shape [B, H, N, d] with B = max(1, tokens // N) (``tokens`` default TOKENS = 16384),
    H = max(1, 2048 // d), random spec
    parameters (flashgen.params), several input sets rotated between repeats so together they
    exceed twice the L2: CUDA events, median of ``reps``. The backward is timed apart from the
    forward and includes everything ``AttentionOp._backward`` launches. A candidate that fails to
    build or run, or whose output differs from the default tile's beyond round-off, scores
    infinite. The winner (the default unless another is MARGIN faster) is recorded in the store
    with its timings (``save``; ``record``); ``prebuild`` then compiles (or loads) the
    instantiations calls at the tuned lengths will use, so their first use compiles nothing.

    Args:
        op: an AttentionOp, or a spec path/text (flashgen.compile).
        device: a CUDA device ('cuda', 'cuda:1', torch.device).
        dtype: bf16 or fp16 (flashgen, torch or spelled).
        head_dims: head dims to tune; seqlens: sequence lengths (max(seqlen_q, seqlen_k)).
        kinds: 'fwd' and/or 'bwd'.
        progress: True (a line on stderr per finished stage), False, or a callable
            ``progress(stage, done, total, detail)`` with stage 'compile' or 'time'.
        limit: cap on candidates per kind (default FWD_LIMIT / BWD_LIMIT).

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
    import torch

    from . import build, tiles
    from .ops import AttentionOp, as_dtype
    from .ops import compile as fg_compile

    if not isinstance(op, AttentionOp):
        op = fg_compile(op)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: the tuner times CUDA kernels, got '{device}'")
    if not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available in this torch build or machine (tuning needs a GPU)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    dtype = as_dtype(dtype)
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
    kinds = tuple(dict.fromkeys(kinds))
    for k in kinds:
        _check_kind(k)
    tokens = tokens or TOKENS
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    from . import families

    target = families.for_arch("cuda", build.cuda_arch_of(index)).device_target(index)
    info = tiles.device_info(index)
    plans: dict[int, dict[str, list[Candidate]]] = {}
    helpers: dict[int, Candidate] = {}  # the default forward, for the backward's out and lse
    for hd in head_dims:
        plans[hd] = {}
        for kind in kinds:
            refs = reference_tiles(op.spec, target.arch, hd, kind, info)
            plans[hd][kind] = [Candidate(kind, t, _roles(t, refs),
                                         candidate_instantiation(op.spec, target, dtype, hd, t, kind, info))
                               for t in candidates(op.spec, target.arch, hd, kind, info, limit)]
        if "bwd" in kinds:
            helpers[hd] = next((c for c in plans[hd].get("fwd", []) if "default" in c.roles), None) or Candidate(
                "fwd", tiles.default_choice(op.spec, target.arch, hd, info).fwd, ("default",),
                candidate_instantiation(op.spec, target, dtype, hd,
                                        tiles.default_choice(op.spec, target.arch, hd, info).fwd, "fwd", info))
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
                    w = _workload(op, device, dtype, hd, n, kind, tokens, helper.lib if helper else None,
                                  info.l2_bytes)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    res[kind][n] = {"error": "out of GPU memory for the inputs"}
                    step[0] += len(cands)
                    continue
                with torch.cuda.device(device):
                    ms = _time_kind(op, w, cands, device, reps, progress, step)
                flops = w.flops
                rows = [c.row(m, flops) for c, m in zip(cands, ms, strict=True)]
                for c in cands:  # a run failure is per seqlen; the next length tries again
                    if c.error and c.lib is not None:
                        c.error = None
                entry = _winner(cands, ms, rows, flops)
                entry["shape"] = [w.B, w.H, w.N, w.d]
                res[kind][n] = entry
                if save and "config" in entry:
                    path = record(op.fingerprint, index, dtype, hd, kind, n, entry["config"], {
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
    """Compile (or load) the instantiations calls at the tuned lengths will use, in parallel."""
    from concurrent.futures import ThreadPoolExecutor


    insts = list(dict.fromkeys(op.instantiation(device, dtype, hd, seqlen=n) for hd in head_dims for n in seqlens))
    _report(progress, "prebuild", 0, len(insts), "")
    done = [0]

    def one(inst):
        try:
            loader.load(inst)
        finally:
            done[0] += 1
            _report(progress, "prebuild", done[0], len(insts), inst.name)

    with ThreadPoolExecutor(max_workers=max(1, min(len(insts), jobs or os.cpu_count() or 1))) as pool:
        list(pool.map(one, insts))


# ---------------------------------------------------------------- tuning at first use

_tune_lock = threading.RLock()
_attempted: set = set()


def _covered(fingerprint: str, index: int, dtype: ir.DType, head_dim: int, kind: str, seqlen: int | None) -> bool:
    """Whether a stored winner serves the bucket ``seqlen`` (one tuned within a factor of 2 of
    it; any, for None)."""
    ns = tuned_seqlens(fingerprint, index, dtype, head_dim, kind)
    if seqlen is None or seqlen <= 0:
        return bool(ns)
    return any(abs(math.log2(n) - math.log2(seqlen)) <= 1 for n in ns)


def ensure_tuned(op, device, dtype: ir.DType, head_dim: int, seqlen: int | None, kinds=KINDS) -> None:
    """FLASHGEN_AUTOTUNE=1: tune ``op`` at its first CUDA call for a (device, dtype, head dim,
    seqlen bucket) without a stored winner: ``seqlen_bucket(seqlen)`` of the call's
    max(seqlen_q, seqlen_k) = ``seqlen`` counts as tuned when a winner is stored within a factor
    of 2 of it (None, as block-sparse calls pass: when any length is stored).

    Tunes ``kinds`` at ``seqlen_bucket(seqlen)`` with ``tune_op`` (a line on stderr unless
    FLASHGEN_QUIET=1) and records the winners; later calls use them. Each key is looked at once
    per process (later calls cost one set lookup), and tuned at most once, also when tuning
    fails (a warning; the call goes on with the default tiles). A pass whose tile is forced by
    FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE is not tuned; nothing is with FLASHGEN_JIT=0
    (candidates could not be compiled). Thread-safe: a second thread
    with the same key waits for the first. Skipped (not remembered) while torch.compile traces
    or a CUDA graph is being captured. Never raises for a tuning failure."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    n = seqlen_bucket(seqlen)
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
