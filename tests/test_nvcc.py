"""Compile-only check of rendered CUDA (no GPU needed): forward, backward and decode
instantiations from generated/, for sm_80 and sm_90a. Skips only where nvcc is absent;
a missing header fails."""

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
# sm_90a (the H200) for every case; sm_80 (the oldest supported) for one forward and one backward.
CASES = [("dense", "cuda_fwd_bf16_hd128.cu", "90a"), ("causal", "cuda_fwd_fp16_hd64.cu", "90a"),
         ("dense", "cuda_bwd_fp16_hd64.cu", "90a"), ("causal", "cuda_bwd_bf16_hd128.cu", "90a"),
         ("alibi", "cuda_bwd_bf16_hd128.cu", "90a"),  # a score mod with a parameter gradient (atomics)
         ("gemma", "cuda_fwd_bf16_hd64.cu", "90a"),  # mask and score mod with scalar parameters
         ("dropout", "cuda_bwd_bf16_hd128.cu", "90a"),  # a variant with kHasDropout (not applied on CUDA yet)
         ("dense", "cuda_fwd_bf16_hd128.cu", "80"), ("causal", "cuda_bwd_bf16_hd128.cu", "80"),
         ("gemma", "cuda_decode_bf16_hd128.cu", "90a")]  # the sm80 decode kernels (more in test_decode_cuda.py)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec, source, arch", CASES,
                         ids=[f"{c[0]}-{c[1].split('_')[1]}-{c[2]}" for c in CASES])
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


# Packed (varlen) instantiations are rendered at build time only (generated/ holds the padded
# ones): compile one forward and one backward the way ops.instantiation asks for them.
# Block-sparse (block_mask=) instantiations likewise, alone and with the packed layout, and the
# block classifier (flashgen.block_mask on CUDA).
PACKED = [("causal", "fwd", 72, {"varlen": 1}), ("alibi", "bwd", 128, {"varlen": 1}),
          ("document", "fwd", 128, {"sparse": 1}), ("causal", "bwd", 64, {"sparse": 1}),
          ("alibi", "bwd", 128, {"sparse": 1, "varlen": 1}),
          ("document", "mask", None, {"mask": 1}), ("alibi", "mask", None, {"mask": 1})]  # block classifiers


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec, kind, head_dim, config", PACKED,
                         ids=[f"{s}-{k}-hd{d}-{'-'.join(c)}" for s, k, d, c in PACKED])
def test_packed_cuda_compiles(spec, kind, head_dim, config, tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    from flashgen import families
    from flashgen.lang import frontend, ir

    sm80, parsed = families.get("sm80"), frontend.parse(ROOT / "specs" / f"{spec}.attn")
    inst = (sm80.classifier(parsed, "sm_90a") if "mask" in config else  # tiles: the sm_90a table's
            sm80.instantiation(parsed, "sm_90a", ir.DType("bf16"), head_dim, packed="varlen" in config,
                               sparse="sparse" in config))
    text = inst.sources()[inst.source_name(kind)]
    want = ", true, true>(*args)" if len(config) == 2 else ", false, true>(*args)" if "sparse" in config \
        else "launch_classify<" if "mask" in config else ", true>(*args)"
    assert want in text  # the kPacked / kSparse entry point
    src = tmp_path / "k.cu"
    src.write_text(text)
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS,
           "-gencode=arch=compute_90a,code=sm_90a", "-I", str(ROOT / "templates" / "include"),
           "-o", str(tmp_path / "k.o"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    assert (tmp_path / "k.o").stat().st_size > 0
