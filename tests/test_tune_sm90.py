"""Tuning the sm90 family's forward tiles (families/sm90_tuning.py, flashgen.tune): the candidates'
legality at every head dim, the per-family store keys (sm80's unchanged), the tuned tile flowing
into the op, `op.tiles()`, explain and ahead-of-time plans, the first-use tuner and `flashgen tune
--family`. The GPU is mocked away (device capability, timings, builds) as in tests/test_tune.py."""

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SPECS

import flashgen
from flashgen import cli, families, tiles
from flashgen import explain as ex
from flashgen.build import aot, artifact
from flashgen.families import sm90
from flashgen.lang import frontend, ir
from flashgen.runtime import loader
from flashgen.tools import aot_build
from flashgen.tune import resources, timing, tuner
from flashgen.tune import store as tune_store

BF16, FP16 = ir.DType.BF16, ir.DType.FP16
SM90 = families.get("sm90")
TUNING = SM90.tuning
META = {"gpu": "NVIDIA Test GPU", "arch": "sm_90a", "cuda": "12.8", "torch": "2.13.0", "flashgen": "0.1.0"}
WINNER = sm90.Sm90Tile(112, 3, 0, 0, 2048, 2)  # a non-default tile, legal at d 64 and 128
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.fixture(scope="module")
def specs():
    return {n: frontend.parse(SPECS / f"{n}.attn") for n in ("causal", "dense", "alibi", "document", "dropout")}


@pytest.fixture
def store(monkeypatch, tmp_path):
    """An empty store under a temporary cache dir, for a fake device 0 (metadata META, sm_90a)."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("FLASHGEN_AOT_DIR", "FLASHGEN_CUDA_FWD_TILE", "FLASHGEN_CUDA_BWD_TILE", "FLASHGEN_FAMILY",
                "FLASHGEN_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tune_store, "meta", lambda index: dict(META))
    monkeypatch.setattr(tiles, "device_info", lambda index: tiles.ARCHS["sm_90a"])
    monkeypatch.setattr(tuner, "_attempted", set())
    tune_store.reload()
    yield tmp_path
    tune_store.reload()


@pytest.fixture
def hopper(monkeypatch):
    """A live CUDA device 0 of compute capability 9.0 (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: META["gpu"])
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_90a")


class FakeLib:
    def __init__(self, inst):
        self.instantiation, self.path = inst, Path(inst.name)


# ---------------------------------------------------------------- candidates


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("name", ["causal", "dense", "alibi", "dropout"])
def test_candidates_are_legal_at_every_head_dim(specs, name, sparse):
    """Every head dim multiple of 8 up to 256, both dtypes: the default first, each candidate
    accepted by sm90's own rules (check_tiles, the family's config and instantiation), within
    shared memory, not known to spill, no two alike, at most fwd_limit, the same list twice."""
    spec = specs[name]
    for hd in range(8, 257, 8):
        for seqlens in (None, [4096], [1024, 4096, 16384]):
            got = TUNING.candidates(spec, "sm_90a", hd, "fwd", seqlens=seqlens, sparse=sparse)
            default = sm90.Sm90Tile.from_config(sm90.default_tiles(spec, hd, sparse))
            assert got[0] == default and 1 <= len(got) <= TUNING.fwd_limit
            assert len(got) == len(set(got)) == len({TUNING.behaviour(t, seqlens) for t in got})
            assert len({tuple(sorted(t.config().items())) for t in got}) == len(got)
            assert got == TUNING.candidates(spec, "sm_90a", hd, "fwd", seqlens=seqlens, sparse=sparse)
            for t in got:
                sm90.check_tiles(t.config() | ({"sparse": 1} if sparse else {}), hd)
                assert t.smem_bytes(hd) <= sm90.SMEM_LIMIT
                if t != default:
                    assert TUNING.why_not(spec, hd, t, sparse=sparse) is None, (hd, str(t))
                    assert sm90.spill_reason(spec, hd, t) is None
                if sparse:
                    assert sm90.nests_in_blocks(t)
        if hd in (8, 64, 136, 256):  # instantiable (the config a build renders), both dtypes
            for t in got:
                for dt in (BF16, FP16):
                    inst = TUNING.instantiation(spec, "sm_90a", dt, hd, t, "fwd", sparse=sparse)
                    cfg = dict(inst.config)
                    assert inst.kinds == ("fwd",) and inst.target.family == "sm90"
                    assert sm90.Sm90Tile.from_config(cfg) == t


def test_candidates_vary_each_knob_and_dedupe_persistent_caps(specs):
    dense, causal = specs["dense"], specs["causal"]
    at64 = TUNING.candidates(dense, "sm_90a", 64, "fwd", seqlens=[1024, 4096, 16384])
    assert at64[0].consumers == 3 and any(t.consumers == 2 for t in at64)  # 3 <-> 2 consumer warpgroups
    assert {t.stages for t in at64} == {2, 3} and any(t.pingpong for t in at64)
    assert len({t.block_n for t in at64}) > 1
    # persistent caps 4096 and "every seqlen_k" launch alike at N <= 4096: one of them only
    one = TUNING.candidates(causal, "sm_90a", 128, "fwd", seqlens=[4096], limit=100)
    caps = {t.persistent for t in one if t.with_(persistent=0) == one[0].with_(persistent=0)}
    assert 4096 in caps and 1 << 30 not in caps and 2048 in caps
    three = TUNING.candidates(causal, "sm_90a", 128, "fwd", seqlens=[1024, 4096, 16384], limit=100)
    assert {4096, 1 << 30} <= {t.persistent for t in three}
    # no overlap where it spills (dropout, per-element tensor reads), no three warpgroups above d 64
    assert all(not t.overlap for t in TUNING.candidates(specs["dropout"], "sm_90a", 128, "fwd", limit=100))
    assert all(t.consumers == 2 for t in TUNING.candidates(dense, "sm_90a", 128, "fwd", limit=100))
    assert len(TUNING.candidates(dense, "sm_90a", 128, "fwd", limit=3)) == 3
    assert TUNING.candidates(dense, "sm_90a", 128, "fwd", limit=1) == [TUNING.reference_tiles(
        dense, "sm_90a", 128, "fwd")["default"]]


def test_candidate_errors(specs):
    with pytest.raises(ValueError, match="kind: the sm90 family tunes only its forward"):
        TUNING.candidates(specs["causal"], "sm_90a", 64, "bwd")
    with pytest.raises(ValueError, match="arch: the sm90 family needs compute capability 9.0"):
        TUNING.candidates(specs["causal"], "sm_80", 64, "fwd")
    t = sm90.Sm90Tile(128, 2, 0, 0, 0, 3)
    assert str(t) == "128x2x0x0x0x3" and sm90.tiles_from_text(str(t)) == t.config() | {"fwd_consumers": 3}
    assert sm90.Sm90Tile.from_config(sm90.tiles_from_text("128x2x1x0x4096")).consumers == 2


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_a_non_default_candidate_compiles(specs, tmp_path):
    """One non-default candidate (three K/V stages at d 128, the first one tried) compiles for
    sm_90a with the flags a build uses (about 5 s)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    t = TUNING.candidates(specs["causal"], "sm_90a", 128, "fwd")[1]
    assert t == sm90.Sm90Tile(128, 3, 1, 0, 4096, 2)
    inst = TUNING.instantiation(specs["causal"], "sm_90a", BF16, 128, t, "fwd")
    src = tmp_path / "k.cu"
    src.write_text(inst.sources()[inst.source_name("fwd")])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FLASHGEN_DEBUG", raising=False)
        _, flags = artifact.compiler_flags(inst.target)
    cmd = [NVCC, "-c", *flags, *COMMON_NVCC_FLAGS, "-I", str(ROOT / "templates" / "include"), "-o",
           str(tmp_path / "k.o"), str(src)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert (tmp_path / "k.o").stat().st_size > 0


# ---------------------------------------------------------------- the store


def test_store_keys_per_family_and_sm80_keys_unchanged(store, specs):
    fp = specs["causal"].fingerprint()
    assert tune_store.entry_key(fp, BF16, 64, "fwd", "sm90") == f"{fp}|bf16|hd64|sm90|fwd"
    assert tune_store.entry_key(fp, BF16, 64, "fwd") == tune_store.entry_key(fp, BF16, 64, "fwd", "sm80") == \
        f"{fp}|bf16|hd64|fwd"
    sm80_cfg = tiles.FwdTile(128, 32, 4).config()
    # a store written before families were tuned: its sm80 entries read as they did
    path = tune_store.store_path(0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": META, "entries": {
        f"{fp}|bf16|hd64|fwd": {"1024": {"config": sm80_cfg, "ms": 1.0}},
        f"{fp}|bf16|hd64|sm90|fwd": {"1024": {"config": sm80_cfg}},  # sm80's keys under sm90's: dropped
        f"{fp}|bf16|hd64|bwd": {"1024": {"config": WINNER.config()}},  # sm90's config under sm80's: dropped
        f"{fp}|bf16|hd64|sm70|fwd": {"1024": {"config": sm80_cfg}},  # nobody's family: dropped
    }}))
    tune_store.reload()
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 1024) == (sm80_cfg, 1024)
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 1024, "sm90") is None
    assert tune_store.lookup(fp, 0, BF16, 64, "bwd", 1024) is None
    tune_store.record(fp, 0, BF16, 64, "fwd", 4096, WINNER.config(), {"ms": 0.5}, family="sm90")
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 4000, "sm90") == (WINNER.config(), 4096)
    assert tune_store.lookup(fp, 0, BF16, 64, "fwd", 1024) == (sm80_cfg, 1024)  # sm80's untouched
    assert tune_store.tuned_seqlens(fp, 0, BF16, 64, "fwd", "sm90") == [4096]
    entries = json.loads(path.read_text())["entries"]
    assert set(entries) == {f"{fp}|bf16|hd64|fwd", f"{fp}|bf16|hd64|sm90|fwd"}
    assert entries[f"{fp}|bf16|hd64|fwd"]["1024"]["ms"] == 1.0
    assert sm90.valid_config(WINNER.config()) and not sm90.valid_config(sm80_cfg)
    assert not sm90.valid_config(WINNER.config() | {"fwd_pingpong": 1})  # ping-pong without the overlap


def test_sm90_choice_takes_a_legal_tuned_winner(store, specs):
    spec = specs["causal"]
    fp = spec.fingerprint()
    base = sm90.choose(spec, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp)
    assert base.origin == "family default" and base.tile == sm90.Sm90Tile.from_config(sm90.default_tiles(spec, 64))
    tune_store.record(fp, 0, BF16, 64, "fwd", 1024, WINNER.config(), family="sm90")
    c = sm90.choose(spec, "sm_90a", BF16, 64, 1500, device_index=0, fingerprint=fp)
    assert (c.tile, c.origin, c.tuned_seqlen) == (WINNER, "tuned", 1024)
    assert sm90.choose(spec, "sm_90a", BF16, 64, 1024, device_index=0, fingerprint=fp, use_tuned=False) == base
    assert sm90.choose(spec, "sm_90a", BF16, 64, 1024, fingerprint=fp) == base  # no live device: no tuning
    # block lists do not nest in 112-key tiles: block-sparse calls keep the default
    assert sm90.choose(spec, "sm_90a", BF16, 64, None, sparse=True, device_index=0, fingerprint=fp).origin == \
        "family default"
    # a winner over shared memory at this head dim is not used
    big = sm90.Sm90Tile(192, 3, 0, 0, 4096, 2)
    tune_store.record(fp, 0, BF16, 256, "fwd", 1024, big.config(), family="sm90")
    assert sm90.choose(spec, "sm_90a", BF16, 256, 1024, device_index=0, fingerprint=fp).origin == "family default"


# ---------------------------------------------------------------- op, op.tiles(), explain, AOT


def test_the_tuned_sm90_tile_reaches_the_op_and_op_tiles(store, hopper, causal_op, monkeypatch):
    monkeypatch.setattr(loader, "load", lambda inst, announce=None: FakeLib(inst))
    dev = torch.device("cuda", 0)
    first = causal_op.library(SM90, dev, BF16, 64, seqlen=1024)
    default = sm90.Sm90Tile.from_config(sm90.default_tiles(causal_op.spec, 64))
    assert sm90.Sm90Tile.from_config(dict(first.instantiation.config)) == default
    c = causal_op.tiles("cuda", BF16, 64, 1024)
    assert (c.fwd_family, c.fwd, c.fwd_origin, c.bwd_family, c.bwd_origin) == \
        ("sm90", default, "family default", "sm80", "table")
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 1024, WINNER.config(), family="sm90")
    tuned = causal_op.library(SM90, dev, BF16, 64, seqlen=1024)
    assert tuned is not first and sm90.Sm90Tile.from_config(dict(tuned.instantiation.config)) == WINNER
    c = causal_op.tiles("cuda", BF16, 64, 1024)
    assert (c.fwd, c.fwd_origin, c.tuned_seqlen, c.bwd_origin) == (WINNER, "tuned", (1024, None), "table")
    assert causal_op.instantiation("cuda", BF16, 64, seqlen=1024, family="sm90") == tuned.instantiation
    # sm80's forward is reported where sm80 runs the forward (forced); sm80's tiles stay its own
    with flashgen.use_family("sm80"):
        c80 = causal_op.tiles("cuda", BF16, 64, 1024)
        assert (c80.fwd_family, str(c80.fwd), c80.fwd_origin) == ("sm80", "128x64x4", "table")
    sm80_inst = causal_op.instantiation("cuda", BF16, 64, seqlen=1024, family="sm80")
    assert dict(sm80_inst.config)["fwd_block_n"] == 64 and dict(sm80_inst.config)["fwd_warps"] == 4


def test_explain_reports_the_tuned_sm90_forward(store, hopper, causal_op):
    rep = ex.explain(causal_op, 1024, head_dim=64, arch="sm_90a")
    assert rep.family == "sm90" and rep.tiles["fwd"].origin == "family default"
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 1024, WINNER.config(), family="sm90")
    rep = ex.explain(causal_op, 1024, head_dim=64, arch="sm_90a", backward=True)
    fwd = rep.tiles["fwd"]
    assert (fwd.origin, fwd.block_m, fwd.block_n, fwd.tuned_seqlen) == ("tuned", 128, 112, 1024)
    assert fwd.smem_bytes == WINNER.smem_bytes(64) and str(WINNER) in fwd.shape
    assert rep.tiles["bwd"].origin == "table"  # the backward: sm80's
    with flashgen.use_family("sm80"):
        assert ex.explain(causal_op, 1024, head_dim=64, arch="sm_90a").tiles["fwd"].block_n == 64


def test_aot_plan_holds_the_tuned_sm90_forward(store, hopper, causal_op):
    def sm90_tiles(plan):
        return sorted(str(sm90.Sm90Tile.from_config(dict(p.inst.config))) for p in plan
                      if p.inst.target.family == "sm90")

    default = str(sm90.Sm90Tile.from_config(sm90.default_tiles(causal_op.spec, 64)))
    assert sm90_tiles(aot_build.plan([causal_op], arches=["sm_90a"], dtypes=["bf16"], head_dims=[64])) == [default]
    tune_store.record(causal_op.fingerprint, 0, BF16, 64, "fwd", 1024, WINNER.config(), family="sm90")
    plan = aot_build.plan([causal_op], arches=["sm_90a"], dtypes=["bf16"], head_dims=[64])
    assert sm90_tiles(plan) == sorted([default, str(WINNER)])
    tuned = next(p for p in plan if p.inst.target.family == "sm90" and p.origin[0] == "tuned")
    assert tuned.tuned_seqlen == (1024, None) and tuned.device_index == 0
    assert str(WINNER) in aot.describe_instantiation(tuned.inst)
    # the JIT=0 message compares an sm90 kernel with sm90's defaults (not sm80's tables)
    untuned = next(p.inst for p in plan if p.inst.target.family == "sm90" and p.origin[0] != "tuned")
    assert aot._tiles_note(untuned) is None
    note = aot._tiles_note(tuned.inst)
    assert note is not None and "sm90 family's defaults" in note and default in note and str(WINNER) in note
    sm80_default = aot_build.plan([causal_op], arches=["sm_90a"], dtypes=["bf16"], head_dims=[64])
    assert all(aot._tiles_note(p.inst) is None for p in sm80_default if p.inst.target.family == "sm80")


# ---------------------------------------------------------------- the tuner


def test_tune_many_tunes_each_pass_on_its_family(store, hopper, causal_op, monkeypatch):
    """auto on sm_90a: the forward's candidates are sm90's, the backward's sm80's; each winner is
    stored under its family's key, and the prebuilt instantiations use them."""
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    built = []
    cands = TUNING.candidates(causal_op.spec, "sm_90a", 128, "fwd", seqlens=[1024, 4096])
    win = cands[-1]  # the last candidate is the fastest forward

    def load(inst, announce=None):
        built.append(inst)
        return FakeLib(inst)

    def tile_of(lib, kind):
        cfg = dict(lib.instantiation.config)
        if lib.instantiation.target.family == "sm90":
            return str(sm90.Sm90Tile.from_config({k: v for k, v in cfg.items() if k in sm90.TILE_KEYS}))
        return str(tiles.from_config(cfg)[0 if kind == "fwd" else 1])

    def runner(op, w, kind, lib):
        def fn(i):
            return (torch.ones(4),)

        fn.ms = 0.5 if tile_of(lib, kind) in (str(win), "64x4x1x2") else 1.0
        return fn

    monkeypatch.setattr(loader, "load", load)
    monkeypatch.setattr(resources, "resource_usage", lambda path, arch=None: None)
    monkeypatch.setattr(timing, "workload", lambda op, device, dtype, hd, n, kind, tokens, fwd_lib, l2:
                        timing.Workload(1, 2, n, hd, [{}, {}], [], 0.125, 1e9))
    monkeypatch.setattr(timing, "runner", runner)
    monkeypatch.setattr(timing, "time_calls", lambda fn, nsets, device, warmup, reps: fn.ms)
    res = tuner.tune_op(causal_op, "cuda:0", "bf16", 128, [1024, 4096], progress=False, prebuild=True)
    assert res["families"] == {"fwd": "sm90", "bwd": "sm80"}
    rows = res["fwd"][1024]["candidates"]
    assert [r["tile"] for r in rows] == [str(t) for t in cands] and len(cands) == TUNING.fwd_limit
    assert rows[0]["roles"] == ["default"] and res["fwd"][1024]["winner"] == str(win)
    assert res["bwd"][4096]["winner"] == "64x4x1x2"
    fp = causal_op.fingerprint
    assert tune_store.lookup(fp, 0, BF16, 128, "fwd", 1024, "sm90") == (win.config(), 1024)
    assert tune_store.lookup(fp, 0, BF16, 128, "fwd", 1024) is None  # sm80's forward was not tuned
    assert tune_store.lookup(fp, 0, BF16, 128, "bwd", 1024)[0] == tiles.BwdTile(64, 4, 1, 2).config()
    dev = torch.device("cuda", 0)
    for n in (1024, 4096):  # the prebuilt winners of both families
        on90 = causal_op.instantiation(dev, BF16, 128, seqlen=n, family="sm90")
        on80 = causal_op.instantiation(dev, BF16, 128, seqlen=n, family="sm80")
        assert on90 in built and sm90.Sm90Tile.from_config(dict(on90.config)) == win
        assert on80 in built and str(tiles.from_config(dict(on80.config))[1]) == "64x4x1x2"
    # sm90 by name: its forward only; its backward is an error naming kinds
    assert tuner.tuning_families(causal_op, 0, BF16, 128, None, "sm90") == {"fwd": SM90}
    with pytest.raises(ValueError, match="kinds: family sm90 has no tunable bwd pass .*sm80"):
        tuner.tune_op(causal_op, "cuda:0", "bf16", 128, [1024], kinds=["bwd"], family="sm90")
    with pytest.raises(ValueError, match="family: cpu has no tunable tiles"):
        tuner.tune_op(causal_op, "cuda:0", "bf16", 128, [1024], family="cpu")
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_80")
    with pytest.raises(ValueError, match=r"family: sm90 does not run on this GPU \(sm_80\)"):
        tuner.tune_op(causal_op, "cuda:0", "bf16", 128, [1024], family="sm90")
    assert tuner.tuning_families(causal_op, 0, BF16, 128) == {"fwd": families.get("sm80"),
                                                              "bwd": families.get("sm80")}


def test_first_use_tuning_per_family(store, hopper, causal_op, monkeypatch):
    """The op asks for the family whose library it chooses: sm90 tunes its forward, sm80 on
    Hopper only the backward (the forward runs on sm90); each once per key. (d 96: a head dim
    whose backward sm90 does not serve.)"""
    calls = []

    def fake(op, device, dtype, head_dim, seqlens, kinds=None, progress=True, family=None, **kw):
        calls.append((family, tuple(kinds)))
        for kind in kinds:
            cfg = WINNER.config() if family == "sm90" else tiles.BwdTile(64, 4, 1, 2).config()
            tune_store.record(op.fingerprint, device.index, dtype, head_dim, kind, seqlens[0], cfg, family=family)
        return {k: {seqlens[0]: {"winner": "x"}} for k in kinds}

    monkeypatch.setattr(tuner, "tune_op", fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(loader, "load", lambda inst, announce=None: FakeLib(inst))
    monkeypatch.setenv("FLASHGEN_AUTOTUNE", "1")
    monkeypatch.setenv("FLASHGEN_QUIET", "1")
    dev = torch.device("cuda", 0)
    lib = causal_op.library(SM90, dev, BF16, 96, seqlen=3000)
    assert calls == [("sm90", ("fwd",))]
    assert sm90.Sm90Tile.from_config(dict(lib.instantiation.config)) == WINNER
    causal_op.library(families.get("sm80"), dev, BF16, 96, seqlen=3000)
    assert calls[-1] == ("sm80", ("bwd",)) and len(calls) == 2
    causal_op.library(SM90, dev, BF16, 96, seqlen=5000)  # the same bucket, stored: no tuning
    assert len(calls) == 2
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "128x64x4")  # sm80's override: sm90 is tuned anyway
    tuner.ensure_tuned(causal_op, dev, BF16, 96, 20000, family=SM90)
    assert calls[-1] == ("sm90", ("fwd",))


# ---------------------------------------------------------------- the command line


def test_cli_tune_family_errors(store, hopper, monkeypatch, capsys):
    spec = str(SPECS / "causal.attn")
    assert cli.main(["tune", spec, "--family", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--family cpu: family cpu has no tunable pass" in err and "sm90 sm80" in err
    assert cli.main(["tune", spec, "--family", "sm90", "--kinds", "bwd"]) == 2
    assert "--kinds: family sm90 has no tunable bwd pass" in capsys.readouterr().err
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_86")
    assert cli.main(["tune", spec, "--family", "sm90"]) == 2
    assert "--family sm90: sm90 does not run on this GPU (sm_86)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", spec, "--family", "sm70"])
    assert e.value.code == 2 and "argument --family: invalid choice: 'sm70'" in capsys.readouterr().err
    # the other commands' --family still forces a family
    assert cli.main(["explain", spec, "--seqlen", "256", "--head-dim", "64", "--arch", "sm_90a", "--family",
                     "sm80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "sm80"
