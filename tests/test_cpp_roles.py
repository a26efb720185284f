"""The C++ kernel headers by role: every layer (CPU) and role (CUDA) header compiles on its own,
the dead tile knobs stay gone, and no translation unit exports its tiles (the Python side reads
them from the instantiation's config)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

INCLUDE = ROOT / "templates" / "include"
CPU_LAYERS = ["simd", "convert", "gemm", "tiles", "work", "fwd", "bwd"]
CUDA_ROLES = ["scheduler", "mainloop", "fwd_mainloop", "bwd_mainloop", "epilogue", "host", "fwd", "bwd",
              "classify"]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
GXX = shutil.which("g++")


def test_dead_tile_knobs_are_gone():
    names = ("kQInRegs", "kBlockNSm8x", "fwd_block_n(", "device_major", "kDeferDq", "kRotate")
    for path in (ROOT / "templates").rglob("*"):
        if path.is_file() and path.suffix in {".h", ".cuh", ".jinja"}:
            text = path.read_text()
            assert not [n for n in names if n in text], path


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_no_tiles_export(kind):
    from flashgen import families
    from flashgen.lang import frontend, ir

    inst = families.get("sm80").instantiation(frontend.parse(ROOT / "specs" / "document.attn"), "sm_90a",
                                              ir.DType("bf16"), 128, sparse=True)
    text = inst.sources()[inst.source_name(kind)]
    assert "_tiles" not in text
    assert re.search(r"FwdTile<\d+, \d+, \d+>|BwdTile<\d+, \d+, \d+, \d+>", text)


@pytest.mark.skipif(GXX is None, reason="g++ not found")
@pytest.mark.parametrize("layer", CPU_LAYERS)
def test_cpu_layer_compiles_alone(layer, tmp_path):
    from torch.utils.cpp_extension import include_paths

    src = tmp_path / "t.cpp"
    src.write_text(f'#include "flashgen/cpu/{layer}.h"\n')
    cmd = [GXX, "-std=c++17", "-fsyntax-only", "-fopenmp", "-march=native", "-Wall", "-I", str(INCLUDE),
           *(f"-I{p}" for p in include_paths()), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "warning" not in res.stderr.lower(), res.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("role", CUDA_ROLES)
def test_cuda_role_compiles_alone(role, tmp_path):
    src = tmp_path / "t.cu"
    src.write_text(f'#include "flashgen/cuda/{role}.cuh"\n')
    cmd = [NVCC, "-c", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", str(INCLUDE),
           "-o", str(tmp_path / "t.o"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "warning" not in res.stderr.lower(), res.stderr
