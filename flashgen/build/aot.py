"""Ahead-of-time kernel directories: ``flashgen build SPEC... --out DIR`` writes them, a process
with ``FLASHGEN_AOT_DIR=DIR`` loads from them with no Jinja, no compiler and no tuning.

Writing one is flashgen/tools/aot_build.py's (``plan``, ``build_dir``). A directory holds one folder per instantiation, named like its cache entry (``lib.so``,
``manifest.json`` and the rendered ``src/`` for review, copied from the build cache), and
``index.json``::

    {"format": 2, "flashgen": <version>, "abi": <ABI_VERSION>, "torch": <torch.__version__>,
     "python": [major, minor],
     "entries": [{"variant": <Instantiation.variant_id()>, "artifact": <folder>, "sha256": <lib.so>,
                  "spec": <name>, "fingerprint": <spec fingerprint>, "target": [family, arch, device],
                  "dtype": ..., "head_dim": ..., "config": {...}, "kinds": [...], ...}, ...]}

CUDA builds made on a machine with a GPU of the target architecture use that GPU's tuned tiles
(flashgen.tune): one instantiation per tuned sequence-length bucket, plus the architecture's
untuned default, and the spec's entries of the tuning file are copied to
``DIR/tuning/<gpu>.json``, which flashgen.tune reads before the cache's, so calls choose the tiles
the directory holds. Without such a GPU (``--arch``) nvcc cross-compiles the table/derived tiles.
CUDA builds hold the decode kernels of ``op.with_kvcache`` too (one instantiation per dtype and
head dim, config ``decode``, kinds ``["decode"]``) unless built with ``--no-decode``.

Lookup (``find``, called by flashgen/runtime/loader.py before the cache): an index is read once per
process and used only when its torch, Python, ABI and flashgen versions are the running
process's (otherwise it is skipped with a one-time warning); an artifact is used only when its
``lib.so`` matches the index's sha256. With JIT disabled (``FLASHGEN_JIT=0``) a variant that no
directory holds raises ``NotBuiltError`` naming it and the command that builds it. A library is
loaded only when the directory, its ``index.json``, the artifact's folder and its ``lib.so`` are
owned by the current user or root and writable by no one else (flashgen.build.cache's
``check_private``); otherwise the lookup raises ``UntrustedPathError`` naming the path and the
fix. ``flashgen build --out`` writes them owner-only whatever the umask.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env, families, tiles
from ..abi import ABI_VERSION
from ..errors import NotBuiltError  # noqa: F401 - raised for this module's lookups (runtime/loader.py)
from ..version import __version__
from . import artifact, cache

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
_libs: dict[Path, cache.LoadedLibrary] = {}  # lib.so path -> loaded library
_bad: dict[Path, str] = {}  # lib.so path -> why it is not used
_warned: set[str] = set()


def runtime() -> dict:
    """What an index must record to be used by this process: format, flashgen, ABI, torch and
    Python versions."""
    return {"format": FORMAT, "flashgen": __version__, "abi": ABI_VERSION, "torch": torch.__version__,
            "python": list(sys.version_info[:2])}


def _warn_once(message: str) -> None:
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, AOTWarning, stacklevel=4)


def mismatch(data) -> str | None:
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
    problem = mismatch(data)
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


def forget(path: Path) -> None:
    key = Path(os.path.abspath(path))
    with _lock:
        _dirs.pop(key, None)
        for p in [p for p in (*_libs, *_bad) if p.parent.parent == key]:
            _libs.pop(p, None)
            _bad.pop(p, None)


def _open(inst: artifact.Instantiation, path: Path, sha256) -> tuple[cache.LoadedLibrary | None, str]:
    """The verified, loaded artifact at ``path`` (None and why not)."""
    with _lock:
        if path in _libs:
            return _libs[path], ""
        if path in _bad:
            return None, _bad[path]
        try:
            ok = cache.sha256_of(path) == sha256
            why = "" if ok else "its lib.so does not match the index's sha256 (modified or damaged)"
        except OSError as e:
            why = f"its lib.so does not read ({e.strerror or e})"
        if not why:
            try:
                _libs[path] = cache.LoadedLibrary(inst, path)
                return _libs[path], ""
            except (OSError, AttributeError) as e:
                why = f"its lib.so does not load: {e}"
        _bad[path] = why
    _warn_once(f"flashgen: skipping {path}: {why}")
    return None, why


_AOT_FIX = ("make the directory yours and owner-only (`flashgen build --out` writes it so), or drop it from "
            "FLASHGEN_AOT_DIR")


def find(inst: artifact.Instantiation, dirs: Iterable[Path] | None = None) -> tuple[cache.LoadedLibrary | None, list[str]]:
    """The library of ``inst`` from the first of ``dirs`` (default FLASHGEN_AOT_DIR) that holds
    a verified copy, or None; with notes on directories and artifacts that were skipped.
    Computes no cache key, renders nothing, starts no process. A bad directory (a version
    mismatch, no index) is skipped with a one-time AOTWarning.

    Raises:
        UntrustedPathError: the directory holding ``inst`` (or its index.json, the artifact's
            folder or lib.so) is owned by another user or writable by others.
    """
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
        folder = info.path / entry["artifact"]
        cache.check_private((info.path, info.path / INDEX, folder, folder / "lib.so"),
                            f"{entry['artifact']} from the ahead-of-time directory {d}", _AOT_FIX)
        lib, why = _open(inst, folder / "lib.so", entry.get("sha256"))
        if lib is not None:
            return lib, notes
        notes.append(f"{d}: holds it in {entry['artifact']}/ but {why}")
    return None, notes


# ---------------------------------------------------------------- describing a variant


def _family(name):
    """The kernel family called ``name`` (None for a name no family has)."""
    return families.FAMILIES.get(name)


def _tiles_text(config: dict, family: str = "sm80") -> str:
    fam = _family(family)
    return fam.tiles_text(config) if fam is not None else ""


def describe(spec_name: str, target: tuple[str, str] | list, dtype: str, head_dim: int | None, config: dict) -> str:
    """One line naming a variant: spec, target (kernel family, arch), dtype, head dim, layout,
    sparsity, tiles."""
    backend, arch = target[0], target[1]
    if config.get("mask"):
        return f"{spec_name}: block classifier (block_mask / per-call block lists), {backend} {arch}"
    if config.get("decode"):
        return (f"{spec_name}: decode kernels (with_kvcache), {backend} {arch}, {dtype}, head_dim {head_dim}, "
                f"{config.get('decode_block_n')} keys x {config.get('decode_stages')} stages"
                + (f", K/V by bulk copies ({config['decode_bulk']})" if config.get("decode_bulk") else ""))
    if head_dim is None:
        return (f"{spec_name}: {backend} {arch}, {dtype}, any head_dim (the {backend} kernels take the head dim "
                f"and the layout at run time)")
    parts = [f"{backend} {arch}", dtype, f"head_dim {head_dim}",
             "packed (varlen) layout" if config.get("varlen") else "padded layout",
             "block-sparse" if config.get("sparse") else "not block-sparse"]
    only = [k for k in ("fwd_only", "bwd_only") if config.get(k)]
    text = _tiles_text(config, backend)
    return f"{spec_name}: " + ", ".join(parts + only + ([text] if text else []))


def describe_instantiation(inst: artifact.Instantiation) -> str:
    return describe(inst.spec.name, (inst.target.family, inst.target.arch), inst.dtype.value, inst.head_dim,
                    dict(inst.config))


def build_command(inst: artifact.Instantiation, out: str | Path = "DIR") -> str:
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
        if cfg.get("decode"):  # (the default; named so that the command says what it adds)
            cmd += ["--decode"]
        if cfg.get("varlen"):
            cmd += ["--layouts", "packed"]
        if cfg.get("sparse") or cfg.get("mask"):
            cmd += ["--sparse"]
    return " ".join(shlex.quote(c) for c in cmd)


def _tiles_note(inst: artifact.Instantiation) -> str | None:
    """Why a CUDA variant's tiles may not come from a plain ``--arch`` build, or None: its tile
    keys compared with its own family's untuned defaults (an sm90 kernel with sm90's)."""
    cfg = dict(inst.config)
    if inst.target.backend != "cuda" or inst.head_dim is None or cfg.get("mask") or cfg.get("decode"):
        return None  # (the classifier has no tiles; the decode tile is the architecture's, never tuned)
    fam = _family(inst.target.family)
    if fam is None or not fam.tuned:
        return None
    # like with like: the kernel's tiles against its own family's untuned defaults (sm90's forward
    # against sm90.default_tiles, sm80's against the tables / derived tiles)
    if fam.name == "sm80":  # the tables / derived tiles (no FLASHGEN_CUDA_*_TILE)
        default = tiles.default_choice(inst.spec, inst.target.arch, inst.head_dim).config()
    else:
        default = fam.choose_tiles(inst.spec, inst.target.arch, inst.dtype, inst.head_dim,
                                   sparse=bool(cfg.get("sparse")), use_tuned=False).config()
    full = dict(fam.config(inst.spec, inst.target.arch, inst.dtype, inst.head_dim, packed=bool(cfg.get("varlen")),
                           sparse=bool(cfg.get("sparse")), tiles=default))
    if {k: cfg[k] for k in fam.tile_keys if k in cfg} == {k: full[k] for k in fam.tile_keys if k in full}:
        return None
    if inst.target.family == "sm80" and (env.cuda_fwd_tile() or env.cuda_bwd_tile()):
        return ("its tiles come from FLASHGEN_CUDA_FWD_TILE / FLASHGEN_CUDA_BWD_TILE: build with the same "
                "settings, or unset them")
    if fam.name != "sm80":
        return (f"its tiles ({fam.tiles_text(cfg).removeprefix('tiles ')}) are not the {fam.name} family's "
                f"defaults ({fam.tiles_text(full).removeprefix('tiles ')}): they were tuned on a GPU; build on a "
                "machine with this GPU (--device cuda) so the same tuning results apply, and keep the "
                "directory's tuning/ files")
    return ("its tiles are not the architecture's table/derived defaults (tuned, or derived from this GPU's "
            "figures): build on a machine with this GPU (--device cuda) so the same tuning results apply, "
            "and keep the directory's tuning/ files")


def not_built_message(inst: artifact.Instantiation, dirs: list[Path], notes: list[str]) -> str:
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
