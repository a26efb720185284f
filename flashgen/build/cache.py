"""Build and cache compiled kernels: a file lock, atomic publish, verified loads.

An instantiation (flashgen/build/artifact.py) is compiled by torch.utils.cpp_extension with ninja
from its rendered translation units. The cache entry ``<root>/<artifact>/`` holds ``lib.so``, the
rendered ``src/`` and ``manifest.json`` (the key and the library's sha256), published by one
rename after a successful build; anything that does not verify is a miss and is rebuilt under the
lock. A cached load renders nothing and starts no compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import filelock

from .. import env
from ..abi import ABI_VERSION
from ..errors import BuildError
from ..paths import include_dir
from .artifact import Instantiation, compiler_flags


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_ok(entry: Path, key: str) -> bool:
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        return manifest["key"] == key and manifest["sha256"] == sha256_of(entry / "lib.so")
    except (OSError, KeyError, ValueError):
        return False


class LoadedLibrary:
    """A verified, dlopen'ed artifact: ``fwd`` and ``bwd`` entry points, ``error`` (CUDA) for the
    reason of a failed call."""

    def __init__(self, inst: Instantiation, path: Path):
        self.instantiation, self.path = inst, path
        self.lib = ctypes.CDLL(str(path))
        abi = getattr(self.lib, inst.symbol(inst.kinds[0]) + "_abi")
        abi.restype = ctypes.c_int
        if abi() != ABI_VERSION:
            raise OSError(f"{path}: ABI version {abi()} != {ABI_VERSION}")
        has = lambda k: getattr(self.lib, inst.symbol(k)) if k in inst.kinds else None  # noqa: E731
        self.fwd, self.bwd, self.classify = has("fwd"), has("bwd"), has("mask")
        self.errors = {}
        for kind, fn in (("fwd", self.fwd), ("bwd", self.bwd), ("mask", self.classify)):
            if fn is None:
                continue
            fn.restype = ctypes.c_int
            err = getattr(self.lib, inst.symbol(kind) + "_error", None)
            if err is not None:
                err.restype = ctypes.c_char_p
            self.errors[kind] = err

    def error(self, kind: str) -> str:
        err = self.errors.get(kind)
        return err().decode(errors="replace") if err is not None else ""


_loaded: dict[tuple[str, str], LoadedLibrary] = {}
_loaded_lock = threading.Lock()


def load_cached(inst: Instantiation, announce: Callable[[str], None] | None = None) -> LoadedLibrary:
    """The loaded library for ``inst`` from this process or the cache, or a fresh build (the
    ahead-of-time directories come first in flashgen/runtime/loader.py's ``load``).

    ``announce`` is called with a message before a compile starts (a cache miss).

    Raises:
        BuildError: the compiler failed.
    """
    root = env.cache_dir()
    # Per cache root: a library this process loaded from another root (the cache directory
    # changed) is not in this one, and "built into the cache" must mean this cache.
    key = (str(root), inst.key)
    with _loaded_lock:
        if key in _loaded:
            return _loaded[key]
    entry = root / inst.name
    lib = _try_load(inst, entry)
    if lib is None:
        root.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(root / f"{inst.name}.lock")):
            lib = _try_load(inst, entry)  # another process may have built it meanwhile
            if lib is None:
                if announce:
                    announce(f"compiling {inst.name} (first use; cached in {root})")
                _build_and_publish(inst, entry)
                lib = _try_load(inst, entry)
                if lib is None:
                    raise BuildError(f"built {entry} but it does not load or verify")
    with _loaded_lock:
        return _loaded.setdefault(key, lib)


def _try_load(inst: Instantiation, entry: Path) -> LoadedLibrary | None:
    if not _entry_ok(entry, inst.key):
        return None
    try:
        return LoadedLibrary(inst, entry / "lib.so")
    except (OSError, AttributeError):
        return None


def check_toolchain(targets) -> None:
    """Raise BuildError when this torch cannot build for one of ``targets``: CUDA kernels are
    compiled and linked by torch.utils.cpp_extension against a CUDA build of torch (with nvcc);
    a CPU-only torch (torch.version.cuda None) cannot build them, whatever CUDA_HOME says."""
    import torch

    if any(t.backend == "cuda" for t in targets) and torch.version.cuda is None:
        raise BuildError(f"building CUDA kernels needs a CUDA build of torch and nvcc; this torch "
                         f"({torch.__version__}) is CPU-only. Cross-compile (--arch) on a machine with a CUDA "
                         "build of torch (the same version the kernels will load under)")


def _build_and_publish(inst: Instantiation, entry: Path) -> None:
    from torch.utils import cpp_extension

    check_toolchain([inst.target])

    tmp_root = entry.parent / ".tmp"
    work = tmp_root / f"{inst.name}-{uuid.uuid4().hex[:8]}"
    (work / "src").mkdir(parents=True)
    sources = []
    for fname, text in inst.sources().items():
        sources.append(work / "src" / fname)
        sources[-1].write_text(text)
    cflags, cuda_cflags = compiler_flags(inst.target)
    start = time.perf_counter()
    try:
        path = cpp_extension.load(
            name=inst.name,
            sources=[str(p) for p in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=["-fopenmp"] if inst.target.backend == "cpu" else [],
            extra_include_paths=[str(include_dir())],
            build_directory=str(work),
            verbose=env.verbose(),
            with_cuda=inst.target.backend == "cuda",
            is_python_module=False,
        )
    except (RuntimeError, OSError, ValueError) as e:
        failed = entry.parent / "failed" / inst.name
        shutil.rmtree(failed, ignore_errors=True)
        failed.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work), str(failed))
        raise BuildError(
            f"failed to build {inst.name}\n  generated sources: {failed / 'src'}\n"
            f"  spec: {inst.spec.span.file if inst.spec.span else '<spec>'}\n{e}"
        ) from None
    seconds = time.perf_counter() - start
    publish = tmp_root / f"{inst.name}-{uuid.uuid4().hex[:8]}-publish"
    publish.mkdir()
    shutil.copy2(path, publish / "lib.so")
    shutil.copytree(work / "src", publish / "src")
    manifest = {
        "key": inst.key,
        "sha256": sha256_of(publish / "lib.so"),
        "fields": inst.key_fields(),
        "build_seconds": round(seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (publish / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if entry.exists():  # a broken entry (we hold the lock): replace it
        shutil.rmtree(entry, ignore_errors=True)
    publish.rename(entry)
    shutil.rmtree(work, ignore_errors=True)
