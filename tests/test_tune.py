"""The autotuner (flashgen.tune: store, resources, timing, tuner; the candidates are the sm80
family's, families/sm80_tuning.py): candidates, the resource report parser, the store, the choice
of tuned tiles, tuning at first use, and (GPU) a real tuning run reused by a second process."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SPECS

import flashgen
from flashgen import families, tiles
from flashgen.build import artifact
from flashgen.errors import BuildError
from flashgen.lang import frontend, ir
from flashgen.runtime import loader
from flashgen.tune import resources, timing, tuner
from flashgen.tune import store as tune_store

BF16 = ir.DType.BF16
TUNING = families.get("sm80").tuning  # the sm80 family's candidates (families/sm80_tuning.py)
META = {"gpu": "NVIDIA Test GPU", "arch": "sm_90a", "cuda": "12.8", "torch": "2.13.0", "flashgen": "0.1.0"}


@pytest.fixture(scope="module")
def causal():
    return frontend.parse(SPECS / "causal.attn")


@pytest.fixture(scope="module")
def alibi():
    return frontend.parse(SPECS / "alibi.attn")


@pytest.fixture
def store(monkeypatch, tmp_path):
    """An empty store under a temporary cache dir, for a fake device 0 (metadata META, sm_90a)."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHGEN_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHGEN_CUDA_FWD_TILE", raising=False)
    monkeypatch.delenv("FLASHGEN_CUDA_BWD_TILE", raising=False)
    monkeypatch.setattr(tune_store, "meta", lambda index: dict(META))
    monkeypatch.setattr(tiles, "device_info", lambda index: tiles.ARCHS["sm_90a"])
    monkeypatch.setattr(tuner, "_attempted", set())
    tune_store.reload()
    yield tmp_path
    tune_store.reload()


# ---------------------------------------------------------------- candidates


@pytest.mark.parametrize("arch", ["sm_86", "sm_90a", "sm_80", "sm_120"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("spec", ["causal", "alibi"])
def test_candidates_legal_deduped_default_first(arch, head_dim, kind, spec, request):
    sp = request.getfixturevalue(spec)
    info = tiles.arch_info(arch)
    got = TUNING.candidates(sp, arch, head_dim, kind, info)
    refs = TUNING.reference_tiles(sp, arch, head_dim, kind, info)
    assert got[0] == refs["default"]
    assert len(got) == len(set(got)) <= (TUNING.fwd_limit if kind == "fwd" else TUNING.bwd_limit)
    want_type = tiles.FwdTile if kind == "fwd" else tiles.BwdTile
    for t in got:
        assert isinstance(t, want_type) and t.legal(), t
    for t in got[1:]:  # the default is kept as it is: it is what runs untuned
        assert t.smem_bytes(head_dim) <= info.smem_optin, (t, t.smem_bytes(head_dim))
    if refs["derived"].smem_bytes(head_dim) <= info.smem_optin:
        assert refs["derived"] in got
    if refs["table"] is not None:
        assert refs["table"] in got
    assert got == TUNING.candidates(sp, arch, head_dim, kind, info)  # deterministic


def test_candidates_shared_memory_prunes_per_arch(causal):
    small = TUNING.candidates(causal, "sm_86", 128, "fwd")  # 99 KB of shared memory per block
    big = TUNING.candidates(causal, "sm_90a", 128, "fwd")  # 227 KB
    assert all(t.smem_bytes(128) <= 101376 for t in small)
    assert any(t.smem_bytes(128) > 101376 for t in big)
    # The sm_90 table's backward tile (64 queries x 128 keys at d = 128) does not fit in 99 KB.
    assert tiles.BwdTile(64, 8, 1, 2) in TUNING.candidates(causal, "sm_90a", 128, "bwd")
    assert tiles.BwdTile(64, 8, 1, 2) not in TUNING.candidates(causal, "sm_86", 128, "bwd")


def test_candidates_cap_keeps_default_and_derived(causal):
    for kind in ("fwd", "bwd"):
        refs = TUNING.reference_tiles(causal, "sm_90a", 128, kind)
        assert TUNING.candidates(causal, "sm_90a", 128, kind, limit=1) == list(dict.fromkeys(
            [refs["default"], refs["derived"]]))
        assert len(TUNING.candidates(causal, "sm_90a", 128, kind, limit=4)) == 4


def test_candidates_drop_hopeless_register_estimates(alibi):
    for kind in ("fwd", "bwd"):
        refs = TUNING.reference_tiles(alibi, "sm_90a", 256, kind)
        for t in TUNING.candidates(alibi, "sm_90a", 256, kind, limit=100):
            if t not in (refs["default"], refs["derived"]):
                assert t.regs_estimate(256, True) <= tiles.REG_LIMIT + TUNING.reg_slack


def test_candidate_instantiation_builds_one_pass(causal):
    target = families.get("sm80").target("sm_90a")
    inst = TUNING.instantiation(causal, target.arch, BF16, 64, tiles.FwdTile(64, 96, 4), "fwd")
    cfg = dict(inst.config)
    assert inst.kinds == ("fwd",) and cfg["fwd_only"] == 1
    assert (cfg["fwd_block_m"], cfg["fwd_block_n"], cfg["fwd_warps"]) == (64, 96, 4)
    assert list(inst.sources()) == [inst.source_name("fwd")]
    inst = TUNING.instantiation(causal, target.arch, BF16, 64, tiles.BwdTile(32, 4, 1, 2), "bwd")
    assert inst.kinds == ("bwd",) and dict(inst.config)["bwd_warps"] == 4


def test_seqlen_bucket():
    assert [tune_store.seqlen_bucket(n) for n in (1, 300, 1000, 1500, 2048, 3000, 4096, 8192, 20000, 10**9)] == \
        [256, 256, 1024, 1024, 4096, 4096, 4096, 16384, 16384, 65536]
    assert tune_store.seqlen_bucket(None) == tune_store.BUCKET_DEFAULT


# ---------------------------------------------------------------- resource report

# cuobjdump -res-usage output (CUDA 13) for a library built for sm_90a and sm_80.
RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN8flashgen4cuda10fwd_kernelINS0_9FwdKernelIN12_GLOBAL__N_16causalE13__nv_bfloat16Li64EEEEEvNT_6ParamsE:
  REG:168 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:992 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN8flashgen4cuda10bwd_kernelINS0_9BwdKernelIN12_GLOBAL__N_16causalELb1EEEEEvNT_6ParamsE:
  REG:255 STACK:312 SHARED:0 LOCAL:8 CONSTANT[0]:1024 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN8flashgen4cuda10bwd_kernelINS0_9BwdKernelIN12_GLOBAL__N_16causalELb0EEEEEvNT_6ParamsE:
  REG:232 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:1024 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN8flashgen4cuda13bwd_dq_kernelINS0_8DqKernelIN12_GLOBAL__N_16causalEEEEEvNT_6ParamsE:
  REG:128 STACK:900 SHARED:0 LOCAL:0 CONSTANT[0]:700 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function small:
  REG:8 STACK:0 SHARED:4096 LOCAL:0 CONSTANT[0]:536 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_80
code version = [1,8]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function small:
  REG:10 STACK:16 SHARED:5120 LOCAL:0 CONSTANT[0]:360 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_res_usage():
    res = resources.parse_res_usage(RES_USAGE)
    assert len(res) == 5
    assert res["small"] == resources.KernelResources(10, 16, 5120, 0)  # the larger figure of either arch
    only90 = resources.parse_res_usage(RES_USAGE, "sm_90a")
    assert only90["small"] == resources.KernelResources(8, 0, 4096, 0)
    fwd = resources.main_kernel(only90, "fwd")
    assert fwd == resources.KernelResources(168, 0, 0, 0) and fwd.local_bytes == 0
    bwd = resources.main_kernel(only90, "bwd")  # both bwd_kernel instantiations; not bwd_dq_kernel
    assert bwd.regs == 255 and bwd.local_bytes == 320
    assert resources.main_kernel(resources.parse_res_usage(RES_USAGE, "sm_80"), "fwd") is None
    assert resources.main_kernel(None, "fwd") is None
    assert resources.parse_res_usage("garbage\n Function x:\n REG:abc\n") == {}
    assert resources.parse_res_usage("") == {}


def test_resource_usage_without_cuobjdump(monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "find_cuobjdump", lambda: None)
    assert resources.resource_usage(tmp_path / "lib.so") is None
    monkeypatch.setattr(resources, "find_cuobjdump", lambda: str(tmp_path / "missing-tool"))
    assert resources.resource_usage(tmp_path / "lib.so") is None


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None or resources.find_cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_resource_usage_of_a_real_library(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text("extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n")
    lib = tmp_path / "k.so"
    subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_80,code=sm_80", "-o", str(lib),
                    str(src)], check=True, capture_output=True, timeout=300)
    res = resources.resource_usage(lib, "sm_80")
    assert set(res) == {"twice"} and 1 <= res["twice"].regs <= 255 and res["twice"].local_bytes == 0


# ---------------------------------------------------------------- store


FWD_A = tiles.FwdTile(128, 32, 4).config()
FWD_B = tiles.FwdTile(64, 64, 4).config()
BWD_A = tiles.BwdTile(32, 8, 1, 2).config()


def test_record_then_lookup_nearest_in_log2(store, causal):
    path = tune_store.record(causal, 0, BF16, 64, "fwd", 1024, FWD_A, {"ms": 0.5})
    tune_store.record(causal, 0, BF16, 64, "fwd", 16384, FWD_B)
    assert path == tune_store.store_path(0) and path.is_file() and path.parent == store / "cache" / "tuning"
    assert json.loads(path.read_text())["meta"] == META
    fp = causal.fingerprint()
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 1024) == (FWD_A, 1024)
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 2048) == (FWD_A, 1024)
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 4096) == (FWD_B, 16384)  # equally far: the longer
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 100) == (FWD_A, 1024)
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 10**6) == (FWD_B, 16384)
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", None) == (FWD_B, 16384)
    assert tune_store.lookup(fp, 0, BF16, 64, "bwd", 1024) is None
    assert tune_store.lookup(fp, 0, BF16, 128, "fwd", 1024) is None
    assert tune_store.lookup(fp, 0, ir.DType.FP16, 64, "fwd", 1024) is None
    assert tune_store.bucket(fp, 0, BF16, 64, 3000) == (1024, None)
    assert tune_store.tuned_seqlens(fp, 0, BF16, 64, "fwd") == [1024, 16384]


def test_metadata_mismatch_is_ignored(store, causal, monkeypatch):
    tune_store.record(causal, 0, BF16, 64, "fwd", 1024, FWD_A)
    monkeypatch.setattr(tune_store, "meta", lambda index: META | {"torch": "2.14.0"})
    tune_store.reload()
    assert tune_store.store_path(0).is_file()  # same GPU, same file, other torch: ignored
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) is None
    tune_store.record(causal, 0, BF16, 64, "fwd", 4096, FWD_B)  # rewrites the file under the new metadata
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_B, 4096)


def test_reload_rereads_the_files(store, causal):
    tune_store.record(causal, 0, BF16, 64, "fwd", 1024, FWD_A)
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_A, 1024)
    path = tune_store.store_path(0)
    data = json.loads(path.read_text())
    key = tune_store.entry_key(causal, BF16, 64, "fwd")
    data["entries"][key]["1024"]["config"] = FWD_B  # another process writes
    path.write_text(json.dumps(data))
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_A, 1024)  # read once per process
    tune_store.reload()
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_B, 1024)


def test_aot_directories_are_read_first(store, causal, monkeypatch):
    tune_store.record(causal, 0, BF16, 64, "fwd", 1024, FWD_A)
    tune_store.record(causal, 0, BF16, 64, "fwd", 16384, FWD_A)
    aot = store / "aot"
    (aot / "tuning").mkdir(parents=True)
    key = tune_store.entry_key(causal, BF16, 64, "fwd")
    (aot / "tuning" / tune_store.store_path(0).name).write_text(json.dumps(
        {"meta": META, "entries": {key: {"1024": {"config": FWD_B}}}}))
    monkeypatch.setenv("FLASHGEN_AOT_DIR", str(aot))
    tune_store.reload()
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_B, 1024)  # the AOT dir's winner
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 16384) == (FWD_A, 16384)  # the cache's others stay


def test_corrupt_files_and_entries_are_ignored(store, causal):
    path = tune_store.store_path(0)
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) is None
    key = tune_store.entry_key(causal, BF16, 64, "fwd")
    path.write_text(json.dumps({"meta": META, "entries": {
        key: {"1024": {"config": FWD_A}, "2048": {"config": {"fwd_block_m": 128}},  # missing keys
              "4096": {"config": tiles.FwdTile(128, 24, 4).config()},  # an illegal tile
              "x": {"config": FWD_B}, "-5": {"config": FWD_B}, "8192": "nonsense"},
        tune_store.entry_key(causal, BF16, 64, "bwd"): ["not", "a", "dict"]}}))
    tune_store.reload()
    assert tune_store.tuned_seqlens(causal, 0, BF16, 64, "fwd") == [1024]
    assert tune_store.lookup(causal, 0, BF16, 64, "bwd", 1024) is None
    path.write_text(json.dumps(["a list"]))
    tune_store.reload()
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) is None
    tune_store.record(causal, 0, BF16, 64, "fwd", 1024, FWD_B)  # a damaged file is replaced
    assert tune_store.lookup(causal, 0, BF16, 64, "fwd", 1024) == (FWD_B, 1024)


# ---------------------------------------------------------------- the choice


def test_choose_prefers_env_then_tuned_then_table(store, causal, monkeypatch):
    fp = causal.fingerprint()
    base = tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert (base.fwd_origin, base.bwd_origin) == ("table", "table")
    tune_store.record(fp, 0, BF16, 64, "fwd", 1024, FWD_A)
    c = tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert (c.fwd_origin, c.bwd_origin) == ("tuned", "table") and c.fwd == tiles.FwdTile(128, 32, 4)
    assert c.tuned_seqlen == (1024, None) and c.bwd == base.bwd
    tune_store.record(fp, 0, BF16, 64, "bwd", 4096, BWD_A)
    c = tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert (c.bwd_origin, c.bwd, c.tuned_seqlen) == ("tuned", tiles.BwdTile(32, 8, 1, 2), (1024, 4096))
    assert tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp,
                        use_tuned=False).fwd_origin == "table"
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "64x64x4")
    c = tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert (c.fwd_origin, c.fwd, c.bwd_origin) == ("env", tiles.FwdTile(64, 64, 4), "tuned")
    monkeypatch.setenv("FLASHGEN_CUDA_BWD_TILE", "64x8x1x2")
    c = tiles.choose(causal, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert (c.bwd_origin, c.tuned_seqlen) == ("env", (None, None))


def test_a_recorded_winner_reaches_the_next_call(store, causal_op, monkeypatch):
    """The op runtime caches which library serves a call; recording a winner (a store reload)
    drops those choices (ops.invalidate_libraries, registered with store.on_reload), so the next
    call loads the tuned tiles."""
    from flashgen.runtime import op as runtime_op

    monkeypatch.delenv("FLASHGEN_AUTOTUNE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_90a")

    class FakeLib:
        def __init__(self, inst):
            self.instantiation = inst

    monkeypatch.setattr(loader, "load", lambda inst, announce=None: FakeLib(inst))
    assert runtime_op.invalidate_libraries in tune_store._reload_callbacks
    assert runtime_op.first_use_tuner is tuner.ensure_tuned  # plugged in by importing flashgen
    fam, dev = families.get("sm80"), torch.device("cuda", 0)
    first = causal_op.library(fam, dev, BF16, 64, seqlen=1024)
    assert dict(first.instantiation.config)["fwd_block_n"] == 64  # the table's 128x64x4
    assert causal_op.library(fam, dev, BF16, 64, seqlen=1024) is first  # cached
    generation = runtime_op._generation[0]
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 1024, FWD_A)
    assert runtime_op._generation[0] > generation
    tuned = causal_op.library(fam, dev, BF16, 64, seqlen=1024)
    assert tuned is not first and dict(tuned.instantiation.config)["fwd_block_n"] == 32  # 128x32x4


# ---------------------------------------------------------------- tuning at first use


@pytest.fixture
def no_tuning(monkeypatch):
    """Record tune_op calls instead of tuning (nothing here may touch a GPU)."""
    calls = []

    def fake(op, device, dtype, head_dim, seqlens, kinds=tuner.KINDS, progress=True, **kw):
        calls.append((op.spec.name, device.index, dtype, head_dim, list(seqlens), tuple(kinds)))
        for kind in kinds:
            cfg = FWD_A if kind == "fwd" else BWD_A
            tune_store.record(op.fingerprint, device.index, dtype, head_dim, kind, seqlens[0], cfg)
        return {k: {seqlens[0]: {"winner": "x"}} for k in kinds}

    monkeypatch.setattr(tuner, "tune_op", fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


def test_ensure_tuned_does_nothing_when_stored(store, causal_op, no_tuning):
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 4096, FWD_A)
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "bwd", 4096, BWD_A)
    for n in (2100, 4096, 8000, None):
        tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, n)
    assert no_tuning == []


def test_ensure_tuned_tunes_a_bucket_once(store, causal_op, no_tuning, monkeypatch, capsys):
    monkeypatch.setenv("FLASHGEN_QUIET", "0")
    dev = torch.device("cuda", 0)
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 4096, FWD_A)  # only the forward is stored
    tuner.ensure_tuned(causal_op, dev, BF16, 64, 3000)
    tuner.ensure_tuned(causal_op, dev, BF16, 64, 5000)  # same bucket (4096), now stored
    assert no_tuning == [("causal", 0, BF16, 64, [4096], ("bwd",))]
    err = capsys.readouterr().err
    assert "flashgen: tuning causal (bf16, head_dim 64, seqlen 4096: bwd)" in err
    tuner.ensure_tuned(causal_op, dev, BF16, 64, 20000)  # a new bucket: both passes
    assert no_tuning[-1] == ("causal", 0, BF16, 64, [16384], ("fwd", "bwd"))
    assert len(no_tuning) == 2
    tune_store.reload()  # even if the results vanished, a key is never tuned twice in a process
    tuner.ensure_tuned(causal_op, dev, BF16, 64, 20000)
    assert len(no_tuning) == 2


def test_ensure_tuned_skips_passes_forced_by_the_environment(store, causal_op, no_tuning, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "128x64x4")
    tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, 1024)
    assert no_tuning == [("causal", 0, BF16, 64, [1024], ("bwd",))]


def test_ensure_tuned_failure_is_remembered_not_raised(store, causal_op, monkeypatch, capsys):
    monkeypatch.setenv("FLASHGEN_QUIET", "0")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(tuner, "tune_op", broken)
    for _ in range(3):
        tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, 1024)
    assert calls == [1]
    assert "using the default tiles" in capsys.readouterr().err


def test_ensure_tuned_skips_while_compiling_or_capturing(store, causal_op, no_tuning, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, 1024)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, 1024)
    assert no_tuning == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tuner.ensure_tuned(causal_op, torch.device("cuda", 0), BF16, 64, 1024)  # not remembered as attempted
    assert len(no_tuning) == 1


# ---------------------------------------------------------------- the tuning run (GPU mocked away)


def test_tune_many_orchestration_without_a_gpu(store, causal_op, monkeypatch):
    """tune_many's bookkeeping with builds, resources, runs and timings faked (the sm80 family
    asked for by name on an sm_90a device): build failures and wrong results score infinite,
    spills prune (not the default/derived), the default wins within MARGIN, winners are recorded
    and the winners' instantiations prebuilt."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_90a")
    built, insts = [], {}

    class FakeLib:
        def __init__(self, inst):
            self.instantiation, self.path = inst, Path(inst.name)

    def load(inst, announce=None):
        cfg = dict(inst.config)
        built.append(inst)
        if cfg.get("fwd_only") and cfg["fwd_block_n"] == 48:
            raise BuildError("nvcc failed")
        insts[inst.name] = inst
        return FakeLib(inst)

    def fake_resources(path, arch=None):
        cfg = dict(insts[str(path)].config)
        kind = "fwd" if cfg.get("fwd_only") else "bwd"
        spill = 1000 if (kind == "fwd" and cfg["fwd_block_n"] == 96) or (kind == "bwd" and (
            cfg["bwd_block_m"] == 32 or cfg["bwd_warps_mdq"] == 2 and cfg["bwd_warps"] == 8)) else 0
        return {f"_ZN8flashgen4cuda10{kind}_kernelIXEEvv": resources.KernelResources(200, spill, 0, 0)}

    fwd_ms = {"128x64x4": 1.0, "128x32x4": 0.8}
    bwd_ms = {"64x8x1x2": 2.0, "64x8x2x2": 1.99, "64x4x1x2": 0.5}

    def workload(op, device, dtype, head_dim, seqlen, kind, tokens, fwd_lib, l2_bytes):
        assert kind == "fwd" or fwd_lib is not None
        return timing.Workload(1, 2, seqlen, head_dim, [{}, {}], [], 0.125, 1e9)

    def runner(op, w, kind, lib):
        tile = str(tiles.from_config(dict(lib.instantiation.config))[0 if kind == "fwd" else 1])
        wrong = tile == "64x4x1x2"

        def fn(i):
            return (torch.full((4,), 100.0 if wrong else 1.0),)

        fn.ms = (fwd_ms if kind == "fwd" else bwd_ms).get(tile, 3.0)
        return fn

    monkeypatch.setattr(loader, "load", load)
    monkeypatch.setattr(resources, "resource_usage", fake_resources)
    monkeypatch.setattr(timing, "workload", workload)
    monkeypatch.setattr(timing, "runner", runner)
    monkeypatch.setattr(timing, "time_calls", lambda fn, nsets, device, warmup, reps: fn.ms)
    events = []
    res = tuner.tune_op(causal_op, "cuda:0", "bf16", 64, [4096, 1024], progress=lambda *a: events.append(a),
                       prebuild=True, family="sm80")  # sm80's tiles of both passes (auto: sm90's forward)
    fwd, bwd = res["fwd"], res["bwd"]
    assert sorted(fwd) == [1024, 4096] and res["store"] == str(tune_store.store_path(0))
    assert fwd[1024]["winner"] == "128x32x4" and fwd[1024]["config"] == FWD_A
    assert fwd[1024]["default"] == "128x64x4" and fwd[1024]["default_ms"] == 1.0
    assert fwd[1024]["tflops"] == pytest.approx(1e9 / 0.8 / 1e9)
    rows = {r["tile"]: r for r in fwd[1024]["candidates"]}
    assert len(rows) == len(TUNING.candidates(causal_op.spec, "sm_90a", 64, "fwd"))
    assert rows["128x48x4"]["ms"] is None and "build failed" in rows["128x48x4"]["error"]
    assert rows["128x96x4"]["ms"] is None and "spills" in rows["128x96x4"]["pruned"]
    assert rows["128x64x4"]["roles"] == ["default", "table"] and rows["64x256x4"]["roles"] == ["derived"]
    assert rows["64x256x4"]["ms"] == 3.0 and rows["128x64x4"]["regs"] == 200
    brows = {r["tile"]: r for r in bwd[4096]["candidates"]}
    assert bwd[4096]["winner"] == "64x8x1x2"  # 64x8x2x2 is faster by less than MARGIN
    assert "differs from the default" in brows["64x4x1x2"]["error"] and brows["64x4x1x2"]["ms"] is None
    assert brows["64x8x1x2"]["ms"] == 2.0 and brows["64x8x1x2"]["local"] == 1000  # spills, but the default
    assert "pruned" in brows["32x8x1x2"] and "pruned" in brows["64x8x2x2"]
    assert tune_store.lookup(causal_op.fingerprint, 0, BF16, 64, "fwd", 1024) == (FWD_A, 1024)
    assert tune_store.lookup(causal_op.fingerprint, 0, BF16, 64, "bwd", 1024)[0] == tiles.BwdTile(64, 8, 1, 2).config()
    stored = json.loads(tune_store.store_path(0).read_text())["entries"][tune_store.entry_key(causal_op.spec, BF16, 64, "fwd")]
    assert stored["1024"]["ms"] == 0.8 and stored["1024"]["default"] == "128x64x4"
    one_pass = [i for i in built if dict(i.config).get("fwd_only") or dict(i.config).get("bwd_only")]
    assert len(one_pass) == len({i.config for i in one_pass})  # each candidate compiled once for both lengths
    full = [i for i in built if i not in one_pass]
    assert full and all(i.kinds == ("fwd", "bwd") for i in full)
    assert all(dict(i.config)["fwd_block_n"] == 32 for i in full)  # the prebuilt winners
    assert {e[0] for e in events} == {"compile", "time", "prebuild"}
    assert events[-1][:3] == ("prebuild", len(full), len(full))


def test_tune_requires_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        tuner.tune_op(flashgen.compile(SPECS / "causal.attn"), "cuda", "bf16", 64, [1024])
    with pytest.raises(ValueError, match="CUDA kernels"):
        tuner.tune_op(flashgen.compile(SPECS / "causal.attn"), "cpu", "bf16", 64, [1024])


def test_cli_tune_without_cuda_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from flashgen import cli

    assert cli.main(["tune", str(SPECS / "causal.attn")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert cli.main(["tune", str(SPECS / "causal.attn"), "--device", "cpu"]) == 2


# ---------------------------------------------------------------- GPU

SUBPROCESS = r"""
import json, sys
import torch
import flashgen
from flashgen import check
from flashgen.build import artifact, cache
from flashgen.lang import ir
from flashgen.tune import timing, tuner

calls = []


def forbid(name):
    def f(*a, **k):
        calls.append(name)
        raise RuntimeError(name + " must not run: the stored result should be used")
    return f


want = op_inst = None
op = flashgen.compile(sys.argv[1])
op_inst = op.instantiation("cuda", ir.DType.BF16, 64, seqlen=1024)
print("child instantiation", op_inst.name, json.dumps(op_inst.key_fields(), sort_keys=True), file=sys.stderr)
timing.time_calls = forbid("timing")
tuner.tune_many = forbid("tuning")
cache._build_and_publish = forbid("compiling")
op = flashgen.compile(sys.argv[1])
choice = op.tiles("cuda", ir.DType.BF16, 64, 1024)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, dout = (torch.randn(2, 4, 1024, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
out, lse = op(qg, kg, vg, return_lse=True)
fwd = check.compare(op.spec, q, k, v, out.detach(), lse.detach())
out.backward(dout)
bwd = check.compare_grads(op.spec, q, k, v, dout, (qg.grad, kg.grad, vg.grad))
print(json.dumps({"fwd": choice.fwd_origin, "bwd": choice.bwd_origin, "fwd_tile": str(choice.fwd),
                  "bwd_tile": str(choice.bwd), "calls": calls, "fwd_ok": fwd.ok, "bwd_ok": bwd.ok,
                  "fwd_cmp": str(fwd), "bwd_cmp": str(bwd)}))
"""


@pytest.mark.gpu
def test_tune_then_a_second_process_uses_the_stored_result(tmp_path, monkeypatch, causal_op):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")  # the tuned family, in this process and the child
    monkeypatch.delenv("FLASHGEN_AOT_DIR", raising=False)
    monkeypatch.delenv("FLASHGEN_CUDA_FWD_TILE", raising=False)
    monkeypatch.delenv("FLASHGEN_CUDA_BWD_TILE", raising=False)
    tune_store.reload()
    try:
        res = tuner.tune_op(causal_op, "cuda", "bf16", 64, [1024], limit=3, reps=5, tokens=4096, prebuild=True,
                           progress=False)
        index = torch.cuda.current_device()
        winners = {}
        for kind in ("fwd", "bwd"):
            e = res[kind][1024]
            assert "winner" in e, e
            assert e["ms"] > 0 and e["tflops"] > 0
            timed = [r for r in e["candidates"] if r["ms"] is not None]
            assert any("default" in r["roles"] for r in timed), e["candidates"]
            assert 1 <= len(e["candidates"]) <= 3
            assert tune_store.lookup(causal_op.fingerprint, index, ir.DType.BF16, 64, kind, 1024) == (e["config"], 1024)
            winners[kind] = e["winner"]
        assert res["store"] == str(tune_store.store_path(index))
        env = dict(os.environ, FLASHGEN_CACHE_DIR=str(tmp_path / "cache"), FLASHGEN_AUTOTUNE="1",
                   FLASHGEN_QUIET="1")
        proc = subprocess.run([sys.executable, "-c", SUBPROCESS, str(SPECS / "causal.attn")], env=env, cwd=ROOT,
                              check=False, capture_output=True, text=True, timeout=600)
        mine = causal_op.instantiation("cuda", ir.DType.BF16, 64, seqlen=1024)
        assert proc.returncode == 0, (f"parent instantiation {mine.name} "
                                      f"{json.dumps(mine.key_fields(), sort_keys=True)}\n{proc.stderr}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["calls"] == [], got
        assert (got["fwd"], got["bwd"]) == ("tuned", "tuned")
        assert (got["fwd_tile"], got["bwd_tile"]) == (winners["fwd"], winners["bwd"])
        assert got["fwd_ok"], got["fwd_cmp"]
        assert got["bwd_ok"], got["bwd_cmp"]
    finally:
        tune_store.reload()


@pytest.mark.gpu
def test_tuned_op_matches_the_reference_in_process(tmp_path, monkeypatch):
    """With FLASHGEN_AUTOTUNE=1 the first call tunes (a small cap), later calls use the winner
    (on sm80, the tuned family: forced, so that on Hopper the forward does not take sm90)."""
    from flashgen import check

    monkeypatch.setenv("FLASHGEN_FAMILY", "sm80")

    # An op of its own: the session's causal op must not keep libraries of this test's store.
    causal_op = flashgen.compile("attention causal_autotune {\n    mask = causal\n}\n")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHGEN_AUTOTUNE", "1")
    monkeypatch.setattr(TUNING, "fwd_limit", 2)
    monkeypatch.setattr(TUNING, "bwd_limit", 2)
    monkeypatch.setattr(timing, "TOKENS", 2048)
    monkeypatch.setattr(tuner, "_attempted", set())
    tune_store.reload()
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, dout = (torch.randn(1, 4, 1000, 64, device="cuda", generator=g).to(torch.bfloat16)
                         for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = causal_op(qg, kg, vg, return_lse=True)
        choice = causal_op.tiles("cuda", ir.DType.BF16, 64, 1000)
        assert (choice.fwd_origin, choice.bwd_origin) == ("tuned", "tuned")
        assert choice.tuned_seqlen == (1024, 1024)
        assert check.compare(causal_op.spec, q, k, v, out.detach(), lse.detach()).ok
        out.backward(dout)
        assert check.compare_grads(causal_op.spec, q, k, v, dout, (qg.grad, kg.grad, vg.grad)).ok
    finally:
        tune_store.reload()


def test_timing_rotates_the_input_sets():
    """timing.time_calls times through flashgen.bench.time_fn, advancing the input set on every call
    (warm-up included), so consecutive calls never reuse the previous call's inputs."""
    seen = []
    ms = timing.time_calls(seen.append, 3, torch.device("cpu"), warmup=2, reps=5)
    assert seen == [0, 1, 2, 0, 1, 2, 0] and ms >= 0
