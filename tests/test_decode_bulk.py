"""The decode kernel's opt-in bulk-copy variant (FLASHGEN_CUDA_DECODE_BULK; templates/include/
flashgen/cuda/decode.cuh, DecodeBulkTile): K/V tiles loaded by 1-D TMA bulk copies, one per key
row, completing on an mbarrier per stage, instead of 16-byte cp.async.

CPU tier: the variable's reading, that leaving it unset changes nothing (no config key, the unit
renders as generated/ holds it), that setting it adds ``decode_bulk`` and the mbarriers' bytes,
that an architecture below sm_90 is refused by the family (ValueError naming the variable) and by
the kernel (static_assert); nvcc compiles of the variant for sm_90a (and of the default unit) with
no spill and no local memory, whose SASS issues bulk copies (UBLKCP) and mbarrier operations
(SYNCS) in the expected ELECT loops, and whose default unit has neither.

GPU tier (marked ``gpu``, sm_90 and newer): out, lse and the appended caches of the bulk variants
equal the default kernel's bit for bit over contiguous and paged caches (page sizes 1, 16, 256,
shuffled), Sq 1 and 5, GQA 4:1, d 64 and 128, mixed lengths including 0 and the capacity, left
padding, appends, 1 and several splits; the bulk result against the float64 reference; device-side
values out of range give NaN rows and write nothing, as in the default.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SPECS
from test_decode_cuda import NVCC, check_rows, op_of, out_of_range_case, params_for, ptxas_report, to_paged, \
    whole_sequences
from test_sm90_sass import CUOBJDUMP, SASS_LINE

import flashgen
from flashgen import env, families
from flashgen.families import sm80
from flashgen.lang import frontend, ir
from flashgen.tools import generate

VAR = "FLASHGEN_CUDA_DECODE_BULK"


def decode_inst(spec: str, arch: str, dtype: str, head_dim: int):
    return families.get("sm80").decode_instantiation(frontend.parse(SPECS / f"{spec}.attn"), arch, ir.DType(dtype),
                                                     head_dim)


def unit_text(inst) -> str:
    (_, text), = inst.sources().items()
    return text


# ------------------------------------------------------------------ selection (CPU)


def test_variable_reading(monkeypatch):
    for raw, want in ((None, 0), ("", 0), ("0", 0), ("1", 1), ("2", 2), (" 1 ", 1)):
        if raw is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, raw)
        assert env.cuda_decode_bulk() == want, raw
    for bad in ("3", "-1", "yes", "true", "1x"):
        monkeypatch.setenv(VAR, bad)
        with pytest.raises(ValueError, match=VAR):
            env.cuda_decode_bulk()
    monkeypatch.setenv(VAR, "1")
    assert any(v in (b"1", "1") for v in env.library_selection())  # in the op's library key
    monkeypatch.delenv(VAR)
    assert None in env.library_selection()


def test_unset_changes_nothing(monkeypatch):
    """Unset: no decode_bulk key, no bulk code in the unit, and the unit generated/ holds."""
    monkeypatch.delenv(VAR, raising=False)
    assert "decode_bulk" not in sm80.decode_tile("sm_90a", 128)
    assert sm80.decode_tile("sm_90a", 128)["decode_smem"] == 108800
    inst = decode_inst("causal", "sm_90a", "bf16", 128)
    assert "decode_bulk" not in dict(inst.config)
    text = unit_text(inst)
    assert "DecodeTile<64, 3, 108800>" in text
    assert "bulk" not in text.lower() and "DecodeBulkTile" not in text
    monkeypatch.chdir(ROOT)  # the unit names its spec by the path it was parsed from, as generate does
    for spec in ("causal", "gemma"):
        golden = (ROOT / "generated" / spec / "cuda_decode_bf16_hd128.cu").read_text()
        files = generate.generated_files(Path("specs") / f"{spec}.attn")
        assert files["cuda_decode_bf16_hd128.cu"] == golden


@pytest.mark.parametrize("mode", [1, 2])
def test_set_selects_the_variant(monkeypatch, mode):
    """Set: decode_bulk in the config (a separate cache entry), 32 bytes of mbarriers in the
    shared-memory figure, the same tile, DecodeBulkTile in the unit."""
    monkeypatch.delenv(VAR, raising=False)
    default = decode_inst("causal", "sm_90a", "bf16", 128)
    monkeypatch.setenv(VAR, str(mode))
    for arch in ("sm_90a", "any", "sm_100"):
        for d in sm80.DECODE_HEAD_DIMS:
            cfg = sm80.decode_tile(arch, d)
            monkeypatch.delenv(VAR)
            plain = sm80.decode_tile(arch, d)
            monkeypatch.setenv(VAR, str(mode))
            assert cfg == {**plain, "decode_bulk": mode, "decode_smem": plain["decode_smem"] + 32}, (arch, d)
    inst = decode_inst("causal", "sm_90a", "bf16", 128)
    assert dict(inst.config)["decode_bulk"] == mode and inst.key != default.key
    text = unit_text(inst)
    assert f"DecodeBulkTile<64, 3, 108832, {mode}>" in text and f"{VAR}={mode}" in text
    monkeypatch.setenv("FLASHGEN_CUDA_DECODE_TILE", "32x2")
    assert sm80.decode_tile("sm_90a", 128) == {"decode": 1, "decode_block_n": 32, "decode_stages": 2,
                                               "decode_smem": sm80.decode_smem(128, 32, 2) + 32, "decode_bulk": mode}


def test_refused_below_sm90(monkeypatch):
    monkeypatch.setenv(VAR, "1")
    for arch in ("sm_80", "sm_86", "sm_89"):
        with pytest.raises(ValueError, match=f"{VAR}=1: .*sm_90 or newer.*{arch}"):
            sm80.decode_tile(arch, 128)
        with pytest.raises(ValueError, match=VAR):
            decode_inst("causal", arch, "bf16", 128)
    for arch in ("sm_90", "sm_90a", "sm_100", "any"):
        assert sm80.decode_tile(arch, 128)["decode_bulk"] == 1


# ------------------------------------------------------------------ nvcc (CPU, skips without nvcc)


def compile_unit(text: str, arch: str, work) -> subprocess.CompletedProcess:
    """``text`` compiled for ``arch`` with a build's flags and ``-Xptxas -v`` (object: work/k.o)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    from flashgen.build import artifact
    from flashgen.paths import include_dir

    src = work / "k.cu"
    src.write_text(text)
    with pytest.MonkeyPatch.context() as mp:  # the release flags
        mp.delenv("FLASHGEN_DEBUG", raising=False)
        _, flags = artifact.compiler_flags(artifact.Target("sm80", arch, "cuda"))
    cmd = [NVCC, "-c", *flags, *COMMON_NVCC_FLAGS, "-Xptxas", "-v", "-I", str(include_dir()), "-o",
           str(work / "k.o"), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def function_opcodes(sass: str, name: str) -> list[str]:
    """The opcodes, in order, of the SASS functions whose (mangled) name contains ``name``."""
    ops, inside = [], False
    for line in sass.splitlines():
        if "Function :" in line:
            inside = name in line
            continue
        m = SASS_LINE.match(line)
        if inside and m:
            ops.append(m.group(1))
    return ops


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_static_assert_below_sm90(monkeypatch, tmp_path):
    """The kernel's backstop: the bulk unit compiled for sm_80 stops at a static_assert naming the
    variable."""
    monkeypatch.setenv(VAR, "1")
    text = unit_text(decode_inst("causal", "sm_90a", "bf16", 64))
    res = compile_unit(text, "sm_80", tmp_path)
    assert res.returncode != 0 and VAR in res.stderr, res.stderr


# (spec, dtype, head dim, mode): the hot path at both issue modes; 0 the default unit (no bulk
# code); d 256 (two warps, 32 keys a stage), d 96 (copy passes that do not cover whole rows) and a
# mask with a score mod (gemma, d 64).
SASS_CASES = [("causal", "bf16", 128, 0), ("causal", "bf16", 128, 1), ("causal", "bf16", 128, 2),
              ("causal", "bf16", 256, 1), ("document", "fp16", 96, 2), ("gemma", "fp16", 64, 1)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec, dtype, head_dim, mode", SASS_CASES, ids=["-".join(map(str, c)) for c in SASS_CASES])
def test_bulk_unit_compiles_to_bulk_copies(monkeypatch, tmp_path, spec, dtype, head_dim, mode):
    """The unit for sm_90a: no warning, no spill, no stack frame; in the attention kernel's SASS
    (with cuobjdump) the bulk copies (UBLKCP), each in its own ELECT loop (one copy per lane and
    iteration: the copy's operands are uniform registers), kStages issue sites (the prologue's
    kStages - 1 and the loop's) of one copy per thread (mode 1) or of kBlockN / 32 x 2 copies per
    lane of warp 0 (mode 2), the mbarrier operations (SYNCS: init, arrive.expect_tx, try_wait),
    cp.async only for Q, and no local memory. The default unit (mode 0) has no UBLKCP or SYNCS."""
    if mode:
        monkeypatch.setenv(VAR, str(mode))
    else:
        monkeypatch.delenv(VAR, raising=False)
    inst = decode_inst(spec, "sm_90a", dtype, head_dim)
    cfg = dict(inst.config)
    res = compile_unit(unit_text(inst), "sm_90a", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr
    report = {k: v for k, v in ptxas_report(res.stderr).items() if "decode" in k}
    assert len(report) == 4, report
    for name, (regs, st, ld) in report.items():
        assert st == 0 and ld == 0 and 0 < regs <= 255, (name, regs, st, ld)
    assert all(m == "0" for m in re.findall(r"(\d+) bytes stack frame", res.stderr))
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or nvidia-cuda-cuobjdump)")
    dump = subprocess.run([CUOBJDUMP, "-sass", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    ops = function_opcodes(dump.stdout, "decode_kernel")
    assert ops, "no decode_kernel in the SASS"
    count = lambda op: sum(o == op for o in ops)  # noqa: E731
    assert not {o for o in ops if o in ("LDL", "STL")}
    if not mode:
        assert count("UBLKCP") == 0 and not any(o.startswith("SYNCS") for o in ops)
        assert count("LDGSTS") > 2  # K/V by cp.async
        return
    stages, block_n = cfg["decode_stages"], cfg["decode_block_n"]
    sites = stages * (1 if mode == 1 else 2 * block_n // 32)
    assert count("UBLKCP") == sites, f"{count('UBLKCP')} bulk copies in the SASS, expected {sites}"
    assert count("ELECT") == sites, "each bulk copy in an ELECT loop of its own"
    assert any(o.startswith("SYNCS") for o in ops), "no mbarrier operation (SYNCS)"
    # the ELECT loops: ELECT ... UBLKCP then a branch back, a few instructions each
    at = [i for i, o in enumerate(ops) if o == "UBLKCP"]
    for i in at:
        body = ops[max(0, i - 12):i + 2]
        assert "ELECT" in body and body[-1] == "BRA", body
    # cp.async left only for Q: at most one pass of 16-byte copies per thread
    assert count("LDGSTS") <= -(-16 * head_dim // 8 // (2 * block_n)), count("LDGSTS")


# ------------------------------------------------------------------ GPU (sm_90 and newer)

gpu = pytest.mark.gpu
MODES = (None, "1", "2")  # default, every warp issues, one warp issues
WANTED = (("causal", 64), ("causal", 128), ("gemma", 128))  # (spec, head dim), bf16


def set_mode(mp, mode) -> None:
    if mode is None:
        mp.delenv(VAR, raising=False)
    else:
        mp.setenv(VAR, mode)


@pytest.fixture(scope="module")
def bulk_decode():
    """The decode libraries of the three modes (the variable is part of the library key), built
    before the first case; the sm80 family forced throughout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk-copy decode kernel needs sm_90 or newer")
    fam, dev = families.get("sm80"), torch.device("cuda", torch.cuda.current_device())
    for mode in MODES:
        with pytest.MonkeyPatch.context() as mp:
            set_mode(mp, mode)
            with ThreadPoolExecutor(len(WANTED)) as pool:
                list(pool.map(lambda w: op_of(w[0]).decode_library(fam, dev, ir.DType.BF16, w[1]), WANTED))
    with flashgen.use_family("sm80"):
        yield fam


def run_modes(monkeypatch, name, d, page_size, Sq, num_splits, seed):
    """One decode call (B 4, GQA 4:1, appends of 2 keys, lengths 0, the capacity and two others,
    left padding) in each mode on copies of the same caches: {mode: (out, lse, k cache, v cache)}
    and what the reference needs."""
    op, g = op_of(name), torch.Generator().manual_seed(seed)
    B, hkv, group, Sn = 4, 2, 4, 2
    Hq = group * hkv
    cap = max(300 // page_size, 2) * page_size if page_size else 300
    kc = torch.randn(B, hkv, cap, d, generator=g).bfloat16().cuda()
    vc = torch.randn(B, hkv, cap, d, generator=g).bfloat16().cuda()
    kn = torch.randn(B, hkv, Sn, d, generator=g).bfloat16().cuda()
    vn = torch.randn(B, hkv, Sn, d, generator=g).bfloat16().cuda()
    q = torch.randn(B, Hq, Sq, d, generator=g).bfloat16().cuda()
    seqlens = torch.tensor([0, cap - Sn, min(17, cap - Sn), int(torch.randint(0, cap - Sn + 1, (1,), generator=g))],
                           dtype=torch.int32)
    leftpad = torch.tensor([0, 3, min(5, int(seqlens[2])), min(7, int(seqlens[3]))], dtype=torch.int32)
    params = params_for(name, B, Hq, cap, "cuda", g)
    ks, vs = whole_sequences(kc, vc, seqlens, leftpad, kn, vn)
    kw = {"cache_seqlens": seqlens.cuda(), "cache_leftpad": leftpad.cuda(), "k": kn, "v": vn, "return_lse": True,
          "num_splits": num_splits, **params}
    if page_size:
        kc, vc, table = to_paged(kc, vc, page_size, g)
        kw["block_table"] = table
    got = {}
    for mode in MODES:
        set_mode(monkeypatch, mode)
        ck, cv = kc.clone(), vc.clone()
        out, lse = op.with_kvcache(q, ck, cv, **kw)
        got[mode] = (out, lse, ck, cv)
    torch.cuda.synchronize()
    monkeypatch.delenv(VAR, raising=False)
    return got, (op.spec, q, ks, vs, params, cap, g)


@gpu
@pytest.mark.parametrize("Sq", [1, 5])
@pytest.mark.parametrize("page_size", [0, 1, 16, 256], ids=["contiguous", "page1", "page16", "page256"])
@pytest.mark.parametrize("name, d", WANTED, ids=[f"{n}-d{d}" for n, d in WANTED])
def test_gpu_bulk_equals_default_bit_for_bit(bulk_decode, monkeypatch, name, d, page_size, Sq):
    for num_splits in (0, 1, 3):
        got, ref = run_modes(monkeypatch, name, d, page_size, Sq, num_splits, seed=d + page_size + 10 * Sq)
        want = got[None]
        for mode in MODES[1:]:
            for what, x, y in zip(("out", "lse", "k cache", "v cache"), got[mode], want):
                assert torch.equal(x, y), f"{VAR}={mode}: {what} differs from the default's (splits {num_splits})"
        spec, q, ks, vs, params, cap, g = ref
        check_rows(spec, q, ks, vs, params, cap, got["1"][0], got["1"][1], g, atol=1e-3)


@gpu
@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_gpu_bulk_out_of_range_values(bulk_decode, monkeypatch, mode, num_splits):
    """Device-side values out of range under the bulk variant: NaN rows, nothing written, nothing
    outside the tensors read or touched (as the default, test_decode_cuda.out_of_range_case)."""
    monkeypatch.setenv(VAR, mode)
    out_of_range_case("cuda", torch.bfloat16, num_splits=num_splits)
