"""`flashgen explain` (flashgen/explain/): FLOPs, predicted bytes and tiles against hand counts.

The hand counts here are written out independently of the module (plain loops and arithmetic
over the tile boundaries), on the CPU; the GPU tests run --measure on a live device.
"""

import json
import math
import resource
import stat
import time
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import cli, families, imports, reference, tiles
from flashgen.families import sm90
from flashgen.families.sm90 import smem_bytes as sm90_smem
from flashgen import explain as ex
from flashgen.build import artifact
from flashgen.lang import ir
from flashgen.tune import resources

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
TOP_LEFT = "attention causal_tl {\n    mask = causal_top_left\n}\n"


@pytest.fixture(autouse=True)
def _no_tile_overrides(monkeypatch):
    """Tile overrides from the environment would change the tiles these tests count with."""
    monkeypatch.delenv("FLASHGEN_CUDA_FWD_TILE", raising=False)
    monkeypatch.delenv("FLASHGEN_CUDA_BWD_TILE", raising=False)
    monkeypatch.delenv("FLASHGEN_AOT_DIR", raising=False)


@pytest.fixture(autouse=True)
def _no_gpu_unless_marked(request, monkeypatch):
    """The CPU tests describe a machine without a GPU (so --arch always means the tables, never a
    live device of that architecture with its own tuned tiles and name)."""
    if "gpu" not in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------- FLOPs


def test_dense_flops_exact():
    B, H, nq, nk, d = 3, 4, 300, 200, 64
    rep = ex.explain(SPECS / "dense.attn", nq, nk, head_dim=d, batch=B, heads=H, arch="sm_90a")
    assert rep.flops == 4 * B * H * nq * nk * d
    assert isinstance(rep.flops, int)
    assert rep.visible_pairs == nq * nk and rep.density == 1.0
    both = ex.explain(SPECS / "dense.attn", nq, nk, head_dim=d, batch=B, heads=H, arch="sm_90a", backward=True)
    assert both.fwd.flops == rep.flops
    assert both.bwd.flops * 2 == 5 * rep.flops  # 2.5 × the forward
    assert both.flops == both.fwd.flops + both.bwd.flops and both.direction == "fwd+bwd"


def hand_causal(nq, nk, top_left=False):
    off = 0 if top_left else nk - nq
    count = 0
    for i in range(nq):
        for j in range(nk):
            if j <= i + off:
                count += 1
    return count


@pytest.mark.parametrize("nq,nk", [(100, 100), (70, 130), (130, 70), (1, 50), (50, 1)])
def test_causal_flops_hand_count(nq, nk):
    B, H, d = 2, 3, 32
    rep = ex.explain(SPECS / "causal.attn", nq, nk, head_dim=d, batch=B, heads=H, arch="sm_80")
    assert rep.flops == 4 * B * H * d * hand_causal(nq, nk)
    tl = ex.explain(TOP_LEFT, nq, nk, head_dim=d, batch=B, heads=H, arch="sm_80")
    assert tl.flops == 4 * B * H * d * hand_causal(nq, nk, top_left=True)


def test_causal_flops_arithmetic_series():
    # Nq = Nk = N: N (N + 1) / 2 pairs per head
    n, d = 1000, 64
    rep = ex.explain(SPECS / "causal.attn", n, head_dim=d, arch="sm_90a")
    assert rep.flops == 4 * d * n * (n + 1) // 2


@pytest.mark.parametrize("nq,nk,w", [(100, 100, 17), (60, 140, 25), (140, 60, 9), (80, 80, 500)])
def test_sliding_window_flops_hand_count(nq, nk, w):
    off = nk - nq
    count = sum(1 for i in range(nq) for j in range(nk) if i + off - w < j <= i + off)
    for params in ({"window": w}, [f"window={w}"]):  # a dict, or the --param syntax
        rep = ex.explain(SPECS / "sliding_window.attn", nq, nk, head_dim=64, heads=2, arch="sm_90a", params=params)
        assert rep.flops == 4 * 2 * 64 * count
        assert rep.params == {"window": w}


def test_per_batch_mask_flops():
    # key padding with given lengths: batch 0 sees 5 keys, batch 1 sees 50
    kv_len = torch.tensor([5, 50], dtype=torch.int32)
    rep = ex.explain(SPECS / "key_padding.attn", 40, 64, head_dim=16, batch=2, heads=3, arch="sm_90a",
                     params={"kv_len": kv_len})
    assert rep.flops == 4 * 16 * 3 * 40 * (5 + 50)


# ---------------------------------------------------------------- bytes


@pytest.fixture
def sm80():
    """Explain the sm80 family's model at sm_90a (where the sm90 family would take the forward)."""
    with flashgen.use_family("sm80"):
        yield


def test_dense_hbm_bytes_table_tile(sm80):
    # sm_90a, d = 128, bf16: the table's forward tile is 128 queries x 64 keys, so every
    # (batch, head) reads K and V once per query tile: ceil(1000 / 128) = 8 times.
    B, H, nq, nk, d, e = 2, 3, 1000, 777, 128, 2
    rep = ex.explain(SPECS / "dense.attn", nq, nk, head_dim=d, batch=B, heads=H, arch="sm_90a")
    fwd = rep.tiles["fwd"]
    assert (fwd.block_m, fwd.block_n, fwd.warps, fwd.origin) == (128, 64, 4, "table")
    assert fwd.smem_bytes == (128 + 4 * 64) * (128 + 8) * 2
    per_head = nq * d * e + 8 * nk * d * e * 2 + nq * d * e + nq * 4  # Q, K+V, O, LSE
    assert rep.hbm_bytes == B * H * per_head
    assert rep.compulsory_bytes == B * H * (2 * nq * d * e + 2 * nk * d * e + 4 * nq)
    assert rep.fwd.terms["K, V reads"] == B * H * 8 * nk * d * e * 2


@pytest.mark.parametrize("nq,nk,kv_rows,q_rows", [
    # sm_90a, d = 64 → 128 x 64 tiles; query tile i loads keys [0, min(q_hi + Nk - Nq, Nk)).
    (300, 300, 128 + 256 + 300, 300),
    (200, 300, (128 + 100) + 300, 200),
    (300, 200, 28 + 156 + 200, 300),
    (300, 100, 0 + 56 + 100, 128 + 44),  # the first query tile sees no key: no Q, K, V loads
])
def test_causal_hbm_bytes_tile_granularity(nq, nk, kv_rows, q_rows, sm80):
    d, e = 64, 2
    rep = ex.explain(SPECS / "causal.attn", nq, nk, head_dim=d, arch="sm_90a")
    assert (rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n) == (128, 64)
    assert rep.fwd.terms["K, V reads"] == kv_rows * d * e * 2
    assert rep.fwd.terms["Q read"] == q_rows * d * e
    assert rep.hbm_bytes == (kv_rows * 2 + q_rows + nq) * d * e + nq * 4


def test_causal_hbm_bytes_gqa_counts_kv_per_query_head():
    B, H, Hkv, n, d, e = 2, 8, 2, 256, 64, 2
    rep = ex.explain(SPECS / "causal.attn", n, head_dim=d, batch=B, heads=H, kv_heads=Hkv, arch="sm_90a")
    kv_rows = 192 + 256  # two query tiles of 192 rows (three consumer warpgroups at d 64)
    assert rep.fwd.terms["K, V reads"] == B * H * kv_rows * d * e * 2
    assert rep.compulsory_bytes == B * (2 * H * n + 2 * Hkv * n) * d * e + B * H * n * 4


def test_standard_hbm_bytes_formula():
    B, H, nq, nk, d, e = 2, 3, 100, 60, 32, 2
    for hkv in (3, 1):  # standard attention expands K/V per query head
        rep = ex.explain(SPECS / "causal.attn", nq, nk, head_dim=d, batch=B, heads=H, kv_heads=hkv, arch="sm_80",
                         backward=True)
        assert rep.fwd.standard_hbm_bytes == B * H * e * (2 * nq * d + 2 * nk * d + 4 * nq * nk)
        assert rep.bwd.standard_hbm_bytes == B * H * e * (4 * nq * d + 4 * nk * d + 7 * nq * nk)
        assert rep.standard_hbm_bytes == rep.fwd.standard_hbm_bytes + rep.bwd.standard_hbm_bytes
    fp16 = ex.explain(SPECS / "dense.attn", nq, nk, head_dim=d, arch="sm_80", dtype="fp16")
    assert fp16.standard_hbm_bytes == 2 * (2 * nq * d + 2 * nk * d + 4 * nq * nk)


def test_dense_backward_bytes_hand_count():
    # sm_90a, d = 64: backward tile 64 queries x 128 keys on sm80 (the table's 64x8x1x2), 128 x
    # 128 on sm90 (its family default for a spec without score expression: two consumer
    # warpgroups of 64 keys, each adding the dQ of its 64 of the 128 rows over all 128 keys, one
    # partial per row). N = 256: 2 key tiles, each visited by query tiles of 512 rows in all
    # (4 of 64 rows, or 2 of 128); 1 batch, 1 head, no GQA split.
    n, d, e = 256, 64, 2
    for fam, origin, bm, dq_adds in (("sm80", "table", 64, 1), ("sm90", "family default", 128, 1)):
        with flashgen.use_family(fam):
            rep = ex.explain(SPECS / "dense.attn", n, head_dim=d, arch="sm_90a", backward=True)
        bwd = rep.tiles["bwd"]
        assert (bwd.block_m, bwd.block_n, bwd.origin) == (bm, 128, origin)
        visited_rows = 2 * 4 * 64
        want = (2 * e * d * n + 4 * n + 4 * d * n  # preprocess: O, dO; D; zero dq_accum
                + 2 * e * d * n  # K, V once per key tile
                + visited_rows * (2 * e * d + 2 * 4 + 2 * 4 * d * dq_adds)  # Q, dO; LSE, D; dQ atomics
                + 2 * e * d * n  # dK, dV
                + (4 + e) * d * n  # convert
                + 4 * d * n)  # torch.zeros of dq_accum
        assert rep.bwd.hbm_bytes == want, fam
        assert rep.bwd.compulsory_bytes == 8 * n * d * e + 4 * n


def test_document_mask_counts_occupied_tiles(sm80):
    # No closed-form key range: the CUDA kernel visits the key tiles that keep any pair of the
    # query tile (block lists) and loads each whole (clipped to Nk). Counted here by brute force.
    op = flashgen.compile(SPECS / "document.attn")
    B, H, n, d, e = 2, 2, 200, 64, 2
    doc = torch.tensor([[0] * 70 + [1] * 100 + [2] * 30, [0] * 150 + [1] * 50], dtype=torch.int32)
    rep = ex.explain(op, n, head_dim=d, batch=B, heads=H, arch="sm_90a", params={"document_id": doc})
    keep = reference.keep_mask(op.spec, n, n, batch=B, heads=H, document_id=doc).expand(B, H, n, n)
    bm, bn = rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n
    kv_rows = pairs = 0
    for b in range(B):
        for h in range(H):
            pairs += int(keep[b, h].sum())
            for i in range(0, n, bm):
                for j in range(0, n, bn):
                    if keep[b, h, i:i + bm, j:j + bn].any():
                        kv_rows += min(bn, n - j)
    assert rep.flops == 4 * d * pairs
    assert rep.fwd.terms["K, V reads"] == kv_rows * d * e * 2
    assert "block lists" in rep.model


# ---------------------------------------------------------------- targets, tiles, errors


def test_arch_from_tables_without_gpu(sm80):
    rep = ex.explain(SPECS / "causal.attn", 4096, head_dim=128, batch=2, heads=16, arch="90")
    info = tiles.ARCHS["sm_90a"]
    assert (rep.family, rep.device, rep.arch, rep.gpu) == ("sm80", "cuda", "sm_90a", info.name)
    assert (rep.peak_tflops, rep.hbm_gbps) == (info.peak_tflops, info.hbm_gbps)
    t_c, t_m = rep.flops / (info.peak_tflops * 1e12) * 1e3, rep.hbm_bytes / (info.hbm_gbps * 1e9) * 1e3
    assert rep.floor_ms == pytest.approx(max(t_c, t_m))
    assert rep.bound == ("compute" if t_c >= t_m else "memory")
    assert rep.arithmetic_intensity == pytest.approx(rep.flops / rep.hbm_bytes)
    assert rep.compulsory_floor_ms <= rep.floor_ms
    df, db = tiles.derived(info, 128)
    assert rep.reference_tiles["derived_fwd"] == str(df) and rep.reference_tiles["derived_bwd"] == str(db)
    assert tuple(rep.reference_tiles["paper_br_bc"]) == tiles.paper_tiles(info.smem_optin, 128)
    assert rep.tiles["fwd"].regs_source.startswith("estimate")
    assert rep.tiles["fwd"].regs == tiles.FwdTile(128, 64, 4).regs_estimate(128)
    assert rep.measured_ms is None and rep.fraction_of_floor is None


def test_env_tile_override_shows_as_origin(monkeypatch, sm80):
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "64x32x4")
    rep = ex.explain(SPECS / "dense.attn", 512, head_dim=64, arch="sm_90a")
    fwd = rep.tiles["fwd"]
    assert (fwd.block_m, fwd.block_n, fwd.origin) == (64, 32, "env")
    assert rep.fwd.terms["K, V reads"] == 8 * 512 * 64 * 2 * 2  # 512 / 64 query tiles


def test_registers_from_cached_library(tmp_path, monkeypatch, sm80):
    # A cache entry for exactly the instantiation explain describes, and a stand-in cuobjdump.
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    op = flashgen.compile(SPECS / "causal.attn")
    choice = tiles.choose(op.spec, "sm_90a", ir.DType.BF16, 64, 1024)
    inst = artifact.Instantiation(op.spec, families.get("sm80").target("sm_90a"), ir.DType.BF16, 64,
                               tuple(choice.config().items()))
    entry = tmp_path / "cache" / inst.name
    entry.mkdir(parents=True)
    (entry / "lib.so").write_bytes(b"")
    fake = tmp_path / "bin" / "cuobjdump"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncat <<'EOF'\nResource usage:\n Common:\n  GLOBAL:0\n"
                    " Function _ZN8flashgen4cuda10fwd_kernelINS0_9FwdKernelIN12_GLOBAL__N_1EEEEEvT_:\n"
                    "  REG:168 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
                    " Function _ZN8flashgen4cuda10bwd_kernelINS0_9BwdKernelIN12_GLOBAL__N_1EEEEEvT_:\n"
                    "  REG:230 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
                    " Function _ZN8flashgen4cuda21bwd_preprocess_kernelI13__nv_bfloat16Li64EEEvT_:\n"
                    "  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:400 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
                    "EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(resources, "find_cuobjdump", lambda: str(fake))
    rep = ex.explain(op, 1024, head_dim=64, arch="sm_90a")
    assert rep.tiles["fwd"].regs == 168 and rep.tiles["fwd"].regs_source.startswith("ptxas")
    assert rep.tiles["bwd"].regs == 230


def test_bad_arch_errors_name_the_argument(capsys):
    for bad in ("sm_75", "volta", "sm_9"):
        with pytest.raises(ValueError, match="^arch:"):
            ex.explain(SPECS / "dense.attn", 128, head_dim=64, arch=bad)
        rc = cli.main(["explain", str(SPECS / "dense.attn"), "--seqlen", "128", "--head-dim", "64", "--arch", bad])
        assert rc == 2
        assert "--arch:" in capsys.readouterr().err


def test_other_errors_name_the_argument(capsys):
    cases = [
        (["--head-dim", "60", "--arch", "sm_90a"], "--head-dim:"),  # CUDA head dims are multiples of 8
        (["--head-dim", "64", "--arch", "sm_90a", "--dtype", "fp32"], "--dtype:"),  # fp32 is CPU only
        (["--head-dim", "64", "--kv-heads", "3", "--heads", "4", "--arch", "sm_80"], "--kv-heads:"),
        (["--head-dim", "64", "--seqlen-k", "0", "--arch", "sm_80"], "--seqlen-k:"),
        (["--head-dim", "64", "--arch", "sm_80", "--device", "cpu"], "--device:"),
        (["--head-dim", "64", "--arch", "sm_80", "--param", "window=3"], "--param"),
    ]
    for extra, want in cases:
        rc = cli.main(["explain", str(SPECS / "dense.attn"), "--seqlen", "128", *extra])
        assert rc == 2, extra
        assert want in capsys.readouterr().err, extra
    if not torch.cuda.is_available():
        rc = cli.main(["explain", str(SPECS / "dense.attn"), "--seqlen", "128", "--head-dim", "64", "--arch",
                       "sm_90a", "--measure"])
        assert rc == 2 and "--measure:" in capsys.readouterr().err


def test_cli_json_is_one_object(capsys):
    rc = cli.main(["explain", str(SPECS / "sliding_window.attn"), "--seqlen", "512", "--head-dim", "64", "--batch", "2",
                   "--heads", "4", "--kv-heads", "2", "--arch", "sm_90a", "--param", "window=100", "--backward",
                   "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    d = json.loads(out)  # the whole of stdout is one JSON object
    for key in ("flops", "hbm_bytes", "standard_hbm_bytes", "compulsory_bytes", "tiles", "arch", "gpu", "peak_tflops",
                "hbm_gbps", "arithmetic_intensity", "floor_ms", "bound", "measured_ms", "tflops", "fraction_of_floor"):
        assert key in d, key
    for kind in ("fwd", "bwd"):
        for key in ("block_m", "block_n", "warps", "origin", "smem_bytes", "regs", "regs_source"):
            assert key in d["tiles"][kind], (kind, key)
    assert d["arch"] == "sm_90a" and d["bound"] in ("compute", "memory")
    assert d["flops"] == 14 * 2 * 4 * 64 * sum(min(i + 1, 100) for i in range(512))  # (1 + 2.5) · 4 · B·H·d·pairs
    assert d["hbm_bytes"] == d["fwd"]["hbm_bytes"] + d["bwd"]["hbm_bytes"]


def test_cli_readable_report(capsys):
    rc = cli.main(["explain", str(SPECS / "causal.attn"), "--seqlen", "2048", "--head-dim", "128", "--arch", "sm_80",
                   "--backward"])
    assert rc == 0
    out = capsys.readouterr().out
    for text in ("tiles", "forward", "backward", "standard", "roofline", "A100"):
        assert text in out, text


def test_cpu_family_without_gpu_or_arch():
    rep = ex.explain(SPECS / "causal.attn", 1024, head_dim=64, batch=2, heads=4)
    assert (rep.family, rep.device) == ("cpu", "cpu") and rep.gpu.startswith("CPU")
    assert rep.tiles["fwd"].origin == "derived (L2 cache)" and rep.tiles["fwd"].warps is None
    assert rep.tiles["fwd"].smem_bytes is None and rep.tiles["fwd"].regs is None
    (qb, kvb), (bqb, bkvb) = ex.cpu_tiles(SPECS / "causal.attn", 1024, head_dim=64, batch=2, heads=4)
    assert (rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n) == (qb, kvb)
    assert (rep.tiles["bwd"].block_m, rep.tiles["bwd"].block_n) == (bqb, bkvb)
    assert rep.l2_bytes == ex.cpu_l2_bytes() and rep.threads == torch.get_num_threads()
    assert rep.peak_tflops > 0 and rep.hbm_gbps > 0 and "measured" in rep.peaks_source
    assert rep.flops == 4 * 2 * 4 * 64 * 1024 * 1025 // 2
    d = json.loads(ex.to_json(rep))
    assert d["tiles"]["fwd"]["origin"] == "derived (L2 cache)"


def test_cpu_tiles_hand_derived():
    # L2 = 512 KiB, d = 64: kvb = 512 (2·512·64·4 B fits), qb_max = 512 KiB / (4·512) = 256.
    # Dense Nq = 1024, one (batch, head): one thread → every candidate costs the same work, the
    # largest tile wins (256); 8 threads → 4 tasks of 256 rows leave 4 threads idle, 8 of 128
    # halve the makespan, 16 of 64 do not improve it further and pay more per tile → 128.
    l2 = 512 << 10
    assert ex.cpu_tiles(SPECS / "dense.attn", 1024, head_dim=64, l2_bytes=l2, threads=1)[0] == (256, 512)
    assert ex.cpu_tiles(SPECS / "dense.attn", 1024, head_dim=64, l2_bytes=l2, threads=8)[0] == (128, 512)
    # Backward: kvb 128 (5·128·64·4 B in half of L2), qb_max 128; equal work → the largest, 128.
    assert ex.cpu_tiles(SPECS / "dense.attn", 1024, head_dim=64, l2_bytes=l2, threads=8)[1] == (128, 128)
    # Short keys: kvb is capped by Nk rounded up to 8; a short query side by Nq.
    assert ex.cpu_tiles(SPECS / "dense.attn", 20, 30, head_dim=64, l2_bytes=l2, threads=1) == ((20, 32), (20, 32))
    # Larger d shrinks the key tile: 2·kvb·256·4 ≤ 512 KiB → kvb = 256.
    assert ex.cpu_tiles(SPECS / "dense.attn", 4096, head_dim=256, l2_bytes=l2, threads=1)[0][1] == 256


def test_cpu_l2_bytes_in_the_kernels_range():
    l2 = ex.cpu_l2_bytes()
    assert (256 << 10) <= l2 <= (8 << 20)


def test_long_causal_is_fast_and_small():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    rep = ex.explain(SPECS / "causal.attn", 65536, head_dim=128, batch=1, heads=16, arch="sm_90a", backward=True)
    took = time.perf_counter() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss is KiB on Linux
    assert took < 2.0, took
    assert grown_mib < 512, grown_mib  # an N × N bool mask alone would be 4 GiB
    n = 65536
    assert rep.flops == 14 * 16 * 128 * n * (n + 1) // 2  # (1 + 2.5) · 4 · H·d·pairs
    # 512 query tiles of 128 rows; tile i loads keys [0, 128 (i + 1))
    assert rep.fwd.terms["K, V reads"] == 16 * sum(128 * (i + 1) for i in range(512)) * 128 * 2 * 2


# ---------------------------------------------------------------- user-testing fixes


def test_mask_index_out_of_bounds_is_a_clean_error(capsys):
    # document_id is [batch, seqlen_k] and the mask indexes it with q: seqlen_q > seqlen_k reads
    # past its end. A clean error naming the option and the parameter, not an IndexError.
    with pytest.raises(ValueError, match="^seqlen_k: 2048 with seqlen_q = 4096: .*document_id"):
        ex.explain(SPECS / "document.attn", 4096, 2048, head_dim=64, arch="sm_90a")
    rc = cli.main(["explain", str(SPECS / "document.attn"), "--seqlen", "4096", "--seqlen-k", "2048",
                   "--head-dim", "64", "--arch", "sm_90a"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("flashgen: error: ValueError: --seqlen-k: 2048") and "document_id" in err
    # a given tensor of the wrong size: the parameter is to blame
    with pytest.raises(ValueError, match="^params: document_id: "):
        ex.explain(SPECS / "document.attn", 64, head_dim=64, arch="sm_90a",
                   params={"document_id": torch.zeros(1, 32, dtype=torch.int32)})


BIAS_CAUSAL = ("attention bias_causal {\n    param bias: f32[batch|1, heads|1, seqlen_q, seqlen_k]\n"
               "    mask = causal\n    score = score + bias[b, h, q, kv]\n}\n")


def test_bias_traffic_counted():
    # f32 bias [2, 4, 2048, 2048] (134 MB): read once per visited element by every (b, h), in
    # the compulsory bytes once, in standard attention's once; it does not change the pairs.
    B, H, n, d, e = 2, 4, 2048, 64, 2
    rep = ex.explain(SPECS / "bias.attn", n, head_dim=d, batch=B, heads=H, arch="sm_90a")
    dense = ex.explain(SPECS / "dense.attn", n, head_dim=d, batch=B, heads=H, arch="sm_90a")
    bias_bytes = 4 * B * H * n * n
    assert rep.params == {"bias": [B, H, n, n]}
    assert rep.flops == dense.flops and rep.visible_pairs == n * n
    assert rep.fwd.terms["tensor param bias: reads"] == bias_bytes
    assert rep.compulsory_bytes == B * H * (4 * n * d * e + 4 * n) + bias_bytes
    assert rep.fwd.compulsory_terms["tensor param bias: read once"] == bias_bytes
    assert rep.standard_hbm_bytes == dense.standard_hbm_bytes + bias_bytes
    assert rep.hbm_bytes == sum(rep.fwd.terms.values())
    assert rep.compulsory_bytes <= rep.hbm_bytes
    # backward: read again per visited element, the fp32 dbias zero-filled, atomics read + write
    both = ex.explain(SPECS / "bias.attn", n, head_dim=d, batch=B, heads=H, arch="sm_90a", backward=True)
    t = both.bwd.terms
    assert t["tensor param bias: reads"] == bias_bytes
    assert t["tensor param bias: gradient zero fill (torch.zeros)"] == bias_bytes
    assert t["tensor param bias: gradient atomics (read + write)"] == 2 * bias_bytes
    assert both.bwd.compulsory_terms["tensor param bias: gradient write"] == bias_bytes
    assert both.compulsory_bytes <= both.hbm_bytes


def test_broadcast_bias_is_reread_per_work_item():
    # A given [1, 1, N, N] bias: every (b, h) work item re-reads it; compulsory once.
    B, H, n = 3, 2, 256
    bias = torch.zeros(1, 1, n, n)
    rep = ex.explain(SPECS / "bias.attn", n, head_dim=64, batch=B, heads=H, arch="sm_90a", params={"bias": bias})
    assert rep.fwd.terms["tensor param bias: reads"] == 4 * B * H * n * n
    assert rep.fwd.compulsory_terms["tensor param bias: read once"] == 4 * n * n


def test_masked_bias_reads_visited_elements_hand_count():
    nq, nk, d = 300, 200, 64
    rep = ex.explain(BIAS_CAUSAL, nq, nk, head_dim=d, batch=2, heads=3, arch="sm_90a", backward=True)
    for kind, tr in (("fwd", rep.fwd), ("bwd", rep.bwd)):
        bm = rep.tiles[kind].block_m
        elems = 0
        for i0 in range(0, nq, bm):
            rows = min(bm, nq - i0)
            hi = min(i0 + rows - 1 + nk - nq, nk - 1) + 1  # the tile's last row keeps keys [0, hi)
            elems += rows * max(hi, 0)
        assert tr.terms["tensor param bias: reads"] == 2 * 3 * 4 * elems, kind
        # compulsory: its bytes scaled by the visited fraction (≤ the reads)
        assert tr.compulsory_terms["tensor param bias: read once"] == 4 * 2 * 3 * nq * nk * (2 * 3 * elems) // (
            2 * 3 * nq * nk)
    assert rep.compulsory_bytes <= rep.hbm_bytes
    assert rep.flops == 14 * 2 * 3 * d * hand_causal(nq, nk)  # the bias does not change the pairs


def test_small_params_read_once_and_gradients():
    # alibi: slopes f32[heads] read once per kernel; with the backward its gradient (atomics per
    # visited element). relative_bias's rel [heads, 2 m + 1] is indexed by kv - q: a table, once.
    H, n = 4, 256
    rep = ex.explain(SPECS / "alibi.attn", n, head_dim=64, heads=H, arch="sm_90a", backward=True)
    assert rep.fwd.terms["tensor param slopes: reads"] == 4 * H
    assert rep.bwd.terms["tensor param slopes: gradient zero fill (torch.zeros)"] == 4 * H
    assert rep.bwd.terms["tensor param slopes: gradient atomics (read + write)"] > 0
    assert rep.compulsory_bytes <= rep.hbm_bytes
    rel = ex.explain(SPECS / "relative_bias.attn", n, head_dim=64, heads=H, arch="sm_90a",
                     params=["max_distance=16"])
    assert rel.fwd.terms["tensor param rel: reads"] == 4 * H * 33
    assert rel.params["rel"] == [H, 33]


def test_score_only_params_are_not_materialised():
    # bias [1, 16, 16K, 16K] f32 is 17 GB: explain counts it from its shape alone.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    rep = ex.explain(SPECS / "bias.attn", 16384, head_dim=128, heads=16, arch="sm_90a")
    took = time.perf_counter() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert took < 1.0, took
    assert grown_mib < 256, grown_mib
    assert rep.params == {"bias": [1, 16, 16384, 16384]}
    assert rep.fwd.compulsory_terms["tensor param bias: read once"] == 4 * 16 * 16384 ** 2
    # a measurement gets real values (the mask's as predicted, the rest filled like example_params)
    spec = flashgen.compile(SPECS / "bias.attn").spec
    vals = ex.spec_params(spec, {}, 2, 3, 8, 8)
    assert vals["bias"].is_meta and list(vals["bias"].shape) == [2, 3, 8, 8]
    full = ex.materialize(spec, vals, {}, 2, 3, 8, 8)
    assert not full["bias"].is_meta and full["bias"].shape == (2, 3, 8, 8) and full["bias"].dtype == torch.float32
    assert torch.equal(ex.materialize(spec, vals, {"bias": 0.5}, 2, 3, 8, 8)["bias"], torch.full((2, 3, 8, 8), 0.5))


def test_compulsory_counts_only_keys_read_sliding_window():
    # window 4096 over Nk = 32768 keys for 512 queries (bottom-right): rows keep keys
    # (i + 28160, i + 32256], so the kernel reads keys [28161, 32768) only: 4607 of them.
    B, H, nq, nk, d, e, w = 1, 8, 512, 32768, 128, 2, 4096
    rep = ex.explain(SPECS / "sliding_window.attn", nq, nk, head_dim=d, heads=H, arch="sm_90a",
                     params=[f"window={w}"])
    assert rep.compulsory_bytes <= rep.hbm_bytes
    keys = nk - (nk - nq + 1 - w)  # 4607
    assert keys == 4607
    assert rep.compulsory_bytes == e * d * B * (2 * H * nq + 2 * H * keys) + 4 * B * H * nq == 20_983_808
    bm = rep.tiles["fwd"].block_m
    assert bm == 128
    per_tile = (bm - 1) + w  # the hull of 128 rows' windows
    assert rep.fwd.terms["K, V reads"] == H * (nq // bm) * per_tile * d * e * 2
    both = ex.explain(SPECS / "sliding_window.attn", nq, nk, head_dim=d, heads=H, arch="sm_90a",
                      params=[f"window={w}"], backward=True)
    assert both.bwd.compulsory_terms["K, V reads"] == 2 * e * d * H * keys
    assert both.compulsory_bytes <= both.hbm_bytes
    assert both.compulsory_floor_ms <= both.floor_ms


def test_compulsory_below_predicted_bytes_everywhere():
    cases = [(SPECS / "causal.attn", {}), (SPECS / "prefix_lm.attn", {}), (SPECS / "key_padding.attn", {}),
             (SPECS / "document.attn", {}), (SPECS / "gemma.attn", {"window": 20}), (BIAS_CAUSAL, {}),
             (SPECS / "sliding_window.attn", {"window": 7})]
    for spec, params in cases:
        for nq, nk, hkv in [(300, 100, 1), (100, 300, 2), (200, 200, 4)]:
            if "document" in str(spec) and nq != nk:
                continue
            rep = ex.explain(spec, nq, nk, head_dim=64, batch=2, heads=4, kv_heads=hkv, arch="sm_80",
                             params=params, backward=True)
            for tr in (rep.fwd, rep.bwd):
                assert tr.compulsory_bytes <= tr.hbm_bytes, (spec, nq, nk, hkv)
                assert tr.compulsory_bytes == sum(tr.compulsory_terms.values())


def test_compulsory_kv_union_per_kv_head_gqa_brute_force():
    # A per-head mask with GQA: the keys a kv head's K/V rows are read for is the union over its
    # group's query heads (and their query tiles), counted here by brute force from the keep mask.
    text = ("attention per_head {\n    param lens: i32[heads]\n    mask = kv < lens[h] and kv >= q - 40\n}\n")
    B, H, Hkv, n, d, e = 2, 4, 2, 160, 64, 2
    lens = torch.tensor([10, 90, 150, 30], dtype=torch.int32)
    rep = ex.explain(text, n, head_dim=d, batch=B, heads=H, kv_heads=Hkv, arch="sm_90a", params={"lens": lens})
    keep = reference.keep_mask(flashgen.compile(text).spec, n, n, batch=B, heads=H, lens=lens).expand(B, H, n, n)
    bm = rep.tiles["fwd"].block_m
    keys = 0
    for b in range(B):
        for g in range(Hkv):
            read = set()
            for h in range(g * (H // Hkv), (g + 1) * (H // Hkv)):
                for i0 in range(0, n, bm):
                    kept = keep[b, h, i0:i0 + bm].any(0).nonzero().flatten().tolist()
                    if kept:
                        read |= set(range(min(kept), max(kept) + 1))  # the tile's hull
            keys += len(read)
    assert rep.fwd.compulsory_terms["K, V reads"] == 2 * e * d * keys


def test_seqlen_beyond_the_kernels_limit(capsys):
    big = (1 << 30) + 1
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="^seqlen_q: .*2\\^30"):
        ex.explain(SPECS / "causal.attn", big, head_dim=64, arch="sm_90a")
    with pytest.raises(ValueError, match="^seqlen_k: "):
        ex.explain(SPECS / "dense.attn", 128, big, head_dim=64, arch="sm_90a")
    rc = cli.main(["explain", str(SPECS / "dense.attn"), "--seqlen", "128", "--seqlen-k", str(big), "--head-dim",
                   "64", "--arch", "sm_90a"])
    assert rc == 2 and "--seqlen-k:" in capsys.readouterr().err
    assert time.perf_counter() - t0 < 1.0
    ex.explain(SPECS / "dense.attn", 1, 1 << 20, head_dim=64, arch="sm_90a")  # large but allowed


def test_forward_tile_over_shared_memory_gets_a_note(monkeypatch):
    monkeypatch.setenv("FLASHGEN_CUDA_FWD_TILE", "128x256x4")
    rep = ex.explain(SPECS / "dense.attn", 1024, head_dim=256, arch="sm_86")
    assert rep.tiles["fwd"].smem_bytes == 608_256
    assert any("forward tile" in n and "608,256" in n and "101,376" in n for n in rep.notes), rep.notes
    monkeypatch.delenv("FLASHGEN_CUDA_FWD_TILE")
    ok = ex.explain(SPECS / "dense.attn", 1024, head_dim=256, arch="sm_86")
    assert not any("forward tile" in n for n in ok.notes)


def test_kv_reread_note_counts_kv_only():
    d, e = 64, 2
    # one query tile, one key: no K/V re-read at all (the backward's extra traffic is not K/V)
    rep = ex.explain(SPECS / "dense.attn", 64, 1, head_dim=d, arch="sm_90a", backward=True)
    assert not any("re-read" in n for n in rep.notes), rep.notes
    # 1024 queries = 6 query tiles of 192 (three consumer warpgroups at d 64), each loading the
    # one key: 5 re-reads of K and V
    rep = ex.explain(SPECS / "dense.attn", 1024, 1, head_dim=d, arch="sm_90a")
    note = next(n for n in rep.notes if "re-read" in n)
    assert ex.fmt_bytes(5 * 2 * d * e) in note


def test_default_dtype_follows_the_spec(tmp_path, capsys):
    f32 = tmp_path / "f32only.attn"
    f32.write_text("attention f32only {\n    dtype fp32\n}\n")
    h16 = tmp_path / "h16.attn"
    h16.write_text("attention h16 {\n    dtype fp16\n    mask = causal\n}\n")
    assert ex.explain(SPECS / "causal.attn", 128, head_dim=64, arch="sm_90a").dtype == "bf16"
    assert ex.explain(h16, 128, head_dim=64, arch="sm_90a").dtype == "fp16"
    assert ex.explain(f32, 128, head_dim=64, device="cpu").dtype == "fp32"
    with pytest.raises(ValueError, match="^arch: spec 'f32only' has no CUDA dtype"):
        ex.explain(f32, 128, head_dim=64, arch="sm_90a")
    rc = cli.main(["explain", str(h16), "--seqlen", "128", "--head-dim", "64", "--arch", "sm_90a", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["dtype"] == "fp16"
    rc = cli.main(["explain", str(f32), "--seqlen", "128", "--head-dim", "64", "--arch", "sm_90a"])
    err = capsys.readouterr().err
    assert rc == 2 and "--arch:" in err and "no CUDA dtype" in err


ROW_EXACT_MASKS = [
    (SPECS / "sliding_window.attn", {"window": 9}),
    (SPECS / "gemma.attn", {"window": 5}),
    (SPECS / "prefix_lm.attn", {}),
    (SPECS / "key_padding.attn", {}),
    ("attention w {\n    param l: int\n    param r: int\n    mask = window(l, r)\n}\n", {"l": 3, "r": 2}),
    ("attention n {\n    mask = not (kv > q or kv < q - 6)\n}\n", {}),
    ("attention e {\n    mask = kv == q\n}\n", {}),
    ("attention f {\n    param on: i32[batch]\n    mask = on[b] > 20 and kv <= 2 * q\n}\n", {}),
    ("attention p {\n    param lens: i32[heads]\n    mask = -kv > -lens[h] and kv >= q - 5\n}\n", {}),
]


@pytest.mark.parametrize("spec,params", ROW_EXACT_MASKS)
def test_row_exact_masks_closed_form_matches_evaluation(spec, params, monkeypatch):
    op = flashgen.compile(spec)
    from flashgen.codegen import variant

    assert variant.hook_bodies(op.spec)["row_exact"]
    for nq, nk, B, H in [(37, 53, 2, 3), (64, 20, 3, 2), (100, 100, 2, 4)]:
        vals = ex.spec_params(op.spec, dict(params), B, H, nq, nk)
        closed = ex.compute_geometry(op.spec, nq, nk, B, H, vals, ((16, 8),))
        assert closed.source.startswith("closed form")
        monkeypatch.setattr(ex.geometry, "row_bounds", lambda *a: None)
        evaluated = ex.compute_geometry(op.spec, nq, nk, B, H, vals, ((16, 8),))
        monkeypatch.undo()
        assert evaluated.source == "mask evaluated"
        assert torch.equal(closed.first, evaluated.first) and torch.equal(closed.last, evaluated.last)
        assert closed.pairs == evaluated.pairs
        assert torch.equal(closed.blocks[(16, 8)], evaluated.blocks[(16, 8)])


def test_long_sliding_window_is_fast():
    n, w = 65536, 4096
    t0 = time.perf_counter()
    rep = ex.explain(SPECS / "sliding_window.attn", n, head_dim=128, heads=16, arch="sm_90a", backward=True,
                     params=[f"window={w}"])
    took = time.perf_counter() - t0
    assert took < 2.0, took
    pairs = w * (w + 1) // 2 + (n - w) * w  # rows keep min(i + 1, w) keys
    assert rep.flops == 14 * 16 * 128 * pairs
    assert rep.compulsory_bytes <= rep.hbm_bytes


def test_unknown_arch_named_once():
    from rich.console import Console

    rep = ex.explain(SPECS / "dense.attn", 1024, head_dim=64, arch="sm_103")
    con = Console(record=True, width=200)
    ex.render(rep, con)
    out = con.export_text()
    assert out.count("sm_103 (figures of B200)") == 1, out
    assert "sm_100" in out  # where the figures come from


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_measure_on_cuda():
    rep = ex.explain(SPECS / "causal.attn", 2048, head_dim=64, batch=2, heads=8, device="cuda", measure=True)
    expected = flashgen.compile(SPECS / "causal.attn").family_for("cuda", torch.bfloat16, 64).family.name
    assert rep.device == "cuda" and rep.family == expected and rep.arch.startswith("sm_")
    assert rep.measured_ms > 0
    assert 0 < rep.fraction_of_floor <= 1.05
    assert rep.tflops == pytest.approx(rep.flops / rep.measured_ms / 1e9)
    assert rep.tiles["fwd"].origin in ("table", "derived", "tuned", "env", "family default")
    op = flashgen.compile(SPECS / "causal.attn")
    if expected == "sm90":  # the family's own tile (flashgen/families/sm90.py)
        assert (rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n) == (192, 128)  # three consumer warpgroups at d 64
    else:
        choice = op.tiles("cuda", ir.DType.BF16, 64, 2048)
        assert (rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n) == (choice.fwd.block_m, choice.fwd.block_n)


@pytest.mark.gpu
def test_measure_backward_cli_json(capsys):
    rc = cli.main(["explain", str(SPECS / "dense.attn"), "--seqlen", "1024", "--head-dim", "128", "--batch", "2",
                   "--heads", "4", "--device", "cuda", "--backward", "--measure", "--reps", "5", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["measured_ms"] > 0 and 0 < d["fraction_of_floor"] <= 1.05
    assert math.isclose(d["tflops"], d["flops"] / d["measured_ms"] / 1e9)


# ---------------------------------------------------------------- the kernel family of the call


def test_report_names_the_family_that_serves_the_call(capsys):
    rep = ex.explain(SPECS / "causal.attn", 256, head_dim=64, arch="sm_90a")
    assert (rep.family, rep.device) == ("sm90", "cuda")
    assert rep.family_why.startswith("sm90 (the first family that serves the call")
    both = ex.explain(SPECS / "causal.attn", 256, head_dim=64, arch="sm_90a", backward=True)
    assert both.family == "sm90" and both.tiles["fwd"].block_n == 128  # the forward's family and tile
    # causal at d 64: the sm90 backward serves it, with its own tile (128 keys x 128-row query tiles)
    assert any("backward: the sm90 family" in n for n in both.notes)
    bt = both.tiles["bwd"]
    assert (bt.block_m, bt.block_n, bt.warps) == (128, 128, 12)
    assert bt.smem_bytes == sm90.bwd_smem_bytes(64, block_m=128) > sm90.bwd_smem_bytes(64)
    with flashgen.use_family("sm90"):
        assert ex.explain(SPECS / "causal.attn", 256, head_dim=64, arch="sm_90a", backward=True).family == "sm90"
    # ALiBi (a score expression and a parameter) at d 64: the sm90 backward too; at d 256 its
    # backward runs on sm80, and the note says why
    ali = ex.explain(SPECS / "alibi.attn", 256, head_dim=64, arch="sm_90a", backward=True)
    assert any("backward: the sm90 family" in n for n in ali.notes), ali.notes
    ali = ex.explain(SPECS / "alibi.attn", 256, head_dim=256, arch="sm_90a", backward=True)
    assert any("backward: the sm80 family (sm90 has no backward kernels at head_dim 256" in n
               for n in ali.notes), ali.notes
    assert ali.tiles["bwd"].block_n != 128 or ali.tiles["bwd"].warps != 12
    with flashgen.use_family("sm90"), pytest.raises(NotImplementedError, match="sm90 .*backward"):
        ex.explain(SPECS / "alibi.attn", 256, head_dim=256, arch="sm_90a", backward=True)
    at80 = ex.explain(SPECS / "causal.attn", 256, head_dim=64, arch="sm_80")
    assert at80.family == "sm80" and "sm90 needs compute capability 9.0" in at80.family_why
    cpu = ex.explain(SPECS / "causal.attn", 256, head_dim=64, device="cpu")
    assert (cpu.family, cpu.device) == ("cpu", "cpu") and cpu.family_why.startswith("cpu (the first family")
    assert "sm80 runs on cuda tensors, not cpu" in cpu.family_why
    rc = cli.main(["explain", str(SPECS / "causal.attn"), "--seqlen", "256", "--head-dim", "64", "--arch", "sm_90a",
                   "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and (d["family"], d["device"]) == ("sm90", "cuda") and d["family_why"] == rep.family_why
    rc = cli.main(["explain", str(SPECS / "causal.attn"), "--seqlen", "256", "--head-dim", "64", "--device", "cpu"])
    assert rc == 0 and f"kernel family: {cpu.family_why}" in " ".join(capsys.readouterr().out.split())


def test_sm90_model_counts_its_own_forward_tile():
    """The sm90 forward tile (128 x 128 at d 128) sets the K/V re-reads: ceil(1000 / 128) = 8
    query tiles each read K and V once; shared memory is the family's formula."""
    B, H, nq, nk, d, e = 2, 3, 1000, 777, 128, 2
    rep = ex.explain(SPECS / "dense.attn", nq, nk, head_dim=d, batch=B, heads=H, arch="sm_90a")
    fwd = rep.tiles["fwd"]
    assert (rep.family, fwd.block_m, fwd.block_n, fwd.warps) == ("sm90", 128, 128, 12)
    assert fwd.smem_bytes == sm90_smem(d, 128, 2)
    assert rep.fwd.terms["K, V reads"] == B * H * 8 * nk * d * e * 2
    # a document mask visits the block lists made per call for the sm90 tiles (128 x 128 at d 64)
    ids = torch.tensor([[0] * 300 + [1] * 500 + [2] * 224], dtype=torch.int32)
    doc = ex.explain(SPECS / "document.attn", 1024, head_dim=64, arch="sm_90a", params={"document_id": ids})
    causal = ex.explain(SPECS / "causal.attn", 1024, head_dim=64, arch="sm_90a")
    assert doc.family == "sm90" and doc.model.startswith("block lists") and doc.tiles["fwd"].block_n == 128
    # key tiles holding a kept (causal, same-document) pair per query tile of 128 rows, documents
    # [0, 300), [300, 800), [800, 1024): 1, 2, 3, 2, 3, 4, 5, 2 = 22 (causal: 36)
    assert doc.fwd.terms["K, V reads"] == 22 * 128 * 64 * e * 2
    # causal at d 64 without lists: query tiles of 192 rows (three consumer warpgroups), each
    # reading the keys up to its last row: 192 + 384 + 576 + 768 + 960 + 1024
    assert causal.fwd.terms["K, V reads"] == 3904 * 64 * e * 2
    assert doc.flops < causal.flops  # FLOPs count the kept pairs only


def test_family_model_is_chosen_by_the_family_name(monkeypatch):
    seen = []
    real = ex.MODELS["cpu"]

    class Spy:
        @staticmethod
        def describe(call):
            seen.append(call.target.device_type)
            return real.describe(call)

    monkeypatch.setitem(ex.MODELS, "cpu", Spy)
    ex.explain(SPECS / "dense.attn", 128, head_dim=64, device="cpu")
    ex.explain(SPECS / "dense.attn", 128, head_dim=64, arch="sm_80")
    assert seen == ["cpu"]
    with families.use_family("sm80"), pytest.raises(NotImplementedError, match="family sm80"):
        ex.explain(SPECS / "dense.attn", 128, head_dim=64, device="cpu")


def test_explain_package_has_no_cycles_or_local_imports():
    graph = imports.module_graph(Path(flashgen.__file__).parent)
    assert not [c for c in imports.cycles(graph, exclude=("flashgen",)) if any("explain" in m or m == "flashgen.cli"
                                                                             for m in c)]
    mine = [m for m in graph.local if m.startswith("flashgen.explain") or m in ("flashgen.params", "flashgen.flops")]
    assert mine and all(graph.local[m] == [] for m in mine), {m: graph.local[m] for m in mine}
