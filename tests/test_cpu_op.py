"""The CPU family end to end: spec → build → op, against the float64 reference."""


import pytest
import torch

import flashgen
from flashgen import check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def inputs(b, hq, hkv, nq, nk, d, dtype, seed, transposed=False):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # [B, N, H, d] storage seen as [B, H, N, d]: strided, last dim contiguous
        q = torch.randn(b, nq, hq, d, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(b, nk, hkv, d, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(b, nk, hkv, d, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
        k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
        v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    return q, k, v


def run_and_check(op, q, k, v, **kw):
    out, lse = op(q, k, v, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    cmp = check.compare(op.spec, q, k, v, out, lse, scale=kw.get("scale"))
    assert cmp.ok, str(cmp)
    return out, lse


SEQLENS = [(1, 1), (7, 7), (1, 129), (129, 1), (127, 300), (300, 127), (257, 257)]
CASES = [
    # (hq, hkv, d, dtype, transposed)
    (4, 4, 64, "fp32", False),
    (4, 4, 32, "bf16", False),
    (8, 2, 128, "bf16", True),
    (4, 1, 64, "fp16", False),
    (3, 3, 32, "fp32", True),
]


@pytest.mark.parametrize("mask", ["dense", "causal", "top_left"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}-d{c[2]}-{c[3]}{'-T' if c[4] else ''}")
def test_against_reference(mask, case, dense_op, causal_op, top_left_op):
    op = {"dense": dense_op, "causal": causal_op, "top_left": top_left_op}[mask]
    hq, hkv, d, dt, transposed = case
    for i, (nq, nk) in enumerate(SEQLENS):
        q, k, v = inputs(2, hq, hkv, nq, nk, d, DTYPES[dt], seed=i, transposed=transposed)
        run_and_check(op, q, k, v)


@pytest.mark.parametrize("d", [8, 16, 40, 96, 256])
def test_other_head_dims(d, causal_op):
    q, k, v = inputs(1, 2, 1, 65, 70, d, torch.bfloat16, seed=d)
    run_and_check(causal_op, q, k, v)


@pytest.mark.parametrize("nq, nk", [(0, 5), (5, 0), (0, 0)])
def test_zero_lengths(nq, nk, dense_op, causal_op):
    for op in (dense_op, causal_op):
        q, k, v = inputs(2, 2, 2, nq, nk, 32, torch.float32, seed=0)
        out, lse = op(q, k, v, return_lse=True)
        assert out.shape == (2, 2, nq, 32)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()


def test_empty_batch(dense_op):
    q, k, v = inputs(0, 2, 2, 5, 5, 32, torch.float32, seed=0)
    out, lse = dense_op(q, k, v, return_lse=True)
    assert out.shape == (0, 2, 5, 32) and lse.shape == (0, 2, 5)


def test_causal_more_queries_than_keys_gives_empty_rows(causal_op):
    q, k, v = inputs(1, 2, 2, 48, 16, 64, torch.bfloat16, seed=3)
    out, lse = run_and_check(causal_op, q, k, v)
    assert torch.equal(out[:, :, :32], torch.zeros_like(out[:, :, :32]))
    assert torch.isneginf(lse[:, :, :32]).all() and torch.isfinite(lse[:, :, 32:]).all()


def test_masked_keys_holding_nan_do_not_leak(causal_op):
    """NaN/inf in K at keys a row may not see never reach that row (masking is by selection)."""
    q, k, v = inputs(1, 2, 2, 100, 100, 32, torch.float32, seed=4)
    k2 = k.clone()
    k2[:, :, 40:] = float("nan")  # keys 40.. are invisible to rows < 40
    k2[:, :, 41, 3] = float("inf")
    assert torch.equal(causal_op(q, k2, v)[:, :, :40], causal_op(q, k, v)[:, :, :40])


def test_memory_past_seqlen_is_never_read(dense_op):
    """K/V views whose storage continues with NaN past seqlen_k: bitwise the clean result."""
    q, k, v = inputs(1, 2, 2, 70, 130, 64, torch.bfloat16, seed=13)
    big_k = torch.full((1, 2, 200, 64), float("nan"), dtype=torch.bfloat16)
    big_v = big_k.clone()
    big_k[:, :, :130], big_v[:, :, :130] = k, v
    assert torch.equal(dense_op(q, big_k[:, :, :130], big_v[:, :, :130]), dense_op(q, k, v))


def test_large_negative_scores_stay_finite(dense_op):
    """A row whose scores are all far below zero still normalises (no 0 output, no sentinel)."""
    q, k, v = inputs(1, 1, 1, 8, 16, 16, torch.float32, seed=5)
    out, lse = dense_op(q, k - 1e4 * q.mean(), v, return_lse=True, scale=100.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    cmp = check.compare(dense_op.spec, q, k - 1e4 * q.mean(), v, out, lse, scale=100.0)
    assert cmp.ok, str(cmp)


def test_scale_override(dense_op):
    q, k, v = inputs(1, 2, 2, 33, 40, 64, torch.float32, seed=6)
    run_and_check(dense_op, q, k, v, scale=0.05)


def test_expanded_kv_stride_zero(dense_op):
    q, _, _ = inputs(3, 2, 2, 20, 20, 32, torch.float32, seed=7)
    k1, v1 = torch.randn(1, 2, 21, 32), torch.randn(1, 2, 21, 32)
    k, v = k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1)
    out = run_and_check(dense_op, q, k, v)[0]
    torch.testing.assert_close(out, dense_op(q, k.contiguous(), v.contiguous()), rtol=0, atol=0)


def test_output_keeps_q_layout(dense_op):
    q, k, v = inputs(2, 4, 4, 16, 16, 32, torch.float32, seed=8, transposed=True)
    out = dense_op(q, k, v)
    assert out.stride() == q.stride()


# ---------------------------------------------------------------- errors before launch


def error(op, exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        op(*args, **kw)


def test_input_errors_name_the_argument(dense_op):
    q, k, v = inputs(1, 4, 2, 8, 8, 32, torch.float32, seed=0)
    error(dense_op, TypeError, "^q: expected a torch.Tensor", q.numpy(), k, v)
    error(dense_op, ValueError, r"^k: expected 4 dims \[batch, kv_heads, seqlen_k, head_dim\]", q, k[0], v)
    error(dense_op, ValueError, "^v: dtype torch.float16 differs from q's torch.float32", q, k, v.half())
    error(dense_op, ValueError, "^q: dtype torch.float64 is not supported", q.double(), k.double(), v.double())
    error(dense_op, ValueError, "^k: batch 2 differs", q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    error(dense_op, ValueError, r"^v: shape \(1, 2, 9, 32\) differs", q, k, torch.randn(1, 2, 9, 32))
    error(dense_op, ValueError, "^k: head_dim 40 differs from q's 32", q, torch.randn(1, 2, 8, 40),
          torch.randn(1, 2, 8, 40))
    error(dense_op, ValueError, "^k: 3 kv heads do not divide 4 query heads", q, torch.randn(1, 3, 8, 32),
          torch.randn(1, 3, 8, 32))
    q12 = torch.randn(1, 4, 8, 12)
    error(dense_op, ValueError, "^q: head_dim 12 is not supported", q12, torch.randn(1, 2, 8, 12),
          torch.randn(1, 2, 8, 12))
    qs = torch.randn(1, 4, 32, 8).transpose(2, 3)  # [1,4,8,32] with last-dim stride 8
    error(dense_op, ValueError, "^q: last dim must be contiguous", qs, k, v)
    error(dense_op, ValueError, "^scale: expected a finite float", q, k, v, scale=float("nan"))
    error(dense_op, TypeError, r"^scale: expected a float, got Tensor \(pass float\(scale\)", q, k, v,
          scale=torch.tensor(0.5))
    error(dense_op, TypeError, "^scale: expected a float, got str", q, k, v, scale="0.5")
    import numpy as np

    for s in (np.float32(0.25), np.int64(2)):  # NumPy scalars are the numbers they hold
        torch.testing.assert_close(dense_op(q, k, v, scale=s), dense_op(q, k, v, scale=float(s)), rtol=0, atol=0)
    error(dense_op, ValueError, "^dropout_p=0.1: spec 'dense' declares no dropout; add a line `dropout`", q, k, v,
          dropout_p=0.1)
    error(dense_op, TypeError, "^block_mask: expected a flashgen.BlockMask", q, k, v, block_mask=object())
    error(dense_op, ValueError, "^cu_seqlens_k: required with cu_seqlens_q", q, k, v,
          cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    error(dense_op, TypeError, "^unknown parameter 'window'", q, k, v, window=3)
    error(dense_op, ValueError, "^k: on meta but q is on cpu", q, k.to("meta"), v.to("meta"))
    long = torch.zeros(1, 1, 1, 32).expand(1, 1, (1 << 30) + 1, 32)  # stride 0: nothing allocated
    error(dense_op, ValueError, r"^k: sequence length 1073741825 exceeds the kernels' limit of 2\^30", q[:, :1],
          long, long)


def test_spec_restrictions_apply():
    op = flashgen.compile("attention r {\n  head_dim 64\n  dtype bf16\n}\n")
    q = torch.randn(1, 1, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim 32 is not supported by spec 'r' on cpu \(expected one of 64\)"):
        op(q, q, q)
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match=r"dtype torch.float32 is not supported by spec 'r' on cpu \(expected "
                       r"one of: bfloat16\)"):
        op(q, q, q)


# ---------------------------------------------------------------- torch integration


def test_opcheck(causal_op):
    q, k, v = inputs(2, 4, 2, 19, 23, 32, torch.float32, seed=9)
    torch.library.opcheck(causal_op.torch_op, (q, k, v, 0.2, False))


def test_torch_compile_fullgraph(causal_op):
    q, k, v = inputs(1, 2, 2, 33, 33, 32, torch.float32, seed=10)
    fn = torch.compile(lambda q, k, v: causal_op(q, k, v, return_lse=True), fullgraph=True, backend="aot_eager")
    out, lse = fn(q, k, v)
    ref_out, ref_lse = causal_op(q, k, v, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_dynamic_shapes_do_not_recompile(causal_op):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v: causal_op(q, k, v), backend=counter, dynamic=True, fullgraph=True)
    for n in (17, 40, 65, 130):
        q, k, v = inputs(1, 2, 2, n, n + 3, 32, torch.float32, seed=n)
        torch.testing.assert_close(fn(q, k, v), causal_op(q, k, v), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_deterministic_forward_is_bitwise_repeatable(causal_op):
    q, k, v = inputs(2, 4, 4, 200, 300, 64, torch.bfloat16, seed=12)
    a = causal_op(q, k, v, deterministic=True)
    b = causal_op(q, k, v, deterministic=True)
    assert torch.equal(a, b)


def test_same_spec_compiles_to_same_op():
    a = flashgen.compile("attention same { mask = causal }")
    b = flashgen.compile("attention same {\n    mask = causal  # reformatted\n}")
    assert a is b and a.name.startswith("flashgen::same_")

