"""Compile-only check of rendered CUDA (no GPU needed): one forward and one backward
instantiation per spec from generated/, for sm_80 and sm_90a. Skips only where nvcc is absent;
a missing header fails."""

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
ARCHS = ["80", "90a"]
CASES = [("dense", "cuda_fwd_bf16_hd128.cu"), ("causal", "cuda_fwd_fp16_hd64.cu"),
         ("dense", "cuda_bwd_fp16_hd64.cu"), ("causal", "cuda_bwd_bf16_hd128.cu"),
         ("alibi", "cuda_bwd_bf16_hd128.cu")]  # a score mod with a parameter gradient (atomics)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec, source", CASES, ids=[f"{c[0]}-{c[1].split('_')[1]}" for c in CASES])
def test_generated_cuda_compiles(spec, source, arch, tmp_path):
    src = ROOT / "generated" / spec / source
    assert src.is_file(), f"{src} missing: run `python -m flashgen generate specs/*.attn`"
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what a real build adds (no implicit half casts)

    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS,
           f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-I", str(ROOT / "templates" / "include"), "-o", str(tmp_path / "k.o"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    assert (tmp_path / "k.o").stat().st_size > 0
