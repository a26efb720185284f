"""What a compiled artifact is and its cache key.

An instantiation (spec × target × dtype × head dim × tile config) becomes one shared library
(flashgen/build/cache.py compiles and caches it). Its key hashes everything that decides the
library's content: the spec's fingerprint, the target, the config, the compiler flags, the
toolkit, torch and Python versions, and the generator hash — the templates, the kernel headers
and every flashgen module the code generator imports.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import env, imports
from ..abi import ABI_VERSION
from ..archs import cuda_arch
from ..codegen import render
from ..lang import ir
from ..paths import templates_dir
from ..version import __version__

# Modules whose content decides what a build produces, besides the templates directory: the
# build stage (flags, artifact layout, the compile call), the ABI mirror, and the code generator
# package with every flashgen module it imports, directly or not (the IR and the hook emitters
# in lang/expr.py and lang/keyrange.py among them), found by parsing their imports so that a new
# emitter module can never be left out of the key. A name here is a module or a package (all of
# its modules).
GENERATOR_ROOTS = ("flashgen.build.artifact", "flashgen.build.cache", "flashgen.abi", "flashgen.codegen")
PACKAGE = Path(__file__).resolve().parent.parent  # the flashgen package directory these modules live in

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
# the block classifier (cuda_mask.cu.jinja, flashgen.block_mask); a "decode" one (config
# ("decode", 1), the sm80 family's op.with_kvcache kernels) only the decode unit
# (cuda_decode.cu.jinja).
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
        """The translation units: ('mask',) for the classifier, ('decode',) for decode kernels,
        ('fwd',) / ('bwd',) for the autotuner's one-pass candidates (config fwd_only /
        bwd_only), else both."""
        cfg = dict(self.config)
        if cfg.get("mask"):
            return ("mask",)
        if cfg.get("decode"):
            return ("decode",)
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
        return hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode()).hexdigest()

    def variant_id(self) -> str:
        """The id ahead-of-time directories (flashgen.build.aot) file this artifact under: sha256 over
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
            self.source_name(kind): render.render_instantiation(
                self.spec, self.target.backend, kind, self.dtype, self.head_dim, self.symbol(kind), dict(self.config),
                self.target.family)
            for kind in self.kinds
        }

    def key_fields(self) -> dict:
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
    """sha256 over the templates, the shared headers, the kernel headers of ``backend``'s device
    type and the code generator (``generator_modules`` of ``package``, default this package):
    editing any of them changes every key of that device type. The CPU's headers are
    include/flashgen/cpu; a CUDA target's are every other header folder (cuda/, sm90/, ...: a CUDA
    family's units include their own folder and cuda/'s), so an edit to one CUDA family's headers
    also rebuilds the others' kernels, never stale ones."""
    h = hashlib.sha256()
    root = templates_dir()
    include = root / "include" / "flashgen"
    files = sorted(root.glob("*.jinja")) + sorted(include.glob("*.h"))
    folders = [d for d in sorted(include.iterdir()) if d.is_dir() and (d.name == "cpu") == (backend == "cpu")]
    files += sorted(p for d in folders for p in d.rglob("*") if p.is_file())
    files = [(str(p.relative_to(root)), p) for p in files]
    files += [(m, p) for m, p in generator_modules(package)]
    for name, p in files:
        h.update(name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def generator_modules(package: Path | None = None) -> list[tuple[str, Path]]:
    """(dotted name, path) of every flashgen module that shapes a build: ``GENERATOR_ROOTS`` (a
    package stands for all of its modules) and the flashgen modules they import, transitively
    (package ``__init__`` modules that only re-export excluded: ``flashgen``), sorted by name.
    ``package``: the package directory (default ``PACKAGE``)."""
    graph = imports.module_graph(package or PACKAGE)
    todo = [m for m in graph.paths if any(m == r or m.startswith(r + ".") for r in GENERATOR_ROOTS)]
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
