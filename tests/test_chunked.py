"""The ``chunked(n)`` mask built-in (chunked local attention, as in Llama 4): key kv is kept for
query q iff (q + δ) // n == kv // n, δ = seqlen_k − seqlen_q. Parse errors, the reference
against the definition, the closed-form key range, call-time checks, the CPU kernels end to
end (one spec text, one build) and the rendered CUDA through nvcc."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import check, families, reference
from flashgen import explain as ex
from flashgen.codegen import variant
from flashgen.errors import SpecError
from flashgen.lang import ir, keyrange

ROOT = Path(__file__).resolve().parent.parent
CHUNKED = "attention chunked_causal {\n    param chunk: int\n    mask = causal and chunked(chunk)\n}\n"
ALONE = "attention chunked_only {\n    mask = chunked(5)\n}\n"


def definition(nq: int, nk: int, n: int, causal: bool) -> torch.Tensor:
    """Bool [nq, nk] by the definition, element by element in Python."""
    delta = nk - nq
    out = torch.zeros(nq, nk, dtype=torch.bool)
    for q in range(nq):
        for kv in range(nk):
            out[q, kv] = (q + delta) // n == kv // n and (not causal or kv <= q + delta)
    return out


# ---------------------------------------------------------------- the language


@pytest.mark.parametrize("text,line,col,message,hint", [
    ("attention c {\n    mask = chunked(0)\n}\n", 2, 20, "needs a positive integer chunk size, got 0", None),
    ("attention c {\n    mask = causal and chunked(-8)\n}\n", 2, 31, "positive integer chunk size, got -8", None),
    ("attention c {\n    param w: float\n    mask = chunked(w)\n}\n", 3, 20, "needs an int parameter", None),
    ("attention c {\n    param width: int\n    mask = chunked(widht)\n}\n", 3, 20, "unknown name 'widht'",
     "did you mean 'width'?"),
    ("attention c {\n    mask = chunkd(64)\n}\n", 2, 12, "unknown function 'chunkd'", "did you mean 'chunked'?"),
    ("attention c {\n    mask = chunked(64, 2)\n}\n", 2, 12, "chunked() takes 1 argument(s), got 2", None),
    ("attention c {\n    param w: int\n    mask = chunked(2 * w)\n}\n", 3, 20, "a positive integer literal or the "
     "name of an int parameter", None),
])
def test_parse_errors(text, line, col, message, hint):
    with pytest.raises(SpecError) as err:
        flashgen.compile(text)
    e = err.value
    assert (e.line, e.column) == (line, col), str(e)
    assert message in str(e)
    if hint:
        assert hint in str(e)
    assert f"<spec>:{line}:{col}: error:" in str(e)


def test_ir_records_the_positive_parameter_and_keeps_other_fingerprints():
    spec = flashgen.compile(CHUNKED).spec
    assert spec.positive == ("chunk",)
    assert flashgen.compile(ALONE).spec.positive == ()
    assert "positive" not in ir.canonical_json(flashgen.compile(ROOT / "specs" / "causal.attn").spec)
    assert "positive" in ir.canonical_json(spec)


@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (13, 30), (30, 13), (64, 64)])
@pytest.mark.parametrize("n", [1, 4, 5, 16, 100])
def test_reference_matches_the_definition(nq, nk, n):
    with_causal = flashgen.compile(CHUNKED).spec
    keep = reference.keep_mask(with_causal, nq, nk, chunk=n)[0, 0]
    assert torch.equal(keep, definition(nq, nk, n, True))
    alone = flashgen.compile(ALONE.replace("chunked(5)", f"chunked({n})")).spec
    assert torch.equal(reference.keep_mask(alone, nq, nk)[0, 0], definition(nq, nk, n, False))


@pytest.mark.parametrize("text", [CHUNKED, ALONE])
def test_key_range_is_the_chunk(text):
    spec = flashgen.compile(text).spec
    rng = keyrange.key_range(spec)
    assert rng.exact and variant.hook_bodies(spec)["row_exact"]
    for nq, nk, n in [(20, 20, 4), (13, 31, 5), (31, 13, 6), (9, 9, 100)]:
        params = {"chunk": n} if spec.params else {}
        n = n if spec.params else 5
        lo, hi = ex.row_bounds(spec, nq, nk, 1, 1, params)
        q = torch.arange(nq)
        start = (q + nk - nq) // n * n
        assert torch.equal(lo[0, 0].clamp(min=0), start.clamp(0, nk))  # [start, start + n) ∩ [0, Nk)
        want_hi = start + n if not spec.params else torch.minimum(start + n, q + nk - nq + 1)
        assert torch.equal(hi[0, 0].clamp(max=nk), want_hi.clamp(max=nk))
        keep = reference.keep_mask(spec, nq, nk, **params)[0, 0]
        kv = torch.arange(nk)
        assert torch.equal((kv >= lo[0, 0].view(-1, 1)) & (kv < hi[0, 0].view(-1, 1)), keep)


def test_explain_counts_the_chunks():
    rep = ex.explain(CHUNKED, 1000, head_dim=64, arch="sm_90a", params={"chunk": 128})
    # causal within chunks of 128: 7 full chunks of 128·129/2 pairs, one of 104·105/2
    assert rep.visible_pairs == 7 * 128 * 129 // 2 + 104 * 105 // 2
    assert rep.model.startswith("key ranges")


def test_chunk_size_below_one_is_an_error_at_call_time():
    op = flashgen.compile(CHUNKED)
    q = torch.randn(1, 1, 8, 16)
    for bad in (0, -4):
        with pytest.raises(ValueError, match=r"^chunk: .* out of range"):
            op(q, q, q, chunk=bad)
        with pytest.raises(ValueError, match=r"^chunk: "):
            reference.attention(op.spec, q, q, q, chunk=bad)
        with pytest.raises(ValueError, match=r"chunk: "):
            ex.explain(op, 64, head_dim=16, device="cpu", params={"chunk": bad})


# ---------------------------------------------------------------- the CPU kernels


@pytest.fixture(scope="module")
def chunked_op():
    op = flashgen.compile(CHUNKED)
    op.build("cpu", ["fp32"])
    return op


@pytest.mark.parametrize("nq,nk,n,hkv", [(100, 100, 32, 2), (100, 100, 7, 1), (77, 130, 16, 2), (130, 60, 25, 2),
                                         (64, 64, 1, 2), (50, 50, 4096, 2)])
def test_cpu_forward_backward_against_float64(chunked_op, nq, nk, n, hkv):
    g = torch.Generator().manual_seed(n + nq)
    B, H, d = 2, 4, 32
    q = torch.randn(B, H, nq, d, generator=g)
    k, v = (torch.randn(B, hkv, nk, d, generator=g) for _ in range(2))
    dout = torch.randn(B, H, nq, d, generator=g)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = chunked_op(qq, kk, vv, return_lse=True, chunk=n)
    cmp = check.compare(chunked_op.spec, q, k, v, out.detach(), lse.detach(), chunk=n)
    assert cmp.ok, f"forward nq={nq} nk={nk} n={n}: {cmp}"
    out.backward(dout)
    gc = check.compare_grads(chunked_op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), params={"chunk": n})
    assert gc.ok, f"backward nq={nq} nk={nk} n={n}: {gc}"


def test_cpu_block_mask_from_the_spec(chunked_op):
    bm = flashgen.block_mask(chunked_op, 256, 256, block_size=64, device="cpu", chunk=128)
    dense = bm.to_dense()[0, 0]
    # blocks of 64 in chunks of 128: the diagonal blocks partial (1), the one below it in the same
    # chunk full (2), every block of another chunk empty (0)
    want = torch.tensor([[1, 0, 0, 0], [2, 1, 0, 0], [0, 0, 1, 0], [0, 0, 2, 1]], dtype=dense.dtype)
    assert torch.equal(dense, want)
    q = torch.randn(1, 2, 256, 32)
    out, lse = chunked_op(q, q, q, chunk=128, block_mask=bm, return_lse=True)
    assert check.compare(chunked_op.spec, q, q, q, out, lse, chunk=128).ok


# ---------------------------------------------------------------- CUDA, compile only

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_rendered_cuda_compiles_for_sm90a(tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what a real build adds

    spec = flashgen.compile(CHUNKED).spec
    inst = families.get("sm80").instantiation(spec, "sm_90a", ir.DType.BF16, 64)
    src = tmp_path / "k.cu"
    src.write_text(inst.sources()[inst.source_name("fwd")])
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS,
           "-gencode=arch=compute_90a,code=sm_90a", "-I", str(ROOT / "templates" / "include"),
           "-o", str(tmp_path / "k.o"), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
