"""Tile choice (flashgen/tiles.py): the paper's derived sizes, the per-arch tables, legality, the
resource formulas, and that every CUDA instantiation names its tiles."""

import math

import pytest

import flashgen
from flashgen import families, tiles
from flashgen.lang import frontend, ir

SM80 = families.get("sm80")

CAUSAL = "attention c { mask = causal }"
SOFTCAP = "attention s { param cap: float\n mask = causal\n score = cap * tanh(score / cap) }"


@pytest.mark.parametrize("smem, d", [(232448, 64), (232448, 128), (101376, 128), (166912, 256), (49152, 32)])
def test_paper_tiles_follow_algorithm_1(smem, d):
    """Bc = ceil(M / 4d), Br = min(Bc, d), M in elements of the 2-byte input dtype."""
    m = smem // 2
    bc = -(-m // (4 * d))
    assert tiles.paper_tiles(smem, d) == (min(bc, d), bc)
    # by hand for the H200 (227 KB opt-in) at d = 128: 116224 / 512 = 227
    assert tiles.paper_tiles(232448, 128) == (128, 227)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"])
@pytest.mark.parametrize("d", [8, 32, 64, 72, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("score_mod", [False, True])
def test_derived_tiles_are_legal_and_fit(arch, d, score_mod):
    info = tiles.arch_info(arch)
    f, b = tiles.derived(info, d, score_mod)
    br, bc = tiles.paper_tiles(info.smem_optin, d)
    assert f.legal() and b.legal()
    assert f.smem_bytes(d) <= info.smem_optin and b.smem_bytes(d) <= info.smem_optin
    assert f.regs_estimate(d, score_mod) <= tiles.REG_LIMIT and b.regs_estimate(d, score_mod) <= tiles.REG_LIMIT
    assert f.block_n <= max(16, bc) and f.block_m <= max(64, br)
    # the largest legal forward key tile under those caps (nothing bigger would also fit)
    bigger = tiles.FwdTile(f.block_m, f.block_n + 16, f.warps)
    assert (bigger.block_n > min(bc, 256) or bigger.smem_bytes(d) > info.smem_optin
            or bigger.regs_estimate(d, score_mod) > tiles.REG_LIMIT)


def test_smem_formulas_by_hand():
    # forward: (Br + 2 stages x (K + V) x Bc) rows of pitch round16(d) + 8, 2 bytes each
    assert tiles.FwdTile(128, 64, 4).smem_bytes(128) == (128 + 4 * 64) * 136 * 2 == 104448
    assert tiles.FwdTile(128, 64, 4).smem_bytes(72) == (128 + 256) * 88 * 2
    # backward: K, V (Bn rows), Q and dO rings (2 x Bm each), dS^T (Bn x (Bm + 8)), LSE/D rings
    b = tiles.BwdTile(64, 8, 1, 2)
    assert b.block_n == 128
    assert b.smem_bytes(64) == (2 * 128 * 72 + 4 * 64 * 72 + 128 * 72) * 2 + 16 * 64


def test_legality_matches_the_kernels_static_asserts():
    assert tiles.FwdTile(128, 64, 4).legal() and tiles.FwdTile(64, 32, 4).legal()
    assert not tiles.FwdTile(128, 64, 2).legal()  # 64 rows per warp
    assert not tiles.FwdTile(128, 60, 4).legal() and not tiles.FwdTile(128, 272, 4).legal()
    assert tiles.BwdTile(64, 8, 1, 2).legal() and tiles.BwdTile(32, 8, 2, 2).legal()
    assert not tiles.BwdTile(64, 4, 1, 1).legal()  # 64 dQ rows for one warp
    assert not tiles.BwdTile(64, 8, 3, 1).legal()


def test_tables_hold_the_measured_defaults():
    """The H200-measured tiles (docs/perf-notes.md) per head dim and mask class."""
    f = lambda arch, cls, d: str(tiles.table(arch, cls, d)[0])  # noqa: E731
    assert [f("sm_90a", "plain", d) for d in (64, 96, 128, 192, 256)] == \
        ["128x64x4", "128x32x4", "128x64x4", "64x64x4", "64x32x4"]
    assert f("sm_80", "plain", 128) == "128x48x4" and f("sm_80", "score_mod", 128) == "128x32x4"
    assert [f("sm_90a", "score_mod", d) for d in (32, 64, 96, 128)] == ["128x64x4", "128x32x4", "64x64x4", "128x64x4"]
    b = lambda cls, d: str(tiles.table("sm_90a", cls, d)[1])  # noqa: E731
    assert b("plain", 128) == "64x8x1x2" and b("score_mod", 128) == "32x8x1x2" and b("plain", 256) == "32x8x2x2"
    # no table for Blackwell yet: derived tiles; a 99 KB part cannot take the d = 256 rows
    assert tiles.table("sm_100", "plain", 128) == (None, None)
    assert tiles.table("sm_86", "plain", 256)[0] is None or \
        tiles.table("sm_86", "plain", 256)[0].smem_bytes(256) <= 101376


def test_default_choice_origins():
    spec = frontend.parse(CAUSAL)
    c = tiles.default_choice(spec, "sm_90a", 128)
    assert (c.fwd_origin, c.bwd_origin) == ("table", "table") and str(c.fwd) == "128x64x4"
    c = tiles.default_choice(spec, "sm_120", 128)
    assert (c.fwd_origin, c.bwd_origin) == ("derived", "derived")
    assert (c.fwd, c.bwd) == tiles.derived("sm_120", 128)
    assert set(c.config()) == set(tiles.TILE_KEYS)


def test_environment_override_wins(monkeypatch):
    spec = frontend.parse(CAUSAL)
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "64x32x4")
    c = tiles.choose(spec, "sm_90a", ir.DType.BF16, 64)
    assert str(c.fwd) == "64x32x4" and c.fwd_origin == "env" and c.bwd_origin == "table"


def test_tile_legality_is_the_tile_rules_not_the_environment_parser(monkeypatch):
    """env.py only parses FLASHGEN_CUDA_*_TILE (ints joined by 'x'); whether the tile is legal is
    FwdTile.legal / BwdTile.legal's, raised from tiles naming the variable and the rule."""
    import inspect

    from flashgen import env

    spec = frontend.parse(CAUSAL)
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "128x60x4")  # parses; BN is not a multiple of 16
    assert env.cuda_fwd_tile() == (("fwd_block_m", 128), ("fwd_block_n", 60), ("fwd_warps", 4))
    assert not tiles.FwdTile(128, 60, 4).legal()
    with pytest.raises(ValueError, match=r"FLASHGEN_CUDA_FWD_TILE: '128x60x4' is not a valid tile \(BM/W must be"):
        tiles.choose(spec, "sm_90a", ir.DType.BF16, 64)
    monkeypatch.delenv("FLASHGEN_CUDA_FWD_TILE")
    monkeypatch.setenv("FLASHGEN_CUDA_BWD_TILE", "64x8x3x1")
    assert dict(env.cuda_bwd_tile())["bwd_warps_d"] == 3
    with pytest.raises(ValueError, match=r"FLASHGEN_CUDA_BWD_TILE: '64x8x3x1' is not a valid tile \(BM a multiple"):
        tiles.forced("bwd")
    monkeypatch.setenv("FLASHGEN_CUDA_BWD_TILE", "64x8x1x2")
    assert tiles.forced("bwd") == tiles.BwdTile(64, 8, 1, 2) and tiles.forced("fwd") is None
    monkeypatch.setenv("FLASHGEN_CUDA_BWD_TILE", "64x8")
    with pytest.raises(ValueError, match="FLASHGEN_CUDA_BWD_TILE: expected BMxWxWDxWQ"):
        env.cuda_bwd_tile()
    src = inspect.getsource(env)
    assert "lambda" not in src and "% 16" not in src and "valid tile" not in src


def test_every_cuda_instantiation_names_its_tiles():
    spec = frontend.parse(SOFTCAP)
    for arch, want in (("sm_90a", "FwdTile<128, 64, 4>"), ("sm_80", "FwdTile<128, 32, 4>"),
                       ("any", "FwdTile<128, 64, 4>")):
        inst = SM80.instantiation(spec, arch, ir.DType.BF16, 128)
        assert set(tiles.TILE_KEYS) <= set(dict(inst.config))
        assert want in inst.sources()[inst.source_name("fwd")]
    # config order does not make a different artifact
    a = SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 64, packed=True, sparse=True)
    b = SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 64, sparse=True, packed=True)
    assert a == b and a.key == b.key
    # one-pass candidates compile one translation unit
    fo = SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 64, extra={"fwd_only": 1})
    assert fo.kinds == ("fwd",) and list(fo.sources()) == [fo.source_name("fwd")]


def test_arch_names():
    assert tiles.normalize_arch("90") == "sm_90a" and tiles.normalize_arch("sm_80") == "sm_80"
    assert tiles.arch_info("sm_90").smem_optin == 232448
    assert tiles.arch_info("sm_103").name.startswith("unknown sm_103")
    for bad in ("sm_75", "hopper", "sm_9"):
        with pytest.raises(ValueError, match="arch"):
            tiles.normalize_arch(bad)
    assert math.isclose(tiles.arch_info("sm_90a").peak_tflops, 989.4)


def test_op_tiles_by_arch_and_its_errors(causal_op):
    import torch

    # sm_90a: the forward runs on sm90 (its tile), the backward on sm80 (the table's)
    c = causal_op.tiles(None, torch.bfloat16, 128, arch="sm_90a")
    assert (c.fwd_family, str(c.fwd), c.fwd_origin) == ("sm90", "128x2x1x0x4096x2", "family default")
    assert (c.bwd_family, c.bwd_origin) == ("sm80", "table") and c.config() == c.bwd.config() | c.dq.config()
    with flashgen.use_family("sm80"):
        c = causal_op.tiles(None, torch.bfloat16, 128, arch="sm_90a")
        assert (c.fwd_family, str(c.fwd), c.fwd_origin) == ("sm80", "128x64x4", "table")
    assert causal_op.tiles(None, "bf16", 128, arch="sm_80").fwd_family == "sm80"
    assert causal_op.tiles(None, "fp16", 64, arch="sm_120").fwd_origin == "derived"
    with pytest.raises(ValueError, match="head_dim: 300"):
        causal_op.tiles(None, "bf16", 300, arch="sm_90a")
    with pytest.raises(ValueError, match="dtype: fp32"):
        causal_op.tiles(None, torch.float32, 64, arch="sm_90a")
    with pytest.raises(ValueError, match="arch"):
        causal_op.tiles(None, "bf16", 64, arch="sm_75")
    with pytest.raises(ValueError, match="device: None needs arch="):
        causal_op.tiles(None, "bf16", 64)
    with pytest.raises(ValueError, match="device: the tiles are the CUDA kernels'"):
        causal_op.tiles("cpu", "bf16", 64)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: CUDA is not available"):
            causal_op.tiles("cuda", "bf16", 64)
    with pytest.raises(ValueError, match="head_dim"):
        tiles.choose(causal_op.spec, "sm_90a", ir.DType.BF16, 300)


def test_cuda_builds_need_a_cuda_torch(tmp_path, monkeypatch):
    """A CPU-only torch cannot compile CUDA kernels: a clear BuildError before anything is
    written (not cpp_extension's CUDA_HOME message)."""
    import torch

    from flashgen.errors import BuildError
    from flashgen.tools import aot_build

    monkeypatch.setattr(torch.version, "cuda", None)
    out = tmp_path / "aot"
    with pytest.raises(BuildError, match="CPU-only"):
        aot_build.build_dir([frontend.parse(CAUSAL)], out, arches=["sm_90a"], dtypes=["bf16"], head_dims=[64])
    assert not out.exists()
