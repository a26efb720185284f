"""Every environment variable flashgen reads, in one place. Nothing else reads os.environ.

Two tuning knobs are read by the CPU kernel header itself (templates/include/flashgen/cpu/fwd.h),
for benchmarking only: FLASHGEN_CPU_TILES=qb,kvb forces the tile sizes, FLASHGEN_CPU_GEMM=blas
forces MKL's sgemm instead of the built-in micro-kernels.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FLASHGEN_CACHE_DIR, else ~/.cache/flashgen: root of compiled artifacts and tuning data."""
    root = os.environ.get("FLASHGEN_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flashgen"


def verbose() -> bool:
    """FLASHGEN_VERBOSE=1: show compiler command lines and output while building."""
    return os.environ.get("FLASHGEN_VERBOSE", "") not in ("", "0")


def debug() -> bool:
    """FLASHGEN_DEBUG=1: build kernels with -g and -lineinfo (a separate cache entry)."""
    return os.environ.get("FLASHGEN_DEBUG", "") not in ("", "0")


def quiet() -> bool:
    """FLASHGEN_QUIET=1: no 'compiling ...' notice on stderr when a first call builds a kernel."""
    return os.environ.get("FLASHGEN_QUIET", "") not in ("", "0")


def cuda_home() -> str | None:
    """CUDA_HOME / CUDA_PATH as torch.utils.cpp_extension sees them (for the nvcc version)."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
