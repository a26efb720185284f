"""Ahead-of-time kernel directories: ``flashgen build SPEC... --out DIR`` writes them, a process
with ``FLASHGEN_AOT_DIR=DIR`` loads from them with no Jinja, no compiler and no tuning.

A directory holds one folder per instantiation, named like its cache entry (``lib.so``,
``manifest.json`` and the rendered ``src/`` for review, copied from the build cache), and
``index.json``::

    {"format": 1, "flashgen": <version>, "abi": <ABI_VERSION>, "torch": <torch.__version__>,
     "python": [major, minor],
     "entries": [{"variant": <Instantiation.variant_id()>, "artifact": <folder>, "sha256": <lib.so>,
                  "spec": <name>, "fingerprint": <spec fingerprint>, "target": [backend, arch],
                  "dtype": ..., "head_dim": ..., "config": {...}, "kinds": [...], ...}, ...]}

CUDA builds made on a machine with a GPU of the target architecture use that GPU's tuned tiles
(flashgen.tune): one instantiation per tuned sequence-length bucket, plus the architecture's
untuned default, and the spec's entries of the tuning file are copied to
``DIR/tuning/<gpu>.json``, which flashgen.tune reads before the cache's, so calls choose the tiles
the directory holds. Without such a GPU (``--arch``) nvcc cross-compiles the table/derived tiles.

Lookup (``find``, called by flashgen.build.load before the cache): an index is read once per
process and used only when its torch, Python, ABI and flashgen versions are the running
process's (otherwise it is skipped with a one-time warning); an artifact is used only when its
``lib.so`` matches the index's sha256. With JIT disabled (``FLASHGEN_JIT=0``) a variant that no
directory holds raises ``NotBuiltError`` naming it and the command that builds it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import __version__, build, env, families
from .abi import ABI_VERSION
from .errors import BuildError, NotBuiltError  # noqa: F401 (raised by build.load through this module)
from .paths import write_json_atomic
from .tune import store as tune_store

FORMAT = 2  # 2: the kernel family is part of every artifact (its name, key and index entry)
INDEX = "index.json"


class AOTWarning(RuntimeWarning):
    """An ahead-of-time directory or artifact was skipped (version mismatch, failed checksum)."""


# ---------------------------------------------------------------- lookup


@dataclass
class _Dir:
    path: Path
    entries: dict[str, dict]  # variant id -> index entry
    problem: str | None = None  # why the whole directory is skipped


_lock = threading.RLock()
_dirs: dict[Path, _Dir] = {}
_libs: dict[Path, build.LoadedLibrary] = {}  # lib.so path -> loaded library
_bad: dict[Path, str] = {}  # lib.so path -> why it is not used
_warned: set[str] = set()


def runtime() -> dict:
    """What an index must record to be used by this process: format, flashgen, ABI, torch and
    Python versions."""
    import torch

    return {"format": FORMAT, "flashgen": __version__, "abi": ABI_VERSION, "torch": torch.__version__,
            "python": list(sys.version_info[:2])}


def _warn_once(message: str) -> None:
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, AOTWarning, stacklevel=4)


def _mismatch(data) -> str | None:
    """Why an index does not serve this process, or None."""
    if not isinstance(data, dict):
        return f"{INDEX} is not a JSON object"
    def show(x) -> str:
        return ".".join(map(str, x)) if isinstance(x, list) else str(x)

    if data.get("format") != FORMAT:
        return (f"index format {show(data.get('format'))}, but this flashgen reads format {FORMAT} (kernel "
                f"families in artifacts): rebuild the directory with `flashgen build --out`")
    diffs = [f"{field} {show(data.get(field))} (this process: {show(want)})"
             for field, want in runtime().items() if data.get(field) != want]
    if diffs:
        return "built for " + ", ".join(diffs)
    if not isinstance(data.get("entries"), list):
        return f"{INDEX} has no entries list"
    return None


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


def _read_dir(path: Path) -> _Dir:
    index = path / INDEX
    try:
        data = json.loads(index.read_text())
    except FileNotFoundError:
        if not path.is_dir():
            return _Dir(path, {}, "does not exist or is not a directory")
        return _Dir(path, {}, f"no {INDEX} (not written by `flashgen build --out`)")
    except (OSError, ValueError) as e:
        return _Dir(path, {}, f"{INDEX} does not read: {e}")
    problem = _mismatch(data)
    if problem:
        return _Dir(path, {}, problem)
    entries = {e["variant"]: e for e in data["entries"]
               if isinstance(e, dict) and isinstance(e.get("variant"), str) and _plain_name(e.get("artifact"))}
    return _Dir(path, entries)


def _dir(path: Path) -> _Dir:
    """The index of an ahead-of-time directory, read once per process."""
    key = Path(os.path.abspath(path))
    with _lock:
        info = _dirs.get(key)
        if info is None:
            info = _dirs[key] = _read_dir(key)
            if info.problem:
                _warn_once(f"flashgen: ignoring ahead-of-time directory {path}: {info.problem}")
        return info


def reload() -> None:
    """Forget the indexes read and the verdicts on artifacts; the next lookup reads them again
    (libraries already loaded stay loaded)."""
    with _lock:
        _dirs.clear()
        _libs.clear()
        _bad.clear()
        _warned.clear()


def _forget(path: Path) -> None:
    key = Path(os.path.abspath(path))
    with _lock:
        _dirs.pop(key, None)
        for p in [p for p in (*_libs, *_bad) if p.parent.parent == key]:
            _libs.pop(p, None)
            _bad.pop(p, None)


def _open(inst: build.Instantiation, path: Path, sha256) -> tuple[build.LoadedLibrary | None, str]:
    """The verified, loaded artifact at ``path`` (None and why not)."""
    with _lock:
        if path in _libs:
            return _libs[path], ""
        if path in _bad:
            return None, _bad[path]
        try:
            ok = build.sha256_of(path) == sha256
            why = "" if ok else "its lib.so does not match the index's sha256 (modified or damaged)"
        except OSError as e:
            why = f"its lib.so does not read ({e.strerror or e})"
        if not why:
            try:
                _libs[path] = build.LoadedLibrary(inst, path)
                return _libs[path], ""
            except (OSError, AttributeError) as e:
                why = f"its lib.so does not load: {e}"
        _bad[path] = why
    _warn_once(f"flashgen: skipping {path}: {why}")
    return None, why


def find(inst: build.Instantiation, dirs: Iterable[Path] | None = None) -> tuple[build.LoadedLibrary | None, list[str]]:
    """The library of ``inst`` from the first of ``dirs`` (default FLASHGEN_AOT_DIR) that holds
    a verified copy, or None; with notes on directories and artifacts that were skipped.
    Computes no cache key, renders nothing, starts no process. Raises nothing for a bad
    directory (it is skipped with a one-time AOTWarning)."""
    dirs = env.aot_dirs() if dirs is None else list(dirs)
    variant = inst.variant_id()
    notes = []
    for d in dirs:
        info = _dir(d)
        if info.problem:
            notes.append(f"{d}: skipped, {info.problem}")
            continue
        entry = info.entries.get(variant)
        if entry is None:
            continue
        lib, why = _open(inst, info.path / entry["artifact"] / "lib.so", entry.get("sha256"))
        if lib is not None:
            return lib, notes
        notes.append(f"{d}: holds it in {entry['artifact']}/ but {why}")
    return None, notes


# ---------------------------------------------------------------- describing a variant


def _tiles_text(config: dict) -> str:
    from . import tiles

    if not all(k in config for k in tiles.TILE_KEYS):
        return ""
    f, b, q = tiles.from_config(config)
    return f"tiles fwd {f} bwd {b} dq {q}"


def describe(spec_name: str, target: tuple[str, str] | list, dtype: str, head_dim: int | None, config: dict) -> str:
    """One line naming a variant: spec, target (kernel family, arch), dtype, head dim, layout,
    sparsity, tiles."""
    backend, arch = target[0], target[1]
    if config.get("mask"):
        return f"{spec_name}: block classifier (block_mask / per-call block lists), {backend} {arch}"
    if head_dim is None:
        return (f"{spec_name}: {backend} {arch}, {dtype}, any head_dim (the {backend} kernels take the head dim "
                f"and the layout at run time)")
    parts = [f"{backend} {arch}", dtype, f"head_dim {head_dim}",
             "packed (varlen) layout" if config.get("varlen") else "padded layout",
             "block-sparse" if config.get("sparse") else "not block-sparse"]
    only = [k for k in ("fwd_only", "bwd_only") if config.get(k)]
    tiles = _tiles_text(config)
    return f"{spec_name}: " + ", ".join(parts + only + ([tiles] if tiles else []))


def describe_instantiation(inst: build.Instantiation) -> str:
    return describe(inst.spec.name, (inst.target.family, inst.target.arch), inst.dtype.value, inst.head_dim,
                    dict(inst.config))


def build_command(inst: build.Instantiation, out: str | Path = "DIR") -> str:
    """The ``flashgen build`` command line that puts ``inst`` into the directory ``out``."""
    span = inst.spec.span
    spec = span.file if span is not None and str(span.file).endswith(".attn") else f"{inst.spec.name}.attn"
    cmd = ["flashgen", "build", spec, "--out", str(out)]
    cfg = dict(inst.config)
    if inst.target.backend == "cpu":
        cmd += ["--device", "cpu", "--dtype", inst.dtype.value]
    else:
        cmd += ["--arch", inst.target.arch, "--dtype", inst.dtype.value]
        if inst.head_dim is not None:
            cmd += ["--head-dim", str(inst.head_dim)]
        if cfg.get("varlen"):
            cmd += ["--layouts", "packed"]
        if cfg.get("sparse") or cfg.get("mask"):
            cmd += ["--sparse"]
    return " ".join(shlex.quote(c) for c in cmd)


def _tiles_note(inst: build.Instantiation) -> str | None:
    """Why a CUDA variant's tiles may not come from a plain ``--arch`` build, or None."""
    from . import tiles

    cfg = dict(inst.config)
    if inst.target.backend != "cuda" or inst.head_dim is None or cfg.get("mask"):
        return None
    default = tiles.default_choice(inst.spec, inst.target.arch, inst.head_dim).config()
    if all(cfg.get(k) == v for k, v in default.items()):
        return None
    if env.cuda_fwd_tile() or env.cuda_bwd_tile():
        return ("its tiles come from FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE: build with the same "
                "settings, or unset them")
    return ("its tiles are not the architecture's table/derived defaults (tuned, or derived from this GPU's "
            "figures): build on a machine with this GPU (--device cuda) so the same tuning results apply, "
            "and keep the directory's tuning/ files")


def not_built_message(inst: build.Instantiation, dirs: list[Path], notes: list[str]) -> str:
    """The NotBuiltError text for ``inst``: the variant, where it was looked for, what the
    directories hold for its spec, and the command that builds it."""
    lines = [f"no ahead-of-time kernel for {describe_instantiation(inst)}, and JIT is disabled (FLASHGEN_JIT=0)",
             f"  variant: {inst.variant_id()}"]
    if dirs:
        lines.append("  searched (FLASHGEN_AOT_DIR): " + ", ".join(str(d) for d in dirs)
                     + " (with FLASHGEN_JIT=0 the kernel cache is not searched)")
    else:
        lines.append("  searched: nothing (FLASHGEN_AOT_DIR is not set or empty; with FLASHGEN_JIT=0 the kernel "
                     "cache is not searched)")
    lines += [f"  {n}" for n in notes]
    fp = inst.spec.fingerprint()
    held = []
    for d in dirs:
        info = _dir(d)
        for e in info.entries.values():
            if e.get("fingerprint") == fp:
                try:
                    held.append(describe(e["spec"], e["target"], e["dtype"], e["head_dim"], e["config"]))
                except (KeyError, TypeError, ValueError):
                    continue
    if held:
        shown = sorted(set(held))
        lines.append(f"  the directories hold for spec '{inst.spec.name}':")
        lines += [f"    {h}" for h in shown[:12]]
        if len(shown) > 12:
            lines.append(f"    … and {len(shown) - 12} more")
    elif dirs:
        lines.append(f"  the directories hold nothing for spec '{inst.spec.name}' (fingerprint {fp[:12]})")
    note = _tiles_note(inst)
    if note:
        lines.append(f"  note: {note}")
    out = dirs[0] if len(dirs) == 1 else "DIR"
    lines.append(f"  build it with: {build_command(inst, out)}")
    lines.append("  or unset FLASHGEN_JIT to compile it on first use")
    return "\n".join(lines)


# ---------------------------------------------------------------- planning a build


@dataclass(frozen=True)
class Planned:
    """One instantiation of a build: the spec's op, the instantiation, the CUDA device whose
    tuning it follows (None: no such GPU here, or CPU), and where its tiles came from."""

    op: object  # flashgen.ops.AttentionOp
    inst: build.Instantiation
    device_index: int | None = None
    origin: tuple[str, str] | None = None
    tuned_seqlen: tuple[int | None, int | None] | None = None


def _gpus() -> dict[str, int]:
    """Architecture -> index of the first local CUDA device of it."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out: dict[str, int] = {}
    for i in range(torch.cuda.device_count()):
        out.setdefault(build.cuda_arch(torch.cuda.get_device_capability(i)), i)
    return out


def targets(device=None, arches: Iterable[str] = ()) -> list[tuple[str, str, int | None]]:
    """(backend, arch, CUDA device index or None) to build for. ``arches``: CUDA architectures
    (sm_80, sm_90a, ...; a local GPU of that architecture lends its tuning); ``device``: 'cpu'
    adds the CPU, 'cuda[:N]' that GPU's architecture (or, with ``arches``, the GPU to prefer for
    its own architecture). Neither: the CPU. ValueError for an unknown architecture or device,
    or a CUDA device on a machine without one."""
    import torch

    from . import tiles

    arches = [arches] if isinstance(arches, str) else list(arches or ())
    out: list[tuple[str, str, int | None]] = []
    gpus: dict[str, int] | None = None
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cpu":
            out.append(("cpu", build.cpu_arch(), None))
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device: {device}: CUDA is not available here (use --arch to build for an "
                                 "architecture without its GPU)")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            arch = build.cuda_arch_of(index)
            gpus = {arch: index} | {a: i for a, i in _gpus().items() if a != arch}
            if not arches:
                out.append(("cuda", arch, index))
        else:
            raise ValueError(f"device: '{dev.type}' is not supported (expected cpu or cuda)")
    if arches:
        gpus = _gpus() if gpus is None else gpus
        for a in arches:
            arch = tiles.normalize_arch(a)
            out.append(("cuda", arch, gpus.get(arch)))
    if not out:
        out.append(("cpu", build.cpu_arch(), None))
    return list(dict.fromkeys(out))


def _as_op(spec):
    from .ops import AttentionOp, compile

    return spec if isinstance(spec, AttentionOp) else compile(spec)


def plan(specs: Iterable, *, device=None, arches: Iterable[str] = (), dtypes: Iterable | None = None,
         head_dims: Iterable[int] | None = None, layouts: Iterable[str] = ("padded",),
         sparse: Iterable[bool] | bool = (False,)) -> list[Planned]:
    """The instantiations ``build_dir`` compiles (see there for the arguments); computes no
    cache key and compiles nothing. Raises SpecError for a bad spec, ValueError / TypeError for
    bad arguments (naming them)."""
    from . import tiles
    from .ops import as_dtype, ranges_text

    ops = [_as_op(s) for s in ([specs] if isinstance(specs, str | Path) else specs)]
    if not ops:
        raise ValueError("specs: none given")
    tgts = targets(device, arches)
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    for lay in layouts:
        if lay not in ("padded", "packed"):
            raise ValueError(f"layouts: unknown layout {lay!r} (expected 'padded' and/or 'packed')")
    packs = sorted({lay == "packed" for lay in layouts}) or [False]
    sparse = (sparse,) if isinstance(sparse, bool) else tuple(sparse)
    if not all(isinstance(x, bool) for x in sparse):
        raise TypeError(f"sparse: expected bools, got {sparse!r}")
    want_dts = [as_dtype(d) for d in dtypes] if dtypes is not None else None
    want_hds = list(head_dims) if head_dims is not None else None
    out: dict[build.Instantiation, Planned] = {}

    def add(p: Planned) -> None:
        out.setdefault(p.inst, p)

    for op in ops:
        spec = op.spec
        for backend, arch, index in tgts:
            dts = want_dts if want_dts is not None else list(op.dtypes(backend))
            if not dts:
                raise ValueError(f"spec '{spec.name}' allows no dtype on {backend} (its dtype line: "
                                 f"{', '.join(d.value for d in spec.dtypes or ())})")
            for dt in dts:
                if dt not in op.dtypes(backend):
                    raise ValueError(f"dtypes: {dt.value} is not supported by spec '{spec.name}' on {backend} "
                                     f"(it allows {', '.join(d.value for d in op.dtypes(backend)) or 'none'})")
            fam = families.for_arch(backend, arch)
            if fam.runtime_head_dim:
                for dt in dts:
                    add(Planned(op, fam.instantiation(spec, arch, dt, None)))
                continue
            allowed = op.head_dims("cuda")
            if want_hds is not None:
                for hd in want_hds:
                    if hd not in allowed:
                        raise ValueError(f"head_dims: {hd} is not supported by spec '{spec.name}' on cuda "
                                         f"(expected one of {ranges_text(allowed)})")
                hds = want_hds
            else:
                hds = [d for d in (64, 128) if d in allowed] or list(allowed)
            sps = sorted(set(sparse) | ({True} if op.auto_sparse else set()))
            for dt in dts:
                for hd in hds:
                    lens: list[int | None] = [None]
                    if index is not None:
                        lens += sorted({n for kind in ("fwd", "bwd")
                                        for n in tune_store.tuned_seqlens(op.fingerprint, index, dt, hd, kind)})
                    for pk in packs:
                        for sp in sps:
                            choices = [tiles.choose(spec, arch, dt, hd, n, device_index=index,
                                                    fingerprint=op.fingerprint) for n in (lens if not sp else [None])]
                            if index is not None and len(lens) > 1:  # a GPU whose tuning does not apply
                                choices.append(tiles.choose(spec, arch, dt, hd, None, device_index=index,
                                                            use_tuned=False))
                            for ch in choices:
                                inst = fam.instantiation(spec, arch, dt, hd, packed=pk, sparse=sp, tiles=ch.config())
                                add(Planned(op, inst, index,
                                            (ch.fwd_origin, ch.bwd_origin), ch.tuned_seqlen))
            if True in sps:  # the block classifier (one per spec and arch, as ops.mask_library)
                add(Planned(op, fam.classifier(spec, arch), index))
    return list(out.values())


# ---------------------------------------------------------------- writing a directory


def _entry(p: Planned, artifact: Path, sha256: str) -> dict:
    inst = p.inst
    cfg = dict(inst.config)
    e = {
        "variant": inst.variant_id(),
        "artifact": artifact.name,
        "sha256": sha256,
        "spec": inst.spec.name,
        "fingerprint": inst.spec.fingerprint(),
        "target": [inst.target.family, inst.target.arch, inst.target.device],
        "dtype": inst.dtype.value,
        "head_dim": inst.head_dim,
        "config": cfg,
        "kinds": list(inst.kinds),
        "key": inst.key,
    }
    if inst.target.backend == "cuda":
        e["cuda"] = build.cuda_version()
        if p.origin is not None:
            e["tiles_origin"] = list(p.origin)
            e["tuned_seqlen"] = list(p.tuned_seqlen or (None, None))
    return e


def _copy_artifact(src: Path, out: Path, name: str) -> tuple[Path, str]:
    """Copy the cache entry ``src`` to ``out/name`` (replacing it) by one rename; (path, sha256).
    BuildError when the copy does not verify against the entry's manifest."""
    dest = out / name
    if dest.exists() and os.path.samefile(src, dest):
        return dest, build.sha256_of(dest / "lib.so")
    tmp = out / f".{name}-{uuid.uuid4().hex[:8]}.tmp"
    shutil.copytree(src, tmp)
    sha = build.sha256_of(tmp / "lib.so")
    try:
        manifest = json.loads((tmp / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("sha256") != sha:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{src}: lib.so does not match its manifest; it changed while being copied")
    if dest.exists():
        old = out / f".{name}-{uuid.uuid4().hex[:8]}.old"
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dest)
    return dest, sha


def _update_index(out: Path, new: list[dict]) -> dict:
    path = out / INDEX
    entries: dict[str, dict] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        problem = _mismatch(data)
        if problem:
            warnings.warn(f"flashgen: {path}: {problem}; starting a new index (its old entries are dropped)",
                          AOTWarning, stacklevel=3)
        else:
            entries = {e["variant"]: e for e in data["entries"] if isinstance(e, dict) and "variant" in e}
    for e in new:
        entries[e["variant"]] = e
    ordered = sorted(entries.values(), key=lambda e: (e.get("spec", ""), e.get("target", []), e.get("dtype", ""),
                                                      e.get("head_dim") or 0, e.get("artifact", "")))
    data = runtime() | {"entries": ordered}
    write_json_atomic(path, data)
    return data


def _copy_tuning(out: Path, planned: list[Planned]) -> list[Path]:
    """Copy the tuned winners of the built (spec, dtype, head dim)s of each local GPU into
    ``out/tuning/`` (merged with what is there under the same metadata)."""
    keys: dict[int, set[str]] = {}
    for p in planned:
        inst = p.inst
        if p.device_index is None or inst.head_dim is None:
            continue
        for kind in ("fwd", "bwd"):
            keys.setdefault(p.device_index, set()).add(tune_store.entry_key(p.op.fingerprint, inst.dtype,
                                                                            inst.head_dim, kind))
    written = []
    for index, want in sorted(keys.items()):
        stored = tune_store.entries(index)
        picked = {k: {str(n): r for n, r in sorted(stored[k].items())} for k in sorted(want) if stored.get(k)}
        if not picked:
            continue
        meta = tune_store.meta(index)
        path = out / "tuning" / tune_store.store_path(index).name
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = tune_store.read_file(path, meta) if path.exists() else {}
        for k, per_n in picked.items():
            merged.setdefault(k, {}).update(per_n)
        write_json_atomic(path, {"meta": meta, "entries": merged})
        written.append(path)
    return written


def build_dir(specs: Iterable, out: str | Path, *, device=None, arches: Iterable[str] = (),
              dtypes: Iterable | None = None, head_dims: Iterable[int] | None = None,
              layouts: Iterable[str] = ("padded",), sparse: Iterable[bool] | bool = (False,),
              jobs: int | None = None, announce: Callable[[str], None] | None = None) -> list[dict]:
    """Compile the kernels of ``specs`` into the ahead-of-time directory ``out`` and add them to
    its ``index.json`` (an existing directory keeps its other entries; a variant built again
    replaces its entry).

    Args:
        specs: spec paths, spec texts, ``ir.Spec``s or ``AttentionOp``s.
        out: the directory (created if missing).
        device: 'cpu' and/or (without ``arches``) 'cuda[:N]' for that GPU's architecture.
        arches: CUDA architectures (sm_80, sm_90a, ...) to build for, present or not; where a
            local GPU has the architecture, its tuned tiles apply and its tuning entries are
            copied to ``out/tuning/``. Neither device nor arches: the CPU.
        dtypes: default every dtype the spec allows on each backend.
        head_dims: CUDA head dims (default those of 64 and 128 the spec allows); ignored on CPU.
        layouts: 'padded' and/or 'packed' (CUDA; the CPU kernels take both).
        sparse: False and/or True: dense and/or block-sparse CUDA kernels; True adds the block
            classifier. Specs whose mask makes CUDA calls build block lists per call
            (``AttentionOp.auto_sparse``) always get the block-sparse kernels and the classifier.
        jobs: instantiations compiled at once (default: one per CPU core, at most all).
        announce: called with a message before each compile (a cache miss).

    Compiles through the build cache (FLASHGEN_CACHE_DIR) whatever FLASHGEN_JIT says, then
    copies each entry. Returns the index entries written.

    Raises:
        SpecError: a spec does not parse or validate.
        ValueError / TypeError: bad arguments (naming them).
        BuildError: a compile failed.
    """
    planned = plan(specs, device=device, arches=arches, dtypes=dtypes, head_dims=head_dims, layouts=layouts,
                   sparse=sparse)
    out = Path(out)
    build.check_toolchain(p.inst.target for p in planned)  # before DIR is created
    out.mkdir(parents=True, exist_ok=True)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs or max(1, min(len(planned), os.cpu_count() or 1))) as pool:
        libs = list(pool.map(lambda p: build.load_cached(p.inst, announce), planned))
    import filelock

    with filelock.FileLock(str(out / ".index.lock")):
        entries = []
        for p, lib in zip(planned, libs, strict=True):
            artifact, sha = _copy_artifact(lib.path.parent, out, p.inst.name)
            entries.append(_entry(p, artifact, sha))
        _copy_tuning(out, planned)
        _update_index(out, entries)
    _forget(out)
    if any(p.device_index is not None for p in planned):
        tune_store.reload()
    return entries
