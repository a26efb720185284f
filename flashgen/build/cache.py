"""Build and cache compiled kernels: a file lock, atomic publish, verified loads.

An instantiation (flashgen/build/artifact.py) is compiled by torch.utils.cpp_extension with ninja
from its rendered translation units. The cache entry ``<root>/<artifact>/`` holds ``lib.so``, the
rendered ``src/`` and ``manifest.json`` (the key and the library's sha256), published by one
rename after a successful build; anything that does not verify is a miss and is rebuilt under the
lock. A cached load renders nothing and starts no compiler.

A compiled library is code that runs in the user's process, so the cache is kept owner-only: the
root, its entries and everything in them are created 0700 / 0600 whatever the umask, and a
library is loaded only from a root, entry and ``lib.so`` that are owned by the current user or
root and that no other user can write (``check_private``; as ssh's StrictModes, a group-writable
path is accepted only when its group is the owner's private group). A shared
``FLASHGEN_CACHE_DIR`` under /tmp, prepared by another user, is refused with an error naming the
path and the fix (``UntrustedPathError``). Build folders under ``.tmp/`` that a killed build left
behind are removed by the next build once their lock is free.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import filelock

from .. import env
from ..abi import ABI_VERSION
from ..errors import BuildError, UntrustedPathError
from ..paths import include_dir, owner_only, private_dir
from .artifact import Instantiation, compiler_flags


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_problem(entry: Path, key: str) -> str | None:
    """Why the cache entry ``entry`` does not verify for ``key`` (None: it does)."""
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
    except FileNotFoundError:
        return "no manifest.json"
    except (OSError, ValueError) as e:
        return f"manifest.json does not read: {e}"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return "its manifest is for another key"
    try:
        ok = manifest.get("sha256") == sha256_of(entry / "lib.so")
    except FileNotFoundError:
        return "no lib.so"
    except OSError as e:
        return f"lib.so does not read: {e.strerror or e}"
    return None if ok else "checksum mismatch"


def _entry_ok(entry: Path, key: str) -> bool:
    return _entry_problem(entry, key) is None


# ---------------------------------------------------------------- owner-only paths

def _private_group(st: os.stat_result) -> bool:
    """Whether the group of ``st`` is its owner's private group (named like the owner, the
    owner's primary group, no other members): then group write access is the owner's alone."""
    try:
        import grp
        import pwd

        owner, group = pwd.getpwuid(st.st_uid), grp.getgrgid(st.st_gid)
    except (ImportError, KeyError):
        return False
    return owner.pw_gid == st.st_gid and group.gr_name == owner.pw_name and set(group.gr_mem) <= {owner.pw_name}


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _stat_posix(path: Path) -> os.stat_result | None:
    """``path``'s stat where POSIX owners exist and it exists, else None."""
    if not hasattr(os, "geteuid"):
        return None  # no POSIX owners (Windows)
    try:
        return os.stat(path)
    except OSError:
        return None  # what does not exist holds nothing yet


def _owner_problem(st: os.stat_result) -> str | None:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"is owned by {_user(st.st_uid)}, not by you ({_user(me)}) or root"
    return None


def owner_problem(path: Path) -> str | None:
    """The owner part of ``path_problem``: why ``path``'s owner (someone other than the current
    user or root) could change what it holds, or None."""
    st = _stat_posix(path)
    return None if st is None else _owner_problem(st)


def path_problem(path: Path) -> str | None:
    """Why another user could change what ``path`` holds (None: only its owner, the current user
    or root, can): its owner is someone else, or it is writable by others, or by a group other
    than its owner's private group."""
    st = _stat_posix(path)
    if st is None:
        return None
    owner = _owner_problem(st)
    if owner is not None:
        return owner
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _private_group(st)):
        who = "others" if mode & stat.S_IWOTH else "its group"
        return f"is writable by {who} (mode {mode:04o})"
    return None


def check_private(paths, what: str, fix: str) -> None:
    """Raise ``UntrustedPathError`` naming the first of ``paths`` whose contents another user could
    change (``path_problem``): ``what`` is the library it refuses to load, ``fix`` how to make the
    path safe (appended to the message)."""
    for path in paths:
        problem = path_problem(path)
        if problem is not None:
            owned = problem.startswith("is owned")
            hint = f"remove it, or {fix}" if owned else f"run `chmod go-w {shlex.quote(str(path))}`, or {fix}"
            raise UntrustedPathError(
                f"refusing to load {what}: {path} {problem}, so another user could replace the library, "
                f"which would run as code in this process\n  fix: {hint}")


_CACHE_FIX = ("point FLASHGEN_CACHE_DIR at a directory of your own (the default, ~/.cache/flashgen, is created "
              "owner-only)")


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
        self.decode = has("decode")  # a decode instantiation's entry (takes an FgFwdArgs)
        self.errors = {}
        for kind, fn in (("fwd", self.fwd), ("bwd", self.bwd), ("mask", self.classify), ("decode", self.decode)):
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

    ``announce`` is called with a message before a compile starts (a cache miss, or an entry
    that does not verify: "cache entry … is damaged (…); rebuilding") and when another process
    holds the entry's build lock ("waiting for another process building …").

    Raises:
        BuildError: the compiler failed, or is missing (the first line names what is missing),
            or the cache root cannot be written (the message names FLASHGEN_CACHE_DIR), or
            the disk filled up during the build (no entry is left behind).
        UntrustedPathError (a BuildError): the cache root, the entry or its ``lib.so`` is owned
            by another user or writable by others; the message names the path and the fix.
    """
    root = env.cache_dir()
    # Per cache root: a library this process loaded from another root (the cache directory
    # changed) is not in this one, and "built into the cache" must mean this cache.
    key = (str(root), inst.key)
    with _loaded_lock:
        if key in _loaded:
            return _loaded[key]
    entry = root / inst.name
    lib, why = _try_load(inst, root, entry)
    if lib is None:
        with _build_lock(root, inst, announce):
            lib, why = _try_load(inst, root, entry)  # another process may have built it meanwhile
            if lib is None:
                check_toolchain([inst.target])  # a missing compiler is said before "compiling …"
                if announce:
                    announce(f"compiling {inst.name} (first use; cached in {root})" if why is None else
                             f"cache entry {entry} is damaged ({why}); rebuilding")
                _sweep(root, inst.name)
                _build_and_publish(inst, entry)
                lib, why = _try_load(inst, root, entry)
                if lib is None:
                    raise BuildError(f"built {entry} but it does not load or verify ({why})")
    with _loaded_lock:
        return _loaded.setdefault(key, lib)


def load_together(insts: Sequence[Instantiation], announce: Callable[[str], None] | None = None, *,
                  units: int | None = None) -> list[LoadedLibrary]:
    """The loaded libraries of ``insts``, as ``load_cached`` gives them, those missing from the
    cache compiled together into one shared library: their translation units concatenated into
    ``units`` files (default twice the cores) that ninja compiles in parallel, the library
    published as each one's entry (its lib.so; src/ its own sources, as a build of its own
    writes them). One build instead of one per instantiation saves each its compiler start-up,
    header parsing and link: for many small instantiations (tests, the spec fuzzer).

    Raises ValueError unless the instantiations share one target and have distinct spec names
    (their entry points share the library); otherwise as ``load_cached``.
    """
    insts = list(dict.fromkeys(insts))
    if len({i.target for i in insts}) > 1:
        raise ValueError("insts: instantiations of one target only")
    if len({i.spec.name for i in insts}) < len(insts):
        raise ValueError("insts: two instantiations of one spec name (their variants and entry points would "
                         "clash in one library)")
    root = env.cache_dir()
    missing = [i for i in insts if (str(root), i.key) not in _loaded and _try_load(i, root, root / i.name)[0] is None]
    if missing:
        check_toolchain([missing[0].target])
        with ExitStack() as stack:
            for inst in sorted(missing, key=lambda i: i.name):  # one order: no deadlock between processes
                stack.enter_context(_build_lock(root, inst, announce))
            missing = [i for i in missing if _try_load(i, root, root / i.name)[0] is None]
            if missing:
                if announce:
                    announce(f"compiling {len(missing)} instantiations together (first use; cached in {root})")
                for inst in missing:
                    _sweep(root, inst.name)
                _build_together(missing, root, units or 2 * (os.cpu_count() or 1))
    return [load_cached(i, announce) for i in insts]


def _build_together(insts: list[Instantiation], root: Path, units: int) -> None:
    """Compile ``insts`` into one library and publish it as each one's entry (the caller holds
    their locks). As ``_build_and_publish``: no entry is left by a failure."""
    tmp_root = root / ".tmp"
    work = tmp_root / f"{insts[0].name}-{uuid.uuid4().hex[:8]}"  # swept only under insts[0]'s lock
    publish = {i: tmp_root / f"{i.name}-{uuid.uuid4().hex[:8]}-publish" for i in insts}
    try:
        if os.path.lexists(tmp_root) and not tmp_root.is_dir():
            tmp_root.unlink()
        private_dir(tmp_root)
        private_dir(work)
        private_dir(work / "src")
        rendered = {i: i.sources() for i in insts}
        # The backward units cost about twice the forward ones: the heaviest first, each to the
        # lightest file that holds nothing of its spec yet (one variant struct per file).
        tus = sorted(((2 if "bwd" in f else 1, i, f) for i in insts for f in rendered[i]), key=lambda t: -t[0])
        files: list[list[str]] = [[] for _ in range(max(1, min(units, len(tus))))]
        load, held = [0] * len(files), [set() for _ in files]
        for cost, inst, fname in tus:
            free = [j for j in range(len(files)) if inst not in held[j]]
            if not free:
                files.append([])
                load.append(0)
                held.append(set())
                free = [len(files) - 1]
            j = min(free, key=lambda x: load[x])
            files[j].append(f"// ---- {inst.name}: {fname}\n" + rendered[inst][fname])
            load[j] += cost
            held[j].add(inst)
        paths = []
        for j, texts in enumerate(files):
            paths.append(work / "src" / f"unit{j}.cpp")
            paths[-1].write_text("\n".join(texts))
        name = "fg_together_" + hashlib.sha256("".join(i.key for i in insts).encode()).hexdigest()[:12]
        try:
            lib, seconds = _compile(name, insts[0].target, paths, work)
        except BuildError as e:
            raise _compile_failed(insts[0], work, e.__cause__ or e) from None
        together = sorted(i.name for i in insts)
        for inst in insts:
            _assemble(inst, lib, rendered[inst], seconds, publish[inst], built_together=together)
        for inst in insts:
            entry = root / inst.name
            if os.path.lexists(entry):  # a broken entry (we hold the lock): replace it
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            publish[inst].rename(entry)
    except OSError as e:
        for folder in (work, *publish.values()):
            shutil.rmtree(folder, ignore_errors=True)
        raise _write_failed(f"{len(insts)} instantiations together", e, root) from None
    shutil.rmtree(work, ignore_errors=True)


def _try_load(inst: Instantiation, root: Path, entry: Path) -> tuple[LoadedLibrary | None, str | None]:
    """(the verified library of ``entry``, None), or (None, why it is damaged; None when there is
    no entry). Raises UntrustedPathError before loading from a path another user could change."""
    if not os.path.lexists(entry):
        return None, None
    if not entry.is_dir():
        return None, "a file is where its folder should be"
    problem = _entry_problem(entry, inst.key)
    if problem is not None:
        return None, problem
    check_private((root, entry, entry / "lib.so"), inst.name, _CACHE_FIX)
    try:
        return LoadedLibrary(inst, entry / "lib.so"), None
    except (OSError, AttributeError) as e:
        return None, f"its lib.so does not load: {e}"


def _unwritable_root(root: Path, e: OSError) -> BuildError:
    where = (f"FLASHGEN_CACHE_DIR is {root}" if env.cache_dir_set() else
             f"the default {root}, as FLASHGEN_CACHE_DIR is not set")
    return BuildError(f"the kernel cache {root} is not writable ({e.strerror or e}; {where}): set "
                      "FLASHGEN_CACHE_DIR to a writable directory of your own, or load prebuilt kernels with "
                      "FLASHGEN_AOT_DIR")


class _build_lock:
    """The build lock of ``inst``'s entry under ``root`` (created owner-only, with the root),
    announcing a wait for another process. BuildError naming FLASHGEN_CACHE_DIR when the root
    cannot be created or written; UntrustedPathError when another user could change it."""

    def __init__(self, root: Path, inst: Instantiation, announce: Callable[[str], None] | None):
        self.root, self.inst, self.announce = root, inst, announce

    def __enter__(self):
        root = self.root
        try:
            private_dir(root)
        except (FileExistsError, NotADirectoryError) as e:
            in_way = next((p for p in (root, *root.parents) if os.path.lexists(p) and not p.is_dir()), root)
            where = f"the kernel cache {root} is a file" if in_way == root else \
                f"{in_way}, a folder of the kernel cache {root}, is a file"
            raise BuildError(f"{where}, not a folder: set FLASHGEN_CACHE_DIR to a directory (or remove the "
                             "file)") from e
        except OSError as e:
            raise _unwritable_root(root, e) from None
        check_private((root,), f"kernels from the cache {root}", _CACHE_FIX)
        path = root / f"{self.inst.name}.lock"
        self.lock = filelock.FileLock(str(path), mode=0o600)
        try:
            try:
                self.lock.acquire(timeout=0)
            except filelock.Timeout:
                if self.announce:
                    self.announce(f"waiting for another process building {self.inst.name} (lock {path})")
                self.lock.acquire()
        except OSError as e:
            raise _unwritable_root(root, e) from None
        return self

    def __exit__(self, *exc):
        self.lock.release()
        return False


_TMP_NAME = re.compile(r"(?P<name>.+)-[0-9a-f]{8}(-publish)?")


def _sweep(root: Path, holding: str) -> None:
    """Remove build folders under ``root/.tmp`` that no build is using: those of ``holding`` (the
    caller holds its lock) and those of other instantiations whose lock is free (a killed build's
    leftovers). Never raises."""
    try:
        folders = list((root / ".tmp").iterdir())
    except OSError:
        return
    for folder in folders:
        m = _TMP_NAME.fullmatch(folder.name)
        if m is None:
            continue
        name = m.group("name")
        if name == holding:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        lock = filelock.FileLock(str(root / f"{name}.lock"), mode=0o600)
        try:
            lock.acquire(timeout=0)
        except (filelock.Timeout, OSError):
            continue  # being built now (or not ours to lock)
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            lock.release()


def _toolchain_problem(targets) -> str | None:
    """The first line of a BuildError for a compiler that is missing, or None."""
    import torch

    targets = list(targets)
    if any(t.backend == "cuda" for t in targets):
        if torch.version.cuda is None:
            return (f"building CUDA kernels needs a CUDA build of torch and nvcc; this torch "
                    f"({torch.__version__}) is CPU-only. Cross-compile (--arch) on a machine with a CUDA "
                    "build of torch (the same version the kernels will load under)")
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            return ("no CUDA compiler (nvcc) found: install the CUDA toolkit (matching torch's CUDA "
                    f"{torch.version.cuda}) or set CUDA_HOME to it")
    cxx = env.cxx()
    words = shlex.split(cxx) or ["c++"]
    if shutil.which(words[0]) is None:
        told = f"CXX is {cxx!r}, not found" if env.cxx_set() else "no c++ on PATH"
        return f"no C++ compiler found: install g++ (a C++17 compiler with OpenMP) or set CXX ({told})"
    if shutil.which("ninja") is None:  # torch.utils.cpp_extension runs the one on PATH
        beside = Path(sys.executable).parent
        if (beside / "ninja").exists():
            return f"ninja not found on PATH: activate this Python's environment (PATH is missing {beside})"
        return "ninja not found: install it into this environment (pip install ninja, a flashgen dependency)"
    return None


def check_toolchain(targets) -> None:
    """Raise BuildError when this machine cannot build for one of ``targets``, its first line
    naming what is missing: a C++ compiler (CXX, else c++ on PATH; g++ or clang++ with OpenMP),
    ninja, and for CUDA a CUDA build of torch with nvcc. CUDA kernels are compiled and linked by
    torch.utils.cpp_extension against a CUDA build of torch; a CPU-only torch (torch.version.cuda
    None) cannot build them, whatever CUDA_HOME says."""
    problem = _toolchain_problem(targets)
    if problem is not None:
        raise BuildError(problem)


# Compiler output that means a prerequisite is missing -> the first line of the BuildError.
# g++ says "omp.h: No such file or directory", clang++ "'omp.h' file not found"; a compiler without
# OpenMP support refuses -fopenmp; the linker misses libgomp (g++) or libomp (clang++).
_NO_OPENMP = ("the C++ compiler has no OpenMP ({}): install it (libgomp for g++, libomp for clang++) or set CXX to "
              "a compiler with OpenMP")
_MISSING = (
    (re.compile(r"omp\.h'?:? (No such file|file not found)"), _NO_OPENMP.format("omp.h not found")),
    (re.compile(r"unsupported option '-fopenmp'|unrecognized command[- ]line option '-fopenmp'"),
     _NO_OPENMP.format("it does not take -fopenmp")),
    (re.compile(r"cannot find -l(gomp|omp)\b|library not found for -l(gomp|omp)\b|unable to find library -l(gomp|omp)"
                r"\b"), _NO_OPENMP.format("its OpenMP runtime library is not found")),
    (re.compile(r"Python\.h'?:? (No such file|file not found)"), ("Python's C headers (Python.h) not found: install "
                                                                 "the Python development package (python3-dev or "
                                                                 "python3-devel)")),
    (re.compile(r"No space left on device"), "no space left on device"),
)


def _no_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def _build_and_publish(inst: Instantiation, entry: Path) -> None:
    """Compile ``inst`` and publish it at ``entry`` by one rename (the caller holds its lock). On
    any failure no entry is left: BuildError, its first line naming a missing prerequisite or a
    full disk where that is the cause."""
    check_toolchain([inst.target])
    root = entry.parent
    tmp_root = root / ".tmp"
    work = tmp_root / f"{inst.name}-{uuid.uuid4().hex[:8]}"
    publish = tmp_root / f"{inst.name}-{uuid.uuid4().hex[:8]}-publish"
    try:
        if os.path.lexists(tmp_root) and not tmp_root.is_dir():
            tmp_root.unlink()
        private_dir(tmp_root)
        _build_into(inst, work, publish)
        if os.path.lexists(entry):  # a broken entry (we hold the lock): replace it
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        publish.rename(entry)
    except OSError as e:
        for folder in (work, publish):
            shutil.rmtree(folder, ignore_errors=True)
        raise _write_failed(inst.name, e, root) from None
    shutil.rmtree(work, ignore_errors=True)


def _write_failed(what: str, e: OSError, root: Path) -> BuildError:
    """The BuildError of a build of ``what`` whose write under ``root`` failed with ``e`` (its
    folders already removed: nothing was cached)."""
    where = e.filename or root
    if _no_space(e):
        return BuildError(f"failed to build {what}: no space left on device writing {where}; nothing was cached. "
                          "Free some space, or set FLASHGEN_CACHE_DIR to a directory on another disk")
    return BuildError(f"failed to build {what}: could not write {where} ({e.strerror or e}); nothing was cached")


def _build_into(inst: Instantiation, work: Path, publish: Path) -> None:
    """Render and compile ``inst`` in ``work``, then assemble its entry (lib.so, src/, manifest)
    owner-only in ``publish``. OSError for a failed write; BuildError for a failed compile."""
    private_dir(work)
    private_dir(work / "src")
    sources = inst.sources()
    for fname, text in sources.items():
        (work / "src" / fname).write_text(text)
    try:
        path, seconds = _compile(inst.name, inst.target, [work / "src" / f for f in sources], work)
    except BuildError as e:
        raise _compile_failed(inst, work, e.__cause__ or e) from None
    _assemble(inst, path, sources, seconds, publish)


def _compile(name: str, target, sources: list[Path], work: Path) -> tuple[Path, float]:
    """Compile and link ``sources`` into ``work``'s shared library ``name`` with ``target``'s
    flags: (its path, the seconds it took). OSError (ENOSPC) for a full disk; BuildError, caused
    by the compiler's exception, for a failed compile."""
    from torch.utils import cpp_extension

    cflags, cuda_cflags = compiler_flags(target)
    verbose = env.verbose()  # read before the build (a bad value is a ValueError naming the variable, not a BuildError)
    start = time.perf_counter()
    try:
        path = cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=["-fopenmp"] if target.backend == "cpu" else [],
            extra_include_paths=[str(include_dir())],
            build_directory=str(work),
            verbose=verbose,
            with_cuda=target.backend == "cuda",
            is_python_module=False,
        )
    except OSError as e:
        if _no_space(e):
            raise
        raise BuildError(str(e)) from e
    except subprocess.CalledProcessError as e:  # torch's probe of the compiler (`CXX -v`) failed
        cmd = " ".join(map(str, e.cmd)) if isinstance(e.cmd, list | tuple) else str(e.cmd)
        raise BuildError(f"the C++ compiler does not run: `{cmd}` exited with status {e.returncode}; install g++ "
                         f"or set CXX to a working C++17 compiler (CXX is {env.cxx()!r})") from None
    except (RuntimeError, ValueError) as e:
        if "No space left on device" in str(e):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(work)) from None
        raise BuildError(str(e)) from e
    return Path(path), time.perf_counter() - start


def _assemble(inst: Instantiation, lib: Path, sources: dict[str, str], seconds: float, publish: Path,
              **extra) -> None:
    """``inst``'s entry, owner-only, in ``publish``: a copy of ``lib``, its rendered ``sources``
    under src/ and the manifest (``extra`` fields added to it)."""
    private_dir(publish)
    shutil.copy2(lib, publish / "lib.so")
    private_dir(publish / "src")
    for fname, text in sources.items():
        (publish / "src" / fname).write_text(text)
    manifest = {
        "key": inst.key,
        "sha256": sha256_of(publish / "lib.so"),
        "fields": inst.key_fields(),
        "build_seconds": round(seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }
    (publish / "manifest.json").write_text(json.dumps(manifest, indent=1))
    owner_only(publish)


def _compile_failed(inst: Instantiation, work: Path, e: Exception) -> BuildError:
    """Keep the failed build's sources under ``failed/`` and say why it failed: the first line
    names a missing prerequisite where the compiler's output shows one."""
    failed = work.parent.parent / "failed" / inst.name
    shutil.rmtree(failed, ignore_errors=True)
    private_dir(failed.parent)
    shutil.move(str(work), str(failed))
    text = str(e)
    first = next((what for pattern, what in _MISSING if pattern.search(text)), None)
    head = f"{first} (building {inst.name})" if first else f"failed to build {inst.name}"
    return BuildError(f"{head}\n  generated sources: {failed / 'src'}\n"
                      f"  spec: {inst.spec.span.file if inst.spec.span else '<spec>'}\n{e}")
