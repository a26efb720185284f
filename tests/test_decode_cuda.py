"""The sm80 family's decode kernels (op.with_kvcache on CUDA; templates/include/flashgen/cuda/decode.cuh).

CPU tier: what the host decides (the split count from host-known shapes, the decode tile and its
shared memory, the workspaces), what the family serves and declines, the decode instantiation
(its unit, symbol and config), the ABI's new FgKvCache fields, and an nvcc compile of decode
units for sm_80 and sm_90a with zero register spills. The GPU cases below (marked ``gpu``) run
the same harness on CUDA through ``flashgen.use_family("sm80")``; the harness itself is checked
here on the CPU family, whose decode path the GPU results must equal.

GPU tier: every example spec against the float64 reference (the last Sq rows of the prefill
reference on the whole sequences, FlashAttention's tolerance rule), Sq in {1, 2, 5, 16}, GQA
1:1 / 4:1 / 8:1, head dims 64 / 128 / 256, fp16 / bf16, contiguous and paged caches (page sizes
1, 16, 256, shuffled tables, a page shared by two sequences; the page-lookup and grid-order
switches changing no bit), mixed lengths including 0 and the capacity, left padding, appends
across page boundaries (cache contents checked), num_splits 1 and several, device-side values
out of range (NaN rows, nothing written, nothing outside the tensors touched), a sliding window
that never reads outside the window, CUDA graph capture and replay with new lengths, and the op's
registration (opcheck). Outputs and workspaces start as NaN (conftest's poison fixture).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SPECS
from variant_cases import make_params

import flashgen
from flashgen import families, reference
from flashgen.families import sm80
from flashgen.lang import frontend, ir

ALL_SPECS = sorted(p.stem for p in SPECS.glob("*.attn"))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_ops: dict[str, flashgen.AttentionOp] = {}


def op_of(name: str) -> flashgen.AttentionOp:
    if name not in _ops:
        _ops[name] = flashgen.compile(SPECS / f"{name}.attn")
    return _ops[name]


# ------------------------------------------------------------------ host decisions (CPU)


def test_split_count_from_host_shapes():
    """0 chooses from batch x kv heads x row tiles against the SMs' CTA slots (never the lengths),
    and at least one split per SPLIT_KEYS keys of the capacity; 1 disables; n is clamped to one split per key tile of the capacity and MAX_DECODE_SPLITS."""
    h200 = dict(block_n=64, sms=132, per_sm=2)
    # the benchmark shapes (32 query / 8 kv heads, Sq = 1: one row tile)
    assert sm80.decode_splits(1, 8, 1, 32768, **h200) == 29
    assert sm80.decode_splits(16, 8, 1, 8192, **h200) == 2
    assert sm80.decode_splits(64, 8, 1, 4096, **h200) == 1
    assert sm80.decode_splits(128, 8, 1, 1024, **h200) == 1
    for B, hkv, mt, cap in ((1, 1, 1, 64), (1, 1, 1, 1), (1, 1, 1, 0), (2, 8, 3, 100), (1, 1, 1, 10**6)):
        s = sm80.decode_splits(B, hkv, mt, cap, **h200)
        assert 1 <= s <= max(1, min(sm80.MAX_DECODE_SPLITS, -(-cap // 64)))
    assert sm80.decode_splits(1, 1, 1, 64, **h200) == 1  # one key tile: nothing to split
    assert sm80.decode_splits(1, 1, 1, 10**6, **h200) <= sm80.MAX_DECODE_SPLITS
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, requested=1) == 1
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, requested=7) == 7
    assert sm80.decode_splits(1, 8, 1, 200, **h200, requested=7) == 4  # 4 tiles of 64 keys
    assert sm80.decode_splits(1, 8, 1, 10**6, **h200, requested=5000) == sm80.MAX_DECODE_SPLITS
    assert sm80.decode_splits(0, 8, 1, 4096, **h200) == 1
    # a full GPU still splits a long capacity: no split holds more than SPLIT_KEYS keys of it, so
    # a batch of mixed lengths does not wait on its longest sequences' CTAs
    assert sm80.decode_splits(64, 8, 1, 32768, **h200) == 32768 // sm80.SPLIT_KEYS
    assert sm80.decode_splits(64, 8, 1, 32768 + 1, **h200) == 32768 // sm80.SPLIT_KEYS + 1
    assert sm80.decode_splits(64, 8, 1, 10**7, **h200) == sm80.MAX_DECODE_SPLITS
    assert sm80.decode_splits(64, 8, 1, 32768, **h200, requested=1) == 1


def test_split_count_follows_the_keys_a_window_keeps():
    """A sliding window in a long cache is split as the window alone would be: ``keys`` (the
    host-known bound on a row tile's keys, runtime/decode.py key_span) replaces the capacity in
    the one-split-per-tile limit and the SPLIT_KEYS floor; without a bound nothing changes."""
    h200 = dict(block_n=64, sms=132, per_sm=2)
    assert sm80.decode_splits(16, 8, 1, 32768, **h200) == 8  # the floor: one split per 4096 keys
    assert sm80.decode_splits(16, 8, 1, 32768, **h200, keys=4096) == sm80.decode_splits(16, 8, 1, 4096, **h200) == 2
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, keys=4096) == sm80.decode_splits(1, 8, 1, 4096, **h200)
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, keys=10**6) == sm80.decode_splits(1, 8, 1, 32768, **h200)
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, keys=100, requested=7) == 2  # 2 tiles of 64 keys
    assert sm80.decode_splits(1, 8, 1, 32768, **h200, keys=0) == 1


def test_key_span_of_a_window_and_of_specs_without_one():
    from flashgen.runtime.decode import key_span

    window = op_of("sliding_window").spec
    assert key_span(window, [4096], 32768, 1) == 4096
    assert key_span(window, [4096], 32768, 4) == 4099  # four rows at consecutive positions
    assert key_span(window, [4096], 2048, 1) == 2048  # never beyond the capacity
    assert key_span(window, [-3], 2048, 1) == 0
    assert key_span(window, [object()], 2048, 1) == 2048  # not a host int (a symbolic one under torch.compile)
    tw = op_of("transformers_window").spec
    assert key_span(tw, [99, 0], 32768, 1) == 100  # window(left, right): left + right + 1
    for name, values in (("causal", []), ("alibi", [torch.ones(32)])):
        assert key_span(op_of(name).spec, values, 32768, 1) == 32768


def test_decode_tile_fits_and_keeps_two_ctas_per_sm():
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "any"):
        optin = flashgen.tiles.arch_info("sm_90a" if arch == "any" else arch).smem_optin
        for d in sm80.DECODE_HEAD_DIMS:
            cfg = sm80.decode_tile(arch, d)
            assert cfg["decode"] == 1 and cfg["decode_block_n"] in (32, 64) and cfg["decode_stages"] in (2, 3)
            assert cfg["decode_smem"] == sm80.decode_smem(d, cfg["decode_block_n"], cfg["decode_stages"])
            assert cfg["decode_smem"] <= optin
            if d <= 128 or arch in ("sm_90a", "any", "sm_80"):
                assert 2 * (cfg["decode_smem"] + 1024) <= optin + 1024, (arch, d, cfg)
    assert sm80.decode_tile("sm_90a", 128) == {"decode": 1, "decode_block_n": 64, "decode_stages": 3,
                                               "decode_smem": 108800}
    assert sm80.decode_tile("sm_80", 128)["decode_stages"] == 2  # two CTAs in an A100's 164 KiB
    assert sm80.decode_tile("sm_90a", 256)["decode_block_n"] == 32


def test_decode_tile_forced_by_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHGEN_CUDA_DECODE_TILE", "128x2")
    assert sm80.decode_tile("sm_90a", 128) == {"decode": 1, "decode_block_n": 128, "decode_stages": 2,
                                               "decode_smem": sm80.decode_smem(128, 128, 2)}
    assert any(v in (b"128x2", "128x2") for v in flashgen.env.library_selection())  # in the op's library key
    for bad, why in (("128x4", "282,880 B"), ("48x3", "keys 32, 64 or 128"), ("64x5", "2 to 4 stages"),
                     ("64", "expected BNxST")):
        monkeypatch.setenv("FLASHGEN_CUDA_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="FLASHGEN_CUDA_DECODE_TILE") as e:
            sm80.decode_tile("sm_90a", 128)
        assert why in str(e.value)


def test_family_serves_decode_where_it_has_kernels():
    spec = frontend.parse(SPECS / "causal.attn")
    fam = families.get("sm80")
    for arch in ("sm_80", "sm_90a"):
        for dt in (ir.DType.BF16, ir.DType.FP16):
            for d in (64, 128, 256, 16, 96):
                call = families.Call("cuda", arch, dt, d, frozenset({"decode"}))
                assert fam.declines(spec, call) is None
                assert families.choose(spec, call).family is fam  # sm90 has none: sm80 serves Hopper
    for d in (40, 72, 200, 8):
        call = families.Call("cuda", "sm_90a", ir.DType.BF16, d, frozenset({"decode"}))
        assert re.search(f"no decode kernels .*head_dim {d}", fam.declines(spec, call))
        with pytest.raises(NotImplementedError, match=f"family sm80 .*head_dim {d}"):
            families.choose(spec, call, family="sm80")
        assert fam.declines(spec, families.Call("cuda", "sm_90a", ir.DType.BF16, d)) is None  # prefill still
    call = families.Call("cuda", "sm_80", ir.DType.BF16, 40, frozenset({"decode"}))
    with pytest.raises(NotImplementedError, match="no kernel family serves .*sm80 has no decode kernels"):
        families.choose(spec, call)
    assert "no fp32" in fam.declines(spec, families.Call("cuda", "sm_80", ir.DType.FP32, 128,
                                                         frozenset({"decode"})))
    assert "compute capability" in fam.declines(spec, families.Call("cuda", "sm_75", ir.DType.BF16, 128,
                                                                    frozenset({"decode"})))
    assert families.get("cpu").decode_instantiation(spec, "any", ir.DType.FP32, 64) is None


def test_decode_instantiation_is_its_own_unit():
    """config ("decode", 1): one translation unit, cuda_decode.cu.jinja, entry fg_<spec>_decode_*;
    its key differs from the forward's, and its render names the tile the family chose."""
    spec = frontend.parse(SPECS / "gemma.attn")
    fam = families.get("sm80")
    inst = fam.decode_instantiation(spec, "sm_90a", ir.DType.BF16, 128)
    assert inst.kinds == ("decode",)
    assert inst.symbol("decode") == "fg_gemma_decode_bf16_hd128"
    (name, text), = inst.sources().items()
    assert name == "cuda_decode_bf16_hd128.cu"
    assert "launch_decode<Variant_gemma, __nv_bfloat16, 128, FgDecodeTile>" in text
    assert "DecodeTile<64, 3, 108800>" in text
    assert "extern \"C\" int fg_gemma_decode_bf16_hd128_abi(void)" in text
    fwd = fam.instantiation(spec, "sm_90a", ir.DType.BF16, 128)
    assert inst.key != fwd.key and "decode" not in fwd.kinds
    assert fam.decode_instantiation(spec, "sm_80", ir.DType.BF16, 128).key != inst.key


def test_generated_has_decode_units():
    for name in ALL_SPECS:
        assert list((ROOT / "generated" / name).glob("cuda_decode_*.cu")), name


def test_kv_cache_abi_fields_at_the_end():
    from flashgen.abi import ABI_VERSION, FgKvCache

    names = [f[0] for f in FgKvCache._fields_]
    assert names[-4:] == ["num_splits", "reserved", "o_accum", "lse_accum"]
    assert ABI_VERSION >= 10


class _Args:
    """The fields kv_splits reads of an FgFwdArgs."""

    def __init__(self, batch, heads_q, heads_kv, seqlen_q, capacity, sms):
        from flashgen.abi import FgKvCache

        self.batch, self.heads_q, self.heads_kv, self.seqlen_q, self.num_sms = batch, heads_q, heads_kv, seqlen_q, sms
        self.kv_cache = FgKvCache()
        self.kv_cache.capacity = capacity


def test_launch_fields_split_count_and_workspace_shapes():
    """The family's launch fields give the split count per call (row tiles: ceil(group * Sq / 16));
    a call with splits > 1 gets workspaces [splits, B, Hq, Sq, d] and [splits, B, Hq, Sq]."""
    spec = frontend.parse(SPECS / "causal.attn")
    fam = families.get("sm80")
    fields = fam.launch_fields(spec)
    inst = fam.decode_instantiation(spec, "sm_90a", ir.DType.BF16, 128)
    assert fields.kv_splits(_Args(1, 32, 8, 1, 32768, 132), inst, 0) == 29
    assert fields.kv_splits(_Args(1, 32, 8, 1, 32768, 132), inst, 1) == 1
    # 8:1 GQA at Sq = 16: 128 rows, 8 row tiles per kv head: 64 CTAs per split
    assert fields.kv_splits(_Args(1, 64, 8, 16, 32768, 132), inst, 0) == \
        sm80.decode_splits(1, 8, 8, 32768, 64, 132, 2)
    assert families.get("cpu").launch_fields(spec).kv_splits(_Args(1, 32, 8, 1, 32768, 0), inst, 0) == 1


def test_decode_grid_is_decoded_in_one_place_and_switches_are_read_per_launch():
    """The attention kernel's CTA index is decoded only by decode_cta (both grid orders there), and
    the launcher reads the page-lookup and grid-order switches on every launch (no rebuild, not
    part of the library key)."""
    inc = ROOT / "templates" / "include" / "flashgen" / "cuda"
    text = (inc / "decode.cuh").read_text()
    kernel = text[text.index("struct DecodeKernel"):text.index("decode_combine_kernel(const P p)")]
    assert kernel.count("blockIdx") == 1 and "decode_cta(p, blockIdx.x, mt, split, hk, b)" in kernel
    keys = (inc / "decode_keys.cuh").read_text()
    keys = keys[keys.index("struct DecodeKeysKernel"):]
    assert keys.count("blockIdx") == 1 and "Base::decode_cta(p, blockIdx.x, mt, split, hk, b)" in keys
    text = (inc / "decode_launch.cuh").read_text()
    launcher = text[text.index("int launch_decode("):]
    for name in ("FLASHGEN_DECODE_ROW_LOOKUP", "FLASHGEN_DECODE_HEADS_FIRST"):
        assert f'getenv("{name}")' in launcher
        assert name not in (ROOT / "flashgen" / "env.py").read_text()


# ------------------------------------------------------------------ nvcc (CPU, skips without nvcc)

PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# (spec, dtype, head dim, arch): the hot path (causal), keep() per element (document), d 256 (two
# warps, the most registers), a score mod with a parameter on the A100 tile (alibi). A mask with
# a score mod (gemma, from generated/) is tests/test_nvcc.py's.
NVCC_CASES = [("causal", "bf16", 128, "sm_90a"), ("document", "fp16", 128, "sm_90a"), ("causal", "bf16", 256, "sm_90a"),
              ("alibi", "fp16", 128, "sm_80"), ("causal", "bf16", 96, "sm_80"), ("sliding_window", "bf16", 80, "sm_90a")]


def ptxas_report(text: str) -> dict[str, tuple[int, int, int]]:
    """Kernel (mangled) -> (registers, spill store bytes, spill load bytes)."""
    res, cur, regs = {}, None, 0
    for line in text.splitlines():
        m = PTXAS_ENTRY.search(line)
        if m:
            cur = m.group(1)
            continue
        m = PTXAS_SPILLS.search(line)
        if m and cur is not None:
            res[cur] = (0, int(m.group(1)), int(m.group(2)))
        m = PTXAS_REGS.search(line)
        if m and cur is not None and cur in res:
            res[cur] = (int(m.group(1)), *res[cur][1:])
    return res


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec, dtype, head_dim, arch", NVCC_CASES, ids=["-".join(map(str, c)) for c in NVCC_CASES])
def test_decode_unit_compiles_without_spills(spec, dtype, head_dim, arch, tmp_path):
    """The decode unit as a build renders it compiles for its arch with a build's flags, with no
    warning, no register spill and no stack frame in any of its kernels (append, attention, and
    the combine with one and with four warps per row)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    inst = families.get("sm80").decode_instantiation(frontend.parse(SPECS / f"{spec}.attn"), arch, ir.DType(dtype),
                                                     head_dim)
    (_, text), = inst.sources().items()
    src = tmp_path / "k.cu"
    src.write_text(text)
    num = arch.removeprefix("sm_")
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS,
           f"-gencode=arch=compute_{num},code=sm_{num}", "-Xptxas", "-v", "-I", str(ROOT / "templates" / "include"),
           "-o", str(tmp_path / "k.o"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    report = ptxas_report(res.stderr)
    kernels = {k: v for k, v in report.items() if "decode" in k}
    assert len(kernels) == 4, report  # append, attention, combine (1 and 4 warps a row)
    for name, (regs, st, ld) in kernels.items():
        assert st == 0 and ld == 0, f"{name} spills: {st} B stores, {ld} B loads"
        assert 0 < regs <= 255
    assert "bytes stack frame" in res.stderr and all(
        m == "0" for m in re.findall(r"(\d+) bytes stack frame", res.stderr))


# ------------------------------------------------------------------ the harness (CPU and GPU)


def params_for(name: str, B: int, Hq: int, cap: int, device, g: torch.Generator) -> dict:
    """Parameters with the decode call's shapes (seqlen_q and seqlen_k dims are the capacity)."""
    if name == "dropout":
        return {}
    if name == "transformers_window":
        return {"left": 6, "right": 0}
    if name == "transformers":
        return {"key_mask": (torch.rand(B, cap, generator=g) > 0.2).to(device), "left": 9, "right": 2,
                "softcap": 20.0}
    if name in ("transformers_packed", "transformers_packed_plain"):
        cut = torch.randint(1, cap, (B, 1), generator=g)
        p = {"seq_id": (torch.arange(cap) >= cut).to(torch.int32).to(device), "left": 9, "right": 0}
        return p | {"softcap": 20.0} if name == "transformers_packed" else p
    return make_params(name, B, Hq, cap, cap, device, g, variant=1)


def whole_sequences(kc, vc, seqlens, leftpad, kn, vn):
    """Each sequence's keys and values ([Hkv, L, d], on the CPU): cache slots pad .. n - 1 of a
    contiguous cache before the call, then the new ones."""
    ks, vs = [], []
    for b in range(kc.shape[0]):
        n, pad = int(seqlens[b]), int(leftpad[b]) if leftpad is not None else 0
        kb, vb = kc[b, :, pad:n].cpu(), vc[b, :, pad:n].cpu()
        if kn is not None:
            kb, vb = torch.cat([kb, kn[b].cpu()], 1), torch.cat([vb, vn[b].cpu()], 1)
        ks.append(kb)
        vs.append(vb)
    return ks, vs


def reference_rows(spec, q, ks, vs, params, cap, dtype, g):
    """The last Sq rows of the reference prefill call on each whole sequence (one packed call, on
    the CPU, in ``dtype``): out [B, Hq, Sq, d] and lse [B, Hq, Sq] (rows at negative positions 0
    and -inf)."""
    B, Hq, Sq, d = q.shape
    lens = [k.shape[1] for k in ks]
    qs = []
    for b, L in enumerate(lens):
        qf = torch.randn(Hq, L, d, generator=g).to(q.dtype)
        if L:
            qf[:, -min(L, Sq):] = q[b, :, -min(L, Sq):].cpu()
        qs.append(qf)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cpu_params = {n: (x.cpu().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else
                      x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in params.items()}
    qp, kp, vp = (torch.cat(t, 1).transpose(0, 1).to(dtype) for t in (qs, ks, vs))
    out, lse = reference.attention(spec, qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=cap,
                                   max_seqlen_k=cap, return_lse=True, **cpu_params)
    want_o = torch.zeros(B, Hq, Sq, d, dtype=dtype)
    want_l = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    for b, L in enumerate(lens):
        m = min(L, Sq)
        if m:
            want_o[b, :, Sq - m:] = out[int(cu[b + 1]) - m:int(cu[b + 1])].transpose(0, 1)
            want_l[b, :, Sq - m:] = lse[:, int(cu[b + 1]) - m:int(cu[b + 1])].double()
    return want_o, want_l


def check_rows(spec, q, ks, vs, params, cap, out, lse, g, atol=1e-5):
    """FlashAttention's rule against the float64 reference: max|out - ref64| <= 2 max|ref_lowp -
    ref64| + atol (ref_lowp in q's dtype); the same for the LSE plus a few fp32 ulps; rows that
    see no key exactly 0 and -inf; no NaN."""
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    r64, l64 = reference_rows(spec, q, ks, vs, params, cap, torch.float64, torch.Generator().manual_seed(seed))
    rlo, llo = reference_rows(spec, q, ks, vs, params, cap, q.dtype, torch.Generator().manual_seed(seed))
    out, lse = out.cpu().double(), lse.cpu().double()
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out - r64).abs().max().item() if out.numel() else 0.0
    bound = 2 * (rlo.double() - r64).abs().max().item() + atol if out.numel() else atol
    assert err <= bound, f"max|out - ref64| = {err:.3e} > {bound:.3e}"
    empty = torch.isneginf(l64)
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    fin = ~empty
    if fin.any():
        lerr = ((lse - l64).abs() - 1e-6 * l64.abs())[fin].clamp(min=0).max().item()
        lbound = 2 * (llo.double() - l64).abs()[fin].max().item() + 1e-4
        assert lerr <= lbound, f"lse error {lerr:.3e} > {lbound:.3e}"


def to_paged(kc, vc, page_size, g, share_first=False):
    """A paged copy of contiguous caches: pages shuffled in a pool with two spare pages; with
    ``share_first`` sequence 1 reads sequence 0's first page (its own first page made equal)."""
    Bn, H, cap, d = kc.shape
    max_pages = cap // page_size
    if share_first:
        kc[1, :, :page_size], vc[1, :, :page_size] = kc[0, :, :page_size], vc[0, :, :page_size]
    perm = torch.randperm(Bn * max_pages + 2, generator=g)
    table = perm[:Bn * max_pages].view(Bn, max_pages).to(torch.int32)
    pool_k = torch.randn(Bn * max_pages + 2, page_size, H, d, generator=g).to(kc.dtype).to(kc.device)
    pool_v = torch.randn_like(pool_k)
    for b in range(Bn):
        for j in range(max_pages):
            sl = slice(j * page_size, (j + 1) * page_size)
            pool_k[table[b, j]], pool_v[table[b, j]] = kc[b, :, sl].transpose(0, 1), vc[b, :, sl].transpose(0, 1)
    if share_first:
        table[1, 0] = table[0, 0]
    return pool_k, pool_v, table.to(kc.device)


def from_paged(pool, table, page_size):
    return torch.stack([torch.cat([pool[p] for p in row.tolist()], 0).transpose(0, 1) for row in table.cpu()])


def decode_case(name, device, dtype, *, B=3, group=4, hkv=2, Sq=2, d=128, cap=300, Sn=2, leftpad=True,
                num_splits=0, seed=0, seqlens=None):
    """One decode call of spec ``name`` on ``device`` against the float64 reference, the cache
    holding the appended keys afterwards (and nothing else changed)."""
    op, g = op_of(name), torch.Generator().manual_seed(seed)
    Hq = group * hkv
    kc = torch.randn(B, hkv, cap, d, generator=g).to(dtype).to(device)
    vc = torch.randn(B, hkv, cap, d, generator=g).to(dtype).to(device)
    kn = torch.randn(B, hkv, Sn, d, generator=g).to(dtype).to(device) if Sn else None
    vn = torch.randn(B, hkv, Sn, d, generator=g).to(dtype).to(device) if Sn else None
    q = torch.randn(B, Hq, Sq, d, generator=g).to(dtype).to(device)
    if seqlens is None:
        seqlens = [0, min(cap - Sn, 17 + seed), cap - Sn][:B] + [int(x) for x in torch.randint(0, cap - Sn + 1,
                                                                                                 (max(0, B - 3),),
                                                                                                 generator=g)]
    seqlens = torch.tensor(seqlens, dtype=torch.int32)
    lp = torch.tensor([min(int(n), (3 * b) % 7) for b, n in enumerate(seqlens)], dtype=torch.int32) if leftpad \
        else None
    params = params_for(name, B, Hq, cap, device, g)
    ks, vs = whole_sequences(kc, vc, seqlens, lp, kn, vn)
    before_k, before_v = kc.clone(), vc.clone()
    out, lse = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens.to(device),
                               cache_leftpad=lp.to(device) if lp is not None else None, k=kn, v=vn,
                               return_lse=True, num_splits=num_splits, **params)
    check_rows(op.spec, q, ks, vs, params, cap, out, lse, g, atol=1e-5 if dtype == torch.float32 else 1e-3)
    for b in range(B):
        n = int(seqlens[b])
        if Sn:
            assert torch.equal(kc[b, :, n:n + Sn], kn[b]) and torch.equal(vc[b, :, n:n + Sn], vn[b])
        assert torch.equal(kc[b, :, :n], before_k[b, :, :n]) and torch.equal(kc[b, :, n + Sn:], before_k[b, :, n + Sn:])
        assert torch.equal(vc[b, :, :n], before_v[b, :, :n]) and torch.equal(vc[b, :, n + Sn:], before_v[b, :, n + Sn:])
    return out, lse


def paged_case(device, dtype, page_size, *, d=128, num_splits=0, seed=0):
    """Paged caches (shuffled pages, one shared by two sequences, appends across a page boundary)
    give what the contiguous cache gives, and hold the same keys afterwards."""
    op, g = op_of("gemma"), torch.Generator().manual_seed(seed + page_size)
    B, hkv, Hq, Sn = 3, 2, 8, 3
    cap = max(300 // page_size, 2) * page_size
    kc = torch.randn(B, hkv, cap, d, generator=g).to(dtype).to(device)
    vc = torch.randn(B, hkv, cap, d, generator=g).to(dtype).to(device)
    share = cap // page_size > 1
    pool_k, pool_v, table = to_paged(kc, vc, page_size, g, share_first=share)
    kn = torch.randn(B, hkv, Sn, d, generator=g).to(dtype).to(device)
    vn = torch.randn(B, hkv, Sn, d, generator=g).to(dtype).to(device)
    q = torch.randn(B, Hq, 3, d, generator=g).to(dtype).to(device)
    n2 = page_size - 1 if 1 < page_size < cap - 3 else 20  # sequence 2 appends across a page boundary
    seqlens = torch.tensor([cap - 3, max(page_size, 25) if share else 9, n2], dtype=torch.int32).to(device)
    params = {"window": 40, "softcap": 30.0}
    want_o, want_l = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=kn, v=vn, return_lse=True,
                                     num_splits=num_splits, **params)
    out, lse = op.with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, block_table=table, k=kn, v=vn,
                               return_lse=True, num_splits=num_splits, **params)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_l, atol=1e-4, rtol=1e-5)
    assert out.isfinite().all()
    for b in range(B):
        end = int(seqlens[b]) + Sn
        assert torch.equal(from_paged(pool_k, table, page_size)[b, :, :end], kc[b, :, :end])
        assert torch.equal(from_paged(pool_v, table, page_size)[b, :, :end], vc[b, :, :end])


def out_of_range_case(device, dtype, d=64, num_splits=0):
    """Device-side values out of range: the sequence's rows are NaN and its cache untouched, the
    others right. The caches are views inside guard memory that must stay unchanged."""
    op, g = op_of("causal"), torch.Generator().manual_seed(3)
    B, hkv, Hq, cap = 3, 2, 4, 200
    gk = torch.randn(B + 2, hkv, cap, d, generator=g).to(dtype).to(device)
    gv = torch.randn(B + 2, hkv, cap, d, generator=g).to(dtype).to(device)
    kc, vc = gk[1:B + 1], gv[1:B + 1]  # live memory on both sides of each cache
    kn = torch.randn(B, hkv, 1, d, generator=g).to(dtype).to(device)
    vn = torch.randn(B, hkv, 1, d, generator=g).to(dtype).to(device)
    q = torch.randn(B, Hq, 1, d, generator=g).to(dtype).to(device)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    good = op.with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=i32([5, 9, 12]), k=kn, v=vn,
                           num_splits=num_splits)
    snap_k, snap_v = gk.clone(), gv.clone()
    for seqlens, leftpad in (([5, cap, 12], None), ([5, -4, 12], None), ([5, 9, 12], [0, 10, 0]),
                             ([5, 2**31 - 1, 12], None), ([5, 9, 12], [0, -2**31, 0])):
        out, lse = op.with_kvcache(q, kc, vc, cache_seqlens=i32(seqlens), k=kn, v=vn, return_lse=True,
                                   cache_leftpad=i32(leftpad) if leftpad is not None else None,
                                   num_splits=num_splits)
        assert out[1].isnan().all() and lse[1].isnan().all()
        torch.testing.assert_close(out[[0, 2]], good[[0, 2]], atol=0, rtol=0)
        for guard, snap in ((gk, snap_k), (gv, snap_v)):
            assert torch.equal(guard[[0, 2, B + 1]], snap[[0, 2, B + 1]])  # sequence 1 and the guards: unchanged
        gk.copy_(snap_k)
        gv.copy_(snap_v)
    pool_k, pool_v, table = to_paged(kc.clone(), vc.clone(), 16, g)
    n = pool_k.shape[0]
    for bad in (n, -1, 2**31 - 1, -2**31):
        t = table.clone()
        t[2, 0] = bad  # a page of sequence 2's slots: outside the pool
        t[0, 5] = -7  # a page sequence 0 does not reach: harmless
        pk, pv = pool_k.clone(), pool_v.clone()
        out, lse = op.with_kvcache(q, pk, pv, block_table=t, cache_seqlens=i32([5, 9, 12]), k=kn, v=vn,
                                   return_lse=True, num_splits=num_splits)
        assert out[2].isnan().all() and lse[2].isnan().all() and out[:2].isfinite().all()
        # sequence 2 wrote nothing; 0 and 1 appended at slots 5 and 9 of their first pages
        for new, old in ((pk, pool_k), (pv, pool_v)):
            changed = (new != old).flatten(1).any(1).nonzero().flatten().tolist()
            assert sorted(changed) == sorted({int(table[0, 0]), int(table[1, 0])})
    if device != "cpu":
        torch.cuda.synchronize()  # an illegal access would surface here


def test_harness_on_the_cpu_family():
    """The GPU cases' harness, run on the CPU family (fp32): every check it makes holds there."""
    with flashgen.use_family("cpu"):
        decode_case("gemma", "cpu", torch.float32, d=32, cap=100, Sq=5, group=2)
        decode_case("causal", "cpu", torch.float32, d=32, cap=100, Sq=1, group=4, seqlens=[0, 98, 40])
        paged_case("cpu", torch.float32, 16, d=32)
        out_of_range_case("cpu", torch.float32, d=32)


# ------------------------------------------------------------------ GPU (sm80 family)

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def sm80_decode():
    """The decode libraries these cases use, built together (in parallel) before the first case;
    the sm80 family forced throughout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fam, dev = families.get("sm80"), torch.device("cuda", torch.cuda.current_device())
    wanted = [(n, "bf16", 128) for n in ALL_SPECS] + [("causal", dt, d) for dt in ("bf16", "fp16")
                                                      for d in (64, 96, 128, 256)] + \
        [("gemma", dt, d) for dt in ("bf16", "fp16") for d in (64, 128)] + [("sliding_window", "fp16", 64)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda w: op_of(w[0]).decode_library(fam, dev, ir.DType(w[1]), w[2]), wanted))
    with flashgen.use_family("sm80"):
        yield fam


@gpu
@pytest.mark.parametrize("name", ALL_SPECS)
def test_gpu_every_spec(sm80_decode, name):
    op = op_of(name)
    assert op.choose_family(torch.device("cuda"), ir.DType.BF16, 128, False, False, False, decode=True).family.name \
        == "sm80"
    decode_case(name, "cuda", torch.bfloat16, Sq=2, group=4, d=128, seed=len(name))


@gpu
@pytest.mark.parametrize("Sq", [1, 2, 5, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_rows_and_groups(sm80_decode, Sq, group):
    """Sq x GQA group: the packed rows of one kv head span 1 to 8 row tiles of 16."""
    decode_case("causal", "cuda", torch.bfloat16, Sq=Sq, group=group, hkv=2, B=5, seed=Sq * 10 + group)
    decode_case("gemma", "cuda", torch.float16, Sq=Sq, group=group, hkv=1, B=3, d=64, seed=Sq + group)


@gpu
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_head_dims_and_dtypes(sm80_decode, d, dtype):
    decode_case("causal", "cuda", DT[dtype], d=d, Sq=1, group=8, hkv=2, B=4, cap=700, seed=d)
    decode_case("causal", "cuda", DT[dtype], d=d, Sq=5, group=1, hkv=3, B=2, cap=129, Sn=0, leftpad=False, seed=d + 1)


@gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_gpu_num_splits(sm80_decode, num_splits):
    """Any split count gives the reference's rows (one split: out written directly, no combine)."""
    out, lse = decode_case("causal", "cuda", torch.bfloat16, Sq=2, group=4, cap=1000, B=3, num_splits=num_splits)
    out0, lse0 = decode_case("causal", "cuda", torch.bfloat16, Sq=2, group=4, cap=1000, B=3, num_splits=1)
    torch.testing.assert_close(out.float(), out0.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse0, atol=1e-4, rtol=0)


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_gpu_paged(sm80_decode, page_size, num_splits):
    paged_case("cuda", torch.bfloat16, page_size, num_splits=num_splits)


@gpu
def test_gpu_paged_leftpad_fp16(sm80_decode):
    """Left padding in a paged cache whose padding pages are out of the pool (never read)."""
    op, g = op_of("alibi"), torch.Generator().manual_seed(5)
    kc = torch.randn(3, 1, 128, 128, generator=g).half().cuda()
    vc = torch.randn(3, 1, 128, 128, generator=g).half().cuda()
    pool_k, pool_v, table = to_paged(kc, vc, 16, g)
    table[0, 0] = 10**6  # slots 0..15 of sequence 0: all padding
    kw = {"cache_seqlens": torch.tensor([40, 128, 1], dtype=torch.int32, device="cuda"),
          "cache_leftpad": torch.tensor([16, 7, 0], dtype=torch.int32, device="cuda"),
          "slopes": torch.linspace(0.1, 0.5, 4, device="cuda"), "return_lse": True}
    q = torch.randn(3, 4, 1, 128, generator=g).half().cuda()
    out, lse = op.with_kvcache(q, pool_k, pool_v, block_table=table, **kw)
    want_o, want_l = op.with_kvcache(q, kc, vc, **kw)
    torch.testing.assert_close(out.float(), want_o.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, want_l, atol=1e-4, rtol=0)
    assert out.isfinite().all()


# The launcher's diagnostic switches (decode.cuh, launch_decode; read per launch): the page looked
# up per 16-byte chunk or once per key row, the grid split-major or head-major. None: unset.
SWITCHES = {"old": ("0", "0"), "rows": ("1", "0"), "heads": ("0", "1"), "new": (None, None)}


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 48, 256])
def test_gpu_paged_lookup_and_grid_order_change_no_bit(sm80_decode, monkeypatch, page_size):
    """Every setting of FLASHGEN_DECODE_ROW_LOOKUP and FLASHGEN_DECODE_HEADS_FIRST gives the same
    out, lse and appended cache, bit for bit: shuffled pages of sizes that are (1, 16, 256) and are
    not (48) powers of two, d 96 (copy passes that do not cover whole rows) and 128, GQA 4:1 at
    Sq 3, left padding, an append across a page boundary, 1 and several splits; the contiguous
    cache likewise under either grid order, and the paged result is the contiguous one's."""
    op, g = op_of("causal"), torch.Generator().manual_seed(100 + page_size)
    B, hkv, Hq, Sn = 4, 2, 8, 2
    cap = max(600 // page_size, 3) * page_size
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    seqlens = i32([cap - Sn, 1, page_size - 1 if page_size > 1 else 7, cap // 2])
    leftpad = i32([3, 0, 0, 5])
    for d in (96, 128):
        kc = torch.randn(B, hkv, cap, d, generator=g).bfloat16().cuda()
        vc = torch.randn(B, hkv, cap, d, generator=g).bfloat16().cuda()
        pool_k, pool_v, table = to_paged(kc, vc, page_size, g)
        q = torch.randn(B, Hq, 3, d, generator=g).bfloat16().cuda()
        kn = torch.randn(B, hkv, Sn, d, generator=g).bfloat16().cuda()
        vn = torch.randn(B, hkv, Sn, d, generator=g).bfloat16().cuda()
        kw = {"cache_seqlens": seqlens, "cache_leftpad": leftpad, "k": kn, "v": vn, "return_lse": True}
        for splits in (0, 1, 5):
            got = {}
            for arm, (rows, order) in SWITCHES.items():
                for name, val in (("FLASHGEN_DECODE_ROW_LOOKUP", rows), ("FLASHGEN_DECODE_HEADS_FIRST", order)):
                    if val is None:
                        monkeypatch.delenv(name, raising=False)
                    else:
                        monkeypatch.setenv(name, val)
                pk, pv, ck, cv = pool_k.clone(), pool_v.clone(), kc.clone(), vc.clone()
                out, lse = op.with_kvcache(q, pk, pv, block_table=table, num_splits=splits, **kw)
                c_out, c_lse = op.with_kvcache(q, ck, cv, num_splits=splits, **kw)
                got[arm] = (out, lse, pk, pv, c_out, c_lse, ck, cv)
            for arm, res in got.items():
                assert all(torch.equal(x, y) for x, y in zip(res, got["old"])), (arm, d, splits)
            out, lse, _, _, c_out, c_lse = got["new"][:6]
            assert out.isfinite().all()
            torch.testing.assert_close(out, c_out, atol=0, rtol=0)
            torch.testing.assert_close(lse, c_lse, atol=0, rtol=0)
    monkeypatch.delenv("FLASHGEN_DECODE_ROW_LOOKUP", raising=False)
    monkeypatch.delenv("FLASHGEN_DECODE_HEADS_FIRST", raising=False)


@gpu
def test_gpu_more_queries_than_keys(sm80_decode):
    """Sq = 16 over sequences of 3 and 0 keys: rows without a row of the prefill call get 0 and -inf."""
    out, lse = decode_case("causal", "cuda", torch.bfloat16, Sq=16, group=2, B=3, Sn=0, leftpad=False,
                           seqlens=[3, 0, 30])
    assert (out[0, :, :13] == 0).all() and torch.isneginf(lse[1]).all() and (out[1] == 0).all()


@gpu
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_gpu_out_of_range_values(sm80_decode, num_splits):
    out_of_range_case("cuda", torch.bfloat16, num_splits=num_splits)


@gpu
def test_gpu_sliding_window_reads_only_the_window(sm80_decode):
    """Slots before the window (at least one key tile before it) hold NaN: never read, the rows
    stay finite and right."""
    op, g = op_of("sliding_window"), torch.Generator().manual_seed(11)
    B, hkv, Hq, cap, d, w = 2, 2, 8, 2000, 64, 100
    kc = torch.randn(B, hkv, cap, d, generator=g).half().cuda()
    vc = torch.randn(B, hkv, cap, d, generator=g).half().cuda()
    seqlens = torch.tensor([1500, 1999], dtype=torch.int32)
    for b in range(B):
        kc[b, :, :int(seqlens[b]) - w - 1] = float("nan")
        vc[b, :, :int(seqlens[b]) - w - 1] = float("nan")
    q = torch.randn(B, Hq, 1, d, generator=g).half().cuda()
    for splits in (0, 1, 3):
        out, lse = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens.cuda(), window=w, return_lse=True,
                                   num_splits=splits)
        ks, vs = whole_sequences(kc, vc, seqlens, None, None, None)
        ks = [torch.nan_to_num(k) for k in ks]
        vs = [torch.nan_to_num(v) for v in vs]
        check_rows(op.spec, q, ks, vs, {"window": w}, cap, out, lse, g, atol=1e-3)


@gpu
def test_gpu_cuda_graph_replay_with_new_lengths(sm80_decode):
    """One decode step (append + attention + combine) captured once, replayed with new lengths
    and new tokens written into the same static tensors: each replay equals the eager call."""
    op, g = op_of("causal"), torch.Generator().manual_seed(12)
    B, hkv, Hq, d = 4, 2, 8, 128
    pool_k = torch.randn(64, 16, hkv, d, generator=g).bfloat16().cuda()
    pool_v = torch.randn(64, 16, hkv, d, generator=g).bfloat16().cuda()
    table = torch.randperm(64, generator=g)[:B * 8].view(B, 8).to(torch.int32).cuda()  # capacity 128
    seqlens = torch.zeros(B, dtype=torch.int32, device="cuda")
    q = torch.zeros(B, Hq, 1, d, dtype=torch.bfloat16, device="cuda")
    kn = torch.zeros(B, hkv, 1, d, dtype=torch.bfloat16, device="cuda")
    vn = torch.zeros_like(kn)
    kw = {"block_table": table, "k": kn, "v": vn, "return_lse": True}
    op.with_kvcache(q, pool_k.clone(), pool_v.clone(), cache_seqlens=seqlens, **kw)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op.with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, **kw)
    for step, lens in enumerate(([3, 0, 100, 127], [4, 1, 101, 50], [17, 2, 0, 126])):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(B, Hq, 1, d, generator=g))
        kn.copy_(torch.randn(B, hkv, 1, d, generator=g))
        vn.copy_(torch.randn(B, hkv, 1, d, generator=g))
        ek, ev = pool_k.clone(), pool_v.clone()
        want_o, want_l = op.with_kvcache(q, ek, ev, cache_seqlens=seqlens, **kw)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want_o, atol=0, rtol=0, msg=f"step {step}")
        torch.testing.assert_close(lse, want_l, atol=0, rtol=0, msg=f"step {step}")
        assert torch.equal(pool_k, ek) and torch.equal(pool_v, ev)


@gpu
def test_gpu_opcheck(sm80_decode):
    """The decode op's registration with the CUDA kernels: schema with the caches mutated, fake
    implementation (torch.library.opcheck)."""
    op, g = op_of("alibi"), torch.Generator().manual_seed(9)
    kc = torch.randn(2, 2, 64, 128, generator=g).bfloat16().cuda()
    vc = torch.randn_like(kc)
    pool_k, pool_v, table = to_paged(kc, vc, 16, g)
    args = (torch.randn(2, 8, 2, 128, generator=g).bfloat16().cuda(), pool_k, pool_v,
            torch.tensor([3, 40], dtype=torch.int32, device="cuda"), table,
            torch.randn(2, 2, 2, 128, generator=g).bfloat16().cuda(),
            torch.randn(2, 2, 2, 128, generator=g).bfloat16().cuda(), None, None, 0,
            torch.linspace(0.1, 0.4, 8, device="cuda"))
    torch.library.opcheck(op.torch_kvcache, args)
