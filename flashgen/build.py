"""Build and cache compiled kernels: content-hashed keys, a file lock, atomic publish.

An instantiation (spec × target × dtype × head dim × tile config) becomes one shared library,
compiled by torch.utils.cpp_extension with ninja from one rendered translation unit. The cache
entry ``<root>/<artifact>/`` holds ``lib.so``, the rendered ``src/`` and ``manifest.json`` (the
key and the library's sha256), published by one rename after a successful build; anything
that does not verify is a miss and is rebuilt under the lock. A cached load renders nothing
and starts no compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import platform
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import filelock

from . import codegen, env, imports, ir
from .version import __version__
from .abi import ABI_VERSION
from .archs import cuda_arch
from .errors import BuildError
from .paths import include_dir, templates_dir

# Modules whose content decides what a build produces, besides the templates directory: this
# module (flags, artifact layout), the ABI mirror, and the code generator with every flashgen
# module it imports, directly or not (the IR and the hook emitters in expr.py among them), found
# by parsing their imports so that a new emitter module can never be left out of the key.
_GENERATOR_ROOTS = ("build", "abi", "codegen")
PACKAGE = Path(__file__).resolve().parent  # the flashgen package directory these modules live in

# Relevant x86/arm ISA flags for -march=native builds (part of the CPU target's name).
_CPU_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512fp16", "amx_tile", "asimd", "sve")


@dataclass(frozen=True)
class Target:
    """What an artifact is built for: the kernel family (flashgen/families: 'sm80', 'cpu'), the
    architecture, and the device type its toolchain builds for ('cpu': the host compiler,
    'cuda': nvcc)."""

    family: str
    arch: str  # e.g. 'sm_90a', 'sm_80', 'x86_64-avx2-fma'
    device: str

    @property
    def backend(self) -> str:
        """The device type ('cpu' or 'cuda'): which toolchain, flags and header folder."""
        return self.device


@functools.cache
def cpu_arch() -> str:
    """This machine's CPU target name: the machine and its relevant ISA flags."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in _CPU_ISA_FLAGS if f in flags]
    return "-".join([platform.machine().lower(), *isa])


@functools.cache
def cuda_arch_of(device_index: int) -> str:
    """The architecture of the live CUDA device ``device_index``."""
    import torch

    return cuda_arch(torch.cuda.get_device_capability(device_index))


# Translation units per instantiation. A CUDA "mask" instantiation (config ("mask", 1)) has only
# the block classifier (cuda_mask.cu.jinja, flashgen.block_mask).
KINDS = ("fwd", "bwd")


@dataclass(frozen=True)
class Instantiation:
    """One compiled artifact: a spec for one target, dtype, head dim (None: runtime) and config."""

    spec: ir.Spec
    target: Target
    dtype: ir.DType
    head_dim: int | None
    config: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        # One canonical form per artifact: the config sorted. Its tiles were filled in by the
        # family before the instantiation was made (flashgen/families): nothing is chosen here.
        object.__setattr__(self, "config", tuple(sorted(dict(self.config).items())))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The translation units: ('mask',) for the classifier, ('fwd',) / ('bwd',) for the
        autotuner's one-pass candidates (config fwd_only / bwd_only), else both."""
        cfg = dict(self.config)
        if cfg.get("mask"):
            return ("mask",)
        if cfg.get("fwd_only"):
            return ("fwd",)
        if cfg.get("bwd_only"):
            return ("bwd",)
        return KINDS

    def symbol(self, kind: str = "fwd") -> str:
        """The C entry point of ``kind`` ('fwd' or 'bwd'), stable across machines (it appears in
        generated/)."""
        hd = f"_hd{self.head_dim}" if self.head_dim else ""
        return f"fg_{self.spec.name}_{kind}_{self.dtype.value}{hd}"

    @functools.cached_property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self._key_fields(), sort_keys=True).encode()).hexdigest()

    def variant_id(self) -> str:
        """The id ahead-of-time directories (flashgen.aot) file this artifact under: sha256 over
        what the artifact is (spec fingerprint, target, dtype, head dim, config, debug build) and
        the ABI and flashgen versions. Unlike ``key`` it needs neither the toolkit version nor
        the generator hash, so a process that must not compile (FLASHGEN_JIT=0) can compute it."""
        return self._variant_id

    @functools.cached_property
    def _variant_id(self) -> str:
        fields = {
            "fingerprint": self.spec.fingerprint(),
            "target": [self.target.family, self.target.arch],
            "dtype": self.dtype.value,
            "head_dim": self.head_dim,
            "config": [list(c) for c in self.config],
            "debug": env.debug(),
            "abi": ABI_VERSION,
            "flashgen": __version__,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        """Artifact name: fg_<spec>_<family>_<dtype>_hd<d>_<arch>_<hash12>."""
        hd = f"hd{self.head_dim}" if self.head_dim else "hdany"
        arch = self.target.arch.replace("-", "_")
        return f"fg_{self.spec.name}_{self.target.family}_{self.dtype.value}_{hd}_{arch}_{self.key[:12]}"

    def source_name(self, kind: str) -> str:
        hd = f"_hd{self.head_dim}" if self.head_dim else ""
        ext = "cu" if self.target.backend == "cuda" else "cpp"
        return f"{self.target.backend}_{kind}_{self.dtype.value}{hd}.{ext}"

    def sources(self) -> dict[str, str]:
        """File name → rendered text: one translation unit each for the forward and the backward
        (compiled in parallel, linked into one library)."""
        return {
            self.source_name(kind): codegen.render_instantiation(
                self.spec, self.target.backend, kind, self.dtype, self.head_dim, self.symbol(kind), dict(self.config))
            for kind in self.kinds
        }

    def _key_fields(self) -> dict:
        import torch

        cflags, cuda_cflags = compiler_flags(self.target)
        return {
            "fingerprint": self.spec.fingerprint(),
            "target": [self.target.family, self.target.arch, self.target.device],
            "dtype": self.dtype.value,
            "head_dim": self.head_dim,
            "config": list(self.config),
            "generator": generator_hash(self.target.backend),
            "flags": [cflags, cuda_cflags],
            "torch": torch.__version__,
            "cuda": cuda_version() if self.target.backend == "cuda" else None,
            "python": sys.version_info[:2],
            "abi": ABI_VERSION,
            "flashgen": __version__,
        }


@functools.cache
def generator_hash(backend: str = "cpu", package: Path | None = None) -> str:
    """sha256 over the templates, the shared headers, ``backend``'s kernel headers and the code
    generator (``generator_modules`` of ``package``, default this package): editing any of them
    changes every key of that family (and only that family)."""
    h = hashlib.sha256()
    root = templates_dir()
    include = root / "include" / "flashgen"
    files = sorted(root.glob("*.jinja")) + sorted(include.glob("*.h"))
    files += sorted(p for p in (include / backend).rglob("*") if p.is_file())
    files = [(str(p.relative_to(root)), p) for p in files]
    files += [(m, p) for m, p in generator_modules(package)]
    for name, p in files:
        h.update(name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def generator_modules(package: Path | None = None) -> list[tuple[str, Path]]:
    """(dotted name, path) of every flashgen module that shapes a build: ``_GENERATOR_ROOTS`` and
    the flashgen modules they import, transitively (the package ``__init__`` excluded: it only
    re-exports), sorted by name. ``package``: the package directory (default ``PACKAGE``)."""
    graph = imports.module_graph(package or PACKAGE)
    todo = [f"flashgen.{m}" for m in _GENERATOR_ROOTS]
    seen: set[str] = set()
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in graph.paths:
            continue
        seen.add(mod)
        todo.extend(graph.edges.get(mod, ()))
    seen.discard("flashgen")
    return sorted((m, graph.paths[m]) for m in seen)


@functools.cache
def cuda_version() -> str:
    """The toolkit version nvcc will build with (from CUDA_HOME/version.json, else nvcc -V)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or env.cuda_home()
    if home:
        try:
            return json.loads((Path(home) / "version.json").read_text())["cuda"]["version"]
        except (OSError, KeyError, ValueError):
            pass
        import subprocess

        try:
            return subprocess.run([str(Path(home) / "bin" / "nvcc"), "--version"], capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.CalledProcessError):
            pass
    return "unknown"


def compiler_flags(target: Target) -> tuple[list[str], list[str]]:
    """(C++ flags, nvcc flags) for a target; part of the cache key.

    CPU: -fopenmp makes at::parallel_for (header-only) use torch's OpenMP pool — without it the
    kernel silently runs on one thread; -march=native enables the AVX2/FMA micro-kernels (the
    target's name records the ISA, so a cache shared between machines never mixes them).
    """
    debug = ["-g"] if env.debug() else []
    cflags = ["-O3", "-std=c++17", *debug]
    if target.backend == "cpu":
        return [*cflags, "-march=native", "-fno-math-errno", "-fopenmp"], []
    num = target.arch.removeprefix("sm_")
    cuda = ["-O3", "-std=c++17", "--use_fast_math", f"-gencode=arch=compute_{num},code=sm_{num}",
            "-lineinfo" if env.debug() else "-DNDEBUG", *(["-G"] if env.debug() else [])]
    return cflags, cuda


# ---------------------------------------------------------------- cache entries


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
        "fields": inst._key_fields(),
        "build_seconds": round(seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (publish / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if entry.exists():  # a broken entry (we hold the lock): replace it
        shutil.rmtree(entry, ignore_errors=True)
    publish.rename(entry)
    shutil.rmtree(work, ignore_errors=True)
