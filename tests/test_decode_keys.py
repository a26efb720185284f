"""The decode kernel with the keys on the tensor cores' M side (FLASHGEN_CUDA_DECODE_KEYS;
templates/include/flashgen/cuda/decode_keys.cuh, DecodeKeysKernel): S^T = K Q^T and
O^T = V^T P^T, the GQA group's query rows as the N side of 8 (kN8 1: up to 8 rows a CTA) or 16
(kN8 2), against cuda/decode.cuh's DecodeKernel with the rows on the M side.

CPU tier: the variable's reading and its place in the library key; the config (``decode_keys``
and the shared memory without Q) and the refusal of the bulk-copy variant with it; nvcc compiles
of the keys unit with no warning, spill or stack frame in its kernels, whose SASS has the
halved tensor-core step (kD / 8 HMMA and two MOVM per 16 keys at kN8 1, twice that at kN8 2).

GPU tier (marked ``gpu``): whichever kernel is not the family's default (the default is covered by
tests/test_decode_cuda.py), forced by the variable, against the float64 reference over every
example spec, Sq x GQA group (1 to 8 row tiles of 16; 8-row tiles at up to 8 rows), head dims
64 to 256 in bf16 and fp16, split counts, paged caches (page sizes 1, 16, 256, shuffled, a shared
page, appends across a page boundary), and device-side values out of range (NaN rows, nothing
written).
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import ROOT
from test_decode_bulk import compile_unit, decode_inst, function_opcodes, unit_text
from test_decode_cuda import ALL_SPECS, DT, NVCC, _Args, decode_case, op_of, out_of_range_case, paged_case, ptxas_report
from test_sm90_sass import CUOBJDUMP

import flashgen
from flashgen import env, families
from flashgen.families import sm80
from flashgen.lang import frontend, ir

VAR = "FLASHGEN_CUDA_DECODE_KEYS"


# ------------------------------------------------------------------ selection (CPU)


def test_variable_reading(monkeypatch):
    for raw, want in ((None, None), ("", None), ("0", False), ("1", True), (" 1 ", True)):
        if raw is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, raw)
        assert env.cuda_decode_keys() is want, raw
    for bad in ("2", "-1", "yes", "true", "1x"):
        monkeypatch.setenv(VAR, bad)
        with pytest.raises(ValueError, match=VAR):
            env.cuda_decode_keys()
    monkeypatch.setenv(VAR, "1")
    one = env.library_selection()
    monkeypatch.setenv(VAR, "0")
    assert env.library_selection() != one  # part of the op's library key


def test_config_of_either_kernel(monkeypatch):
    """1: ``decode_keys`` and a shared-memory figure without Q's 16 rows (the tile choice made on
    it); 0: neither key, the rows-major unit; unset: the family's default."""
    monkeypatch.delenv("FLASHGEN_CUDA_DECODE_BULK", raising=False)
    monkeypatch.setenv(VAR, "0")
    rows = sm80.decode_tile("sm_90a", 128)
    assert "decode_keys" not in rows and rows["decode_smem"] == sm80.decode_smem(128, 64, 3)
    monkeypatch.setenv(VAR, "1")
    keys = sm80.decode_tile("sm_90a", 128)
    assert keys == {**rows, "decode_keys": 1, "decode_smem": sm80.decode_smem(128, 64, 3, keys=True)}
    assert keys["decode_smem"] == rows["decode_smem"] - 16 * (128 + 8) * 2
    for arch in ("sm_80", "sm_86", "sm_90a"):
        for d in (64, 128, 256):
            cfg = sm80.decode_tile(arch, d)
            assert cfg["decode_keys"] == 1
            assert cfg["decode_smem"] == sm80.decode_smem(d, cfg["decode_block_n"], cfg["decode_stages"], keys=True)
    monkeypatch.delenv(VAR)
    assert ("decode_keys" in sm80.decode_tile("sm_90a", 128)) == sm80.DECODE_KEYS_DEFAULT


def test_unit_renders_the_keys_tile(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    text = unit_text(decode_inst("causal", "sm_90a", "bf16", 128))
    assert "DecodeKeysTile<64, 3, " in text and "flashgen/cuda/decode_launch.cuh" in text
    monkeypatch.setenv(VAR, "0")
    text = unit_text(decode_inst("causal", "sm_90a", "bf16", 128))
    assert "DecodeKeysTile" not in text and "DecodeTile<64, 3, " in text


def test_split_count_follows_the_kernels_row_tiles(monkeypatch):
    """The host's split count counts the CTAs the launcher will start: with the keys kernel 8-row
    tiles up to 8 rows, 16-row ones above (8-row ones at every size above d 128)."""
    monkeypatch.delenv("FLASHGEN_CUDA_DECODE_BULK", raising=False)
    monkeypatch.setenv(VAR, "1")
    fam, spec = families.get("sm80"), frontend.parse(ROOT / "specs" / "causal.attn")
    fields = fam.launch_fields(spec)
    for d, rows_per_cta in ((128, (8, 16)), (256, (8, 8))):
        inst = fam.decode_instantiation(spec, "sm_90a", ir.DType.BF16, d)
        cfg = dict(inst.config)
        for sq, per in zip((2, 16), rows_per_cta):  # GQA 4: 8 and 64 rows
            assert sm80.decode_tile_rows(cfg, d, 4 * sq) == per
            want = sm80.decode_splits(1, 8, -(-4 * sq // per), 32768, cfg["decode_block_n"], 132,
                                      sm80.decode_ctas_per_sm("sm_90a", cfg))
            assert fields.kv_splits(_Args(1, 32, 8, sq, 32768, 132), inst, 0) == want, (d, sq)
    monkeypatch.setenv(VAR, "0")
    inst = fam.decode_instantiation(spec, "sm_90a", ir.DType.BF16, 256)
    assert sm80.decode_tile_rows(dict(inst.config), 256, 4) == 16


def test_bulk_and_keys_together_refused(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    monkeypatch.setenv("FLASHGEN_CUDA_DECODE_BULK", "1")
    with pytest.raises(ValueError, match=f"{VAR}=1 and FLASHGEN_CUDA_DECODE_BULK=1"):
        sm80.decode_tile("sm_90a", 128)
    monkeypatch.delenv(VAR)  # unset: the bulk variant is the rows-major kernel's
    cfg = sm80.decode_tile("sm_90a", 128)
    assert cfg["decode_bulk"] == 1 and "decode_keys" not in cfg


# ------------------------------------------------------------------ nvcc (CPU, skips without nvcc)

# (spec, dtype, head dim, arch): the hot path, keep() per element on an A100 with d 96 (copy
# passes that do not cover whole rows), d 256 (two warps, the most registers).
NVCC_CASES = [("causal", "bf16", 128, "sm_90a"), ("document", "fp16", 96, "sm_80"), ("causal", "bf16", 256, "sm_90a")]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec, dtype, head_dim, arch", NVCC_CASES, ids=["-".join(map(str, c)) for c in NVCC_CASES])
def test_keys_unit_compiles(monkeypatch, tmp_path, spec, dtype, head_dim, arch):
    """The keys unit compiles for its arch with a build's flags: no warning, spill or stack frame
    in its kernels (append, the attention kernel at kN8 1 and 2 (only 1 above d 128), the combine
    at 1 and 4 warps a row). For causal d 128 (with cuobjdump), the attention kernels' SASS issues kD / 8 HMMA and
    2 MOVM per key-tile step at kN8 1 and twice that at kN8 2, where the rows-major kernel issues
    kD / 4 HMMA and no MOVM."""
    monkeypatch.delenv("FLASHGEN_CUDA_DECODE_BULK", raising=False)
    monkeypatch.setenv(VAR, "1")
    res = compile_unit(unit_text(decode_inst(spec, arch, dtype, head_dim)), arch, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr
    report = {k: v for k, v in ptxas_report(res.stderr).items() if "decode" in k}
    attention = 2 if head_dim <= 128 else 1
    assert len(report) == 3 + attention and sum("decode_keys_kernel" in k for k in report) == attention, report
    for name, (regs, st, ld) in report.items():
        assert st == 0 and ld == 0 and 0 < regs <= 255, (name, regs, st, ld)
    assert all(m == "0" for m in re.findall(r"(\d+) bytes stack frame", res.stderr))
    if (spec, head_dim) != ("causal", 128):
        return
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or nvidia-cuda-cuobjdump)")
    dump = subprocess.run([CUOBJDUMP, "-sass", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    for n8 in (1, 2):
        ops = function_opcodes(dump.stdout, f"ELi{n8}EEEvNS0_12DecodeParams")
        assert ops, f"no kN8 = {n8} kernel in the SASS"
        hmma = sum(o.startswith("HMMA") for o in ops)
        movm = sum(o.startswith("MOVM") for o in ops)
        assert (hmma, movm) == (n8 * 128 // 8, 2 * n8), (n8, hmma, movm)
        assert not {o for o in ops if o in ("LDL", "STL")}
    monkeypatch.setenv(VAR, "0")
    res = compile_unit(unit_text(decode_inst(spec, arch, dtype, head_dim)), arch, tmp_path)
    assert res.returncode == 0, res.stderr
    dump = subprocess.run([CUOBJDUMP, "-sass", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=120)
    ops = function_opcodes(dump.stdout, "decode_kernel")
    assert (sum(o.startswith("HMMA") for o in ops), sum(o.startswith("MOVM") for o in ops)) == (128 // 4, 0)


# ------------------------------------------------------------------ GPU (the kernel that is not the default)

gpu = pytest.mark.gpu
OTHER = "0" if sm80.DECODE_KEYS_DEFAULT else "1"


@pytest.fixture(scope="module")
def other_decode():
    """The decode libraries of the non-default kernel (the variable is part of the library key),
    built in parallel before the first case; the variable set and the sm80 family forced
    throughout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fam, dev = families.get("sm80"), torch.device("cuda", torch.cuda.current_device())
    wanted = [(n, "bf16", 128) for n in ALL_SPECS] + [("causal", dt, d) for dt in ("bf16", "fp16")
                                                      for d in (64, 96, 128, 256)] + \
        [("gemma", dt, d) for dt in ("bf16", "fp16") for d in (64, 128)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(VAR, OTHER)
        mp.delenv("FLASHGEN_CUDA_DECODE_BULK", raising=False)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda w: op_of(w[0]).decode_library(fam, dev, ir.DType(w[1]), w[2]), wanted))
        with flashgen.use_family("sm80"):
            yield fam


@gpu
@pytest.mark.parametrize("name", ALL_SPECS)
def test_gpu_every_spec(other_decode, name):
    decode_case(name, "cuda", torch.bfloat16, Sq=1, group=4, d=128, seed=len(name))
    decode_case(name, "cuda", torch.bfloat16, Sq=3, group=4, d=128, seed=len(name) + 1)


@gpu
@pytest.mark.parametrize("Sq", [1, 2, 5, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_rows_and_groups(other_decode, Sq, group):
    """Sq x GQA group: 1 to 128 rows of one kv head, in CTAs of 8 rows (up to 8) or 16."""
    decode_case("causal", "cuda", torch.bfloat16, Sq=Sq, group=group, hkv=2, B=5, seed=Sq * 10 + group)
    decode_case("gemma", "cuda", torch.float16, Sq=Sq, group=group, hkv=1, B=3, d=64, seed=Sq + group)


@gpu
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_head_dims_and_dtypes(other_decode, d, dtype):
    decode_case("causal", "cuda", DT[dtype], d=d, Sq=1, group=8, hkv=2, B=4, cap=700, seed=d)
    decode_case("causal", "cuda", DT[dtype], d=d, Sq=5, group=1, hkv=3, B=2, cap=129, Sn=0, leftpad=False, seed=d + 1)


@gpu
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_gpu_num_splits(other_decode, num_splits):
    decode_case("causal", "cuda", torch.bfloat16, Sq=1, group=4, cap=1000, B=3, num_splits=num_splits)


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("num_splits", [0, 5])
def test_gpu_paged(other_decode, page_size, num_splits):
    paged_case("cuda", torch.bfloat16, page_size, num_splits=num_splits)


@gpu
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_gpu_out_of_range_values(other_decode, num_splits):
    out_of_range_case("cuda", torch.bfloat16, num_splits=num_splits)
