"""Packed (varlen) batches: q [total_q, Hq, d], k and v [total_k, Hkv, d] with cu_seqlens_q /
cu_seqlens_k (flash_attn's varlen interface). Forward and backward against the float64 reference
(each sequence on its own) and the padded op run per sequence; masks, score modifications,
parameters (and their gradients) and dropout per sequence; zero-length sequences; the metadata
checks; torch integration. The CUDA cases (marked gpu) run where the CUDA family takes packed
batches (flashgen.ops.VARLEN_BACKENDS) and check the NotImplementedError where it does not."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from variant_cases import EQUAL_SEQLENS_ONLY, EXAMPLES, alibi_slopes, op
from varlen_cases import cu_seqlens, inputs, run_case

from flashgen import families, ops, reference

# Kernels these tests run, as other test modules build them too (the CPU family takes the head
# dim at run time, so one build per (spec, dtype) serves every head dim): no extra compile in CI.
BUILDS = [(n, ["fp32", "bf16"] if n in ("alibi", "softcap", "bias", "relative_bias", "gemma") else ["fp32"])
          for n in EXAMPLES] + [("causal", ["fp32", "bf16", "fp16"]), ("dense", ["fp32", "bf16"]),
                                ("dropout", ["fp32", "bf16"])]


@pytest.fixture(scope="module", autouse=True)
def _built():
    with ThreadPoolExecutor(len(BUILDS)) as pool:
        list(pool.map(lambda b: op(b[0]).build("cpu", b[1]), BUILDS))


# ---------------------------------------------------------------- CPU: against the reference

# Zero-length sequences (queries, keys, both), length 1, lengths that are not tile multiples,
# seqlen_q != seqlen_k per sequence in both directions.
LENS_Q = [1, 0, 300, 37, 129, 0, 64]
LENS_K = [1, 5, 300, 0, 200, 0, 17]


def test_causal_mixed_lengths_gqa():
    run_case("causal", LENS_Q, LENS_K, 4, 2, 64, torch.float32, seed=1, dlse=True)


def test_long_sequences_fp32():
    """The lengths [1, 0, 1000, 37, 512]: several query and key tiles per sequence."""
    run_case("causal", [1, 0, 1000, 37, 512], [1, 0, 1000, 37, 512], 2, 1, 32, torch.float32, seed=2)


def test_many_more_queries_than_keys_causal():
    """Bottom-right causal with seqlen_q >> seqlen_k: the first rows of a sequence see no key."""
    run_case("causal", [200, 64, 1, 33], [7, 0, 1, 32], 4, 4, 32, torch.float32, seed=3)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)], ids=["gqa4to1", "mqa"])
def test_gqa_and_mqa(hq, hkv):
    run_case("causal", [65, 0, 130, 1], [70, 3, 130, 9], hq, hkv, 32, torch.float32, seed=hq + hkv)


def test_decode_shaped():
    """One query per sequence against many keys (and a sequence without keys)."""
    run_case("causal", [1, 1, 1, 1, 1], [100, 0, 37, 512, 1], 8, 2, 64, torch.float32, seed=4)
    run_case("dense", [1, 1, 1], [300, 1, 65], 4, 1, 128, torch.bfloat16, seed=5)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_specs(name):
    """Every example spec: masks and scores see per-sequence positions and lengths, batch-shaped
    parameters index by sequence, float parameters get their gradients."""
    lq, lk = [33, 0, 140, 1, 70], [50, 4, 100, 1, 0]
    if name in EQUAL_SEQLENS_ONLY:
        lk = lq
    d = (32, 40, 64, 72, 96)[EXAMPLES.index(name) % 5]
    run_case(name, lq, lk, 4, 2, d, torch.float32, seed=EXAMPLES.index(name), variant=EXAMPLES.index(name))


@pytest.mark.parametrize("name,variant", [("bias", 1), ("bias", 3), ("relative_bias", 1), ("key_padding", 1)])
def test_parameter_shapes(name, variant):
    """Broadcast bias dims ([1, heads, ...], [1, 1, ...]) and the other settings of make_params."""
    run_case(name, [20, 0, 45], [30, 8, 45], 2, 2, 32, torch.float32, seed=variant, variant=variant)


@pytest.mark.parametrize("name", ["alibi", "softcap", "bias", "gemma"])
def test_example_specs_bf16(name):
    run_case(name, [100, 0, 17, 1], [100, 9, 130, 1], 4, 1, 64, torch.bfloat16, seed=7, variant=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dtypes(dtype):
    run_case("causal", [70, 0, 1, 129], [70, 2, 1, 100], 4, 2, 64, dtype, seed=8, dlse=True)


@pytest.mark.parametrize("d", [48, 88, 128, 200, 256])
def test_head_dims(d):
    name = {48: "alibi", 88: "sliding_window", 128: "bias", 200: "gemma", 256: "softcap"}[d]
    run_case(name, [9, 40, 0], [17, 33, 2], 2, 1, d, torch.float32, seed=d, variant=d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropout(dtype):
    """The keep mask of (b, h, q, kv) uses the sequence index b and per-sequence positions."""
    run_case("dropout", [65, 0, 130, 1, 20], [65, 7, 100, 1, 0], 4, 2, 32, dtype, dropout_p=0.3, seed=9)


def test_dropout_mask_is_keyed_by_sequence():
    """A packed sequence b gets the mask of batch element b of a padded batch with the same
    lengths (the same (b, h, q, kv) keys), not that of batch element 0."""
    dop = op("dropout")
    q, k, v, _ = inputs([40, 40], [40, 40], 2, 2, 32, torch.float32, seed=10)
    cu = cu_seqlens([40, 40])
    out = dop(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.5, dropout_seed=3)
    padded = dop(*(t.view(2, 40, 2, 32).transpose(1, 2) for t in (q, k, v)), dropout_p=0.5, dropout_seed=3)
    torch.testing.assert_close(out.view(2, 40, 2, 32).transpose(1, 2), padded, rtol=0, atol=1e-6)
    first = dop(*(t[40:].view(1, 40, 2, 32).transpose(1, 2) for t in (q, k, v)), dropout_p=0.5, dropout_seed=3)
    assert not torch.allclose(out[40:], first[0].transpose(0, 1), atol=1e-3)


def test_alibi_slopes_and_bias_gradients():
    """Parameter gradients sum over the sequences (slopes [heads]) or land per sequence (bias
    [batch, heads, max_seqlen_q, max_seqlen_k])."""
    slopes = alibi_slopes(4, "cpu")
    run_case("alibi", [50, 1, 0, 90], [60, 1, 5, 90], 4, 2, 32, torch.float32, params={"slopes": slopes}, dlse=True)
    g = torch.Generator().manual_seed(11)
    bias = torch.randn(3, 2, 60, 70, generator=g)
    run_case("bias", [60, 0, 23], [70, 10, 0], 2, 2, 32, torch.float32, params={"bias": bias})


def test_max_seqlen_larger_than_needed():
    """max_seqlen_* is an upper bound: a larger one (and parameters shaped by it) changes nothing."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 3, (3, 80), generator=g).sort(-1).values.to(torch.int32)
    run_case("document", [30, 0, 64], [30, 0, 64], 2, 2, 32, torch.float32, params={"document_id": ids},
             max_seqlen=(80, 80))
    a = run_case("causal", [30, 5], [20, 50], 2, 2, 32, torch.float32, max_seqlen=(1000, 999), seed=13)
    b = run_case("causal", [30, 5], [20, 50], 2, 2, 32, torch.float32, seed=13)
    for x, y in zip(a[:2], b[:2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)


def test_max_seqlen_derived_when_none():
    c = op("causal")
    q, k, v, _ = inputs([10, 30], [30, 10], 2, 1, 32, torch.float32, seed=14)
    cq, ck = cu_seqlens([10, 30]), cu_seqlens([30, 10])
    a = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    b = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=30, max_seqlen_k=30)
    assert torch.equal(a, b)
    # a parameter shaped by a derived max_seqlen is checked against it
    doc = op("document")
    with pytest.raises(ValueError, match="^document_id: dim 1 has size 29, expected 30"):
        doc(q, q[:, :1], q[:, :1], cu_seqlens_q=cq, cu_seqlens_k=cq, document_id=torch.zeros(2, 29, dtype=torch.int32))


def test_zero_length_everywhere():
    """All queries empty (dk = dv = 0), all keys empty (out 0, lse -inf, dq = 0), nothing at all."""
    c = op("causal")
    for lq, lk in (([0, 0], [3, 4]), ([3, 4], [0, 0]), ([0, 0, 0], [0, 0, 0])):
        q, k, v, dout = inputs(lq, lk, 2, 2, 32, torch.float32, seed=15)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = c(qq, kk, vv, cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, sum(lq))
        assert (out == 0).all() and torch.isneginf(lse).all()
        out.backward(dout)
        for t in (qq, kk, vv):
            assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_unseen_keys_get_exact_zero_gradients_and_never_leak():
    """Keys past kv_len[b] (NaN in them) reach no output and get exactly zero gradients."""
    kp = op("key_padding")
    lq, lk = [20, 33, 7], [25, 40, 9]
    q, k, v, dout = inputs(lq, lk, 2, 1, 32, torch.float32, seed=16)
    kv_len = torch.tensor([10, 40, 0], dtype=torch.int32)
    ck = cu_seqlens(lk).tolist()
    for b, n in enumerate(kv_len.tolist()):
        k[ck[b] + n:ck[b + 1]] = float("nan")
        v[ck[b] + n:ck[b + 1]] = float("nan")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = kp(qq, kk, vv, cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), kv_len=kv_len)
    assert not out.isnan().any()
    out.backward(dout)
    assert not qq.grad.isnan().any()
    unseen = torch.cat([torch.arange(ck[b] + n, ck[b + 1]) for b, n in enumerate(kv_len.tolist())])
    assert (kk.grad[unseen] == 0).all() and (vv.grad[unseen] == 0).all()
    assert not kk.grad.isnan().any() and not vv.grad.isnan().any()


def test_strided_views_of_a_packed_qkv_tensor():
    """q, k, v as views of one [total, 3, H, d] tensor (no copies) and a strided cu_seqlens."""
    c = op("causal")
    lens = [17, 0, 40]
    g = torch.Generator().manual_seed(17)
    qkv = torch.randn(57, 3, 2, 32, generator=g)
    q, k, v = qkv.unbind(1)
    cu = cu_seqlens(lens)
    strided = torch.stack([cu, torch.full_like(cu, -1)], 1)[:, 0]  # stride 2
    out = c(q, k, v, cu_seqlens_q=strided, cu_seqlens_k=strided)
    ref = reference.attention(c.spec, q.double(), k.double(), v.double(), cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_deterministic_and_bitwise_repeatable():
    c = op("causal")
    lq, lk = [100, 3, 0, 250], [80, 3, 9, 250]
    q, k, v, dout = inputs(lq, lk, 4, 2, 64, torch.float32, seed=18)
    kw = {"cu_seqlens_q": cu_seqlens(lq), "cu_seqlens_k": cu_seqlens(lk), "deterministic": True}
    first = None
    for _ in range(3):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = c(qq, kk, vv, **kw)
        out.backward(dout)
        got = (out.detach(), qq.grad, kk.grad, vv.grad)
        if first is None:
            first = got
        assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))


# ---------------------------------------------------------------- metadata errors


def _meta_inputs():
    q, k, v, _ = inputs([3, 5], [4, 6], 2, 1, 32, torch.float32, seed=19)
    return q, k, v, cu_seqlens([3, 5]), cu_seqlens([4, 6])


def test_validated_layout_is_reused_until_cu_seqlens_change(monkeypatch):
    """A model passes one cu_seqlens tensor to every attention layer: the layout is validated
    once per tensor and version (the host copy is not repeated), and an in-place write to the
    tensor, which bumps its version, is validated again (so it cannot slip past the checks)."""
    from flashgen.runtime import checks

    c = op("causal")
    lens = [5, 0, 9, 3]
    q, k, v, _ = inputs(lens, lens, 2, 2, 16, torch.float32, seed=3)
    cq, ck = cu_seqlens(lens), cu_seqlens(lens)
    calls = []
    real = checks._validate_packed
    monkeypatch.setattr(checks, "_validate_packed", lambda *a: calls.append(1) or real(*a))
    first = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    again = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert len(calls) == 1 and torch.equal(first, again)
    c(q, k, v, cu_seqlens_q=cq.clone(), cu_seqlens_k=ck)  # another tensor: validated
    assert len(calls) == 2
    cq[2] = 100  # in place (the version counter moves): validated again, and refused
    with pytest.raises(ValueError, match="^cu_seqlens_q: must be non-decreasing"):
        c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert len(calls) == 3


def test_validated_layouts_hold_no_cu_seqlens_alive(monkeypatch):
    """The memo of validated layouts holds the cu_seqlens tensors weakly: after a call they are
    freed as soon as the caller drops them (a tensor of a CUDA graph's memory pool must not be
    kept alive), while they live a repeated call still reuses the validation (no second host
    copy), and a tensor written in place is validated again."""
    import gc
    import weakref

    from flashgen.runtime import checks

    c = op("causal")
    lens = [4, 7, 0, 2]
    q, k, v, _ = inputs(lens, lens, 2, 2, 16, torch.float32, seed=4)
    cq, ck = cu_seqlens(lens), cu_seqlens(lens)
    calls = []
    real = checks._validate_packed
    monkeypatch.setattr(checks, "_validate_packed", lambda *a: calls.append(1) or real(*a))
    first = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    again = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert len(calls) == 1 and torch.equal(first, again)  # the memo's hit
    ck.add_(0)  # an in-place write bumps the version: validated again
    c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert len(calls) == 2
    refs = [weakref.ref(cq), weakref.ref(ck)]
    del cq, ck
    gc.collect()
    assert all(r() is None for r in refs), "the memo keeps the cu_seqlens tensors alive"
    # new tensors (their ids may be the freed ones') are validated: an id alone never hits
    cq, ck = cu_seqlens(lens), cu_seqlens(lens)
    torch.testing.assert_close(c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck), first, rtol=0, atol=0)
    assert len(calls) == 3


def test_metadata_errors_name_the_argument():
    c = op("causal")
    q, k, v, cq, ck = _meta_inputs()

    def error(exc, pattern, q=q, k=k, v=v, raw_op=True, **kw):
        kw = {"cu_seqlens_q": cq, "cu_seqlens_k": ck} | kw
        kw = {n: x for n, x in kw.items() if x is not None}
        with pytest.raises(exc, match=pattern):
            c(q, k, v, **kw)
        if exc is ValueError and raw_op:  # the raw op checks them before its kernel runs too
            raw = {n: kw.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
            with pytest.raises(exc, match=pattern):
                c.torch_op(q, k, v, 0.5, False, **raw)

    error(ValueError, "^cu_seqlens_k: required with cu_seqlens_q", cu_seqlens_k=None)
    error(ValueError, "^cu_seqlens_q: required with cu_seqlens_k", cu_seqlens_q=None)
    error(TypeError, "^cu_seqlens_q: expected an int32 tensor", cu_seqlens_q=[0, 3, 8])
    error(ValueError, "^cu_seqlens_k: dtype torch.int64, expected torch.int32", cu_seqlens_k=ck.long())
    error(ValueError, r"^cu_seqlens_q: expected 1 dim \[batch \+ 1\]", cu_seqlens_q=cq.view(1, 3))
    error(ValueError, r"^cu_seqlens_q: expected 1 dim \[batch \+ 1\] with at least 2 entries", cu_seqlens_q=cq[:1],
          cu_seqlens_k=ck[:1])
    # (a meta tensor sends the raw op to its fake implementation)
    error(ValueError, "^cu_seqlens_k: on meta but q is on cpu", cu_seqlens_k=ck.to("meta"), raw_op=False)
    error(ValueError, "^cu_seqlens_k: 4 entries but cu_seqlens_q has 3",
          cu_seqlens_k=torch.tensor([0, 4, 10, 10], dtype=torch.int32))
    error(ValueError, "^cu_seqlens_q: must start at 0, got 1", cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32))
    error(ValueError, r"^cu_seqlens_k: must be non-decreasing, but entry 2 \(3\) < entry 1 \(4\)",
          cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32))
    error(ValueError, r"^cu_seqlens_q: last entry 7 differs from total_q = q.shape\[0\] \(8\)",
          cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32))
    error(ValueError, r"^cu_seqlens_k: last entry 9 differs from total_k", cu_seqlens_k=torch.tensor([0, 4, 9],
                                                                                                    dtype=torch.int32))
    error(ValueError, r"^max_seqlen_q: 4 is less than the longest sequence in cu_seqlens_q \(5, sequence 1\)",
          max_seqlen_q=4)
    error(ValueError, r"^max_seqlen_k: 5 is less than the longest", max_seqlen_k=5)
    error(ValueError, r"^max_seqlen_k: 1073741825 is out of range", max_seqlen_k=2**30 + 1)
    error(ValueError, r"^max_seqlen_q: -1 is out of range", max_seqlen_q=-1)
    with pytest.raises(TypeError, match="^max_seqlen_q: expected None or an int, got float"):
        c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5.0)
    with pytest.raises(ValueError, match="^max_seqlen_q: given without cu_seqlens_q and cu_seqlens_k"):
        c(q.view(1, 8, 2, 32), k.view(1, 10, 1, 32), v.view(1, 10, 1, 32), max_seqlen_q=5)
    # the layout: rank 3 with cu_seqlens, rank 4 without
    with pytest.raises(ValueError, match=r"^q: expected 3 dims \[total_q, heads, head_dim\] with cu_seqlens_q"):
        c(q.unsqueeze(0), k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match=r"^k: expected 3 dims \[total_k, kv_heads, head_dim\]"):
        c(q, k.unsqueeze(0), v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(ValueError, match=r"^q: expected 4 dims .* \(or 3 dims with cu_seqlens_q and cu_seqlens_k"):
        c(q, k, v)
    with pytest.raises(ValueError, match="^k: head_dim 40 differs from q's 32"):
        c(q, torch.randn(10, 1, 40), torch.randn(10, 1, 40), cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(TypeError, match="^block_mask: expected a flashgen.BlockMask"):
        c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, block_mask=object())
    # numpy-style integral max_seqlen values are ints
    import numpy as np

    c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=np.int64(5), max_seqlen_k=np.int32(6))


def test_batch_shaped_parameter_is_per_sequence():
    kp = op("key_padding")
    q, k, v, cq, ck = _meta_inputs()
    with pytest.raises(ValueError, match=r"^kv_len: dim 0 has size 3, expected 2"):
        kp(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, kv_len=torch.ones(3, dtype=torch.int32))


def test_families_without_varlen_raise(monkeypatch, request):
    """A family outside VARLEN_BACKENDS raises NotImplementedError naming cu_seqlens_q."""
    c = op("causal")
    q, k, v, cq, ck = _meta_inputs()
    from flashgen import families

    cpu = families.get("cpu")
    monkeypatch.setattr(cpu, "features", cpu.features - {"varlen"})
    ops.invalidate_libraries()
    request.addfinalizer(ops.invalidate_libraries)
    with pytest.raises(NotImplementedError, match="^cu_seqlens_q: packed .* not implemented for CPU"):
        c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(NotImplementedError, match="^cu_seqlens_q"):
        c.torch_op(q, k, v, 0.5, False, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_kernel_refuses_inconsistent_metadata():
    """The CPU kernels re-check the metadata they index by (FG_ERR_BAD_SHAPE, never a stray read)."""
    import ctypes

    from flashgen.abi import FgFwdArgs
    from flashgen.lang import ir

    c = op("causal")
    q, k, v, cq, ck = _meta_inputs()
    lib = c.library(families.get("cpu"), q.device, ir.DType.FP32, 32)
    out, lse = torch.empty_like(q), torch.empty(2, 8)
    bad = torch.tensor([0, 6, 8], dtype=torch.int32)  # sequence 0 longer than max_seqlen_q = 5
    args = FgFwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 2, 2, 1, 5, 6, 32,
                     0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
                     0, out.stride(1), out.stride(0), 0.5, 0, None, None)
    args.cu_seqlens_q, args.cu_seqlens_k, args.total_q, args.total_k = bad.data_ptr(), ck.data_ptr(), 8, 10
    assert lib.fwd(ctypes.byref(args)) == 5  # FG_ERR_BAD_SHAPE
    args.cu_seqlens_q = cq.data_ptr()
    assert lib.fwd(ctypes.byref(args)) == 5  # the tiles (tile_q, tile_kv) are the host's to set: 0 is refused
    c.launch_fields(lib).fwd(args, ())
    assert (args.tile_q, args.tile_kv) != (0, 0) and lib.fwd(ctypes.byref(args)) == 0


# ---------------------------------------------------------------- torch integration


def test_opcheck_and_torch_compile():
    c = op("causal")
    lq, lk = [3, 0, 17, 9, 2], [5, 2, 17, 1, 0]
    q, k, v, _ = inputs(lq, lk, 2, 1, 32, torch.float32, seed=20)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    torch.library.opcheck(c.torch_op, (q, k, v, 0.2, False),
                          {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": 17, "max_seqlen_k": 17})
    torch.library.opcheck(c.torch_op, (q, k, v, 0.2, False), {"cu_seqlens_q": cq, "cu_seqlens_k": ck})
    fn = torch.compile(lambda q, k, v, cq, ck: c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True),
                       fullgraph=True, backend="aot_eager")
    out, lse = fn(q, k, v, cq, ck)
    want = c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_changing_lengths_do_not_recompile():
    from torch._dynamo.testing import CompileCounter

    c = op("causal")
    torch._dynamo.reset()
    counter = CompileCounter()

    def call(q, k, v, cq, ck, mq, mk):
        return c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)

    fn = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
    # (sizes and ints chosen unequal: dynamo would otherwise tie them together, "duck sizing")
    for lq, lk in (([3, 0, 17, 6, 7], [5, 2, 19, 1, 30]), ([30, 1, 7, 2, 9], [5, 20, 7, 8, 1]),
                   ([9, 9, 1, 1, 50], [1, 40, 2, 2, 3])):
        q, k, v, dout = inputs(lq, lk, 2, 1, 32, torch.float32, seed=sum(lq))
        qq = q.clone().requires_grad_()
        cq, ck = cu_seqlens(lq), cu_seqlens(lk)
        out = fn(qq, k, v, cq, ck, max(lq), max(lk))
        assert torch.equal(out, c(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck))
        out.backward(dout)
    assert counter.frame_count == 1


# ---------------------------------------------------------------- CUDA (marked gpu)

GPU_LENS = ([1, 0, 1000, 37, 512], [1, 7, 1000, 0, 300])


def _cuda_varlen() -> bool:
    return "sm80" in ops.VARLEN_BACKENDS


@pytest.mark.gpu
def test_cuda_without_varlen_kernels_raises():
    if _cuda_varlen():
        pytest.skip("the CUDA family takes packed batches")
    c = op("causal")
    q, k, v, _ = inputs([3, 5], [4, 6], 2, 1, 64, torch.bfloat16, device="cuda")
    with pytest.raises(NotImplementedError, match="^cu_seqlens_q: packed .* not implemented for CUDA"):
        c(q, k, v, cu_seqlens_q=cu_seqlens([3, 5], "cuda"), cu_seqlens_k=cu_seqlens([4, 6], "cuda"))


# Every example spec in bf16 at head dims 64 and 128; fp16 (the other element type of the same
# kernels) on a subset, at 64, to keep the packed instantiations built here few.
FP16_NAMES = ("causal", "dense", "alibi", "sliding_window")


@pytest.fixture(scope="module")
def _cuda_built():
    if not _cuda_varlen():
        pytest.skip("the CUDA family does not take packed batches in this version (ops.VARLEN_BACKENDS)")
    jobs = [(n, "bf16", [64, 128]) for n in [*EXAMPLES, "causal", "dense", "dropout"]]
    jobs += [(n, "fp16", [64]) for n in [*FP16_NAMES, "dropout"]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: op(j[0]).build("cuda", [j[1]], j[2], layouts=("packed",), decode=False), jobs))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*EXAMPLES, "causal", "dense"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_examples(name, dtype, _cuda_built):
    lq, lk = GPU_LENS
    if name in EQUAL_SEQLENS_ONLY:
        lk = lq
    shapes = ((4, 2, 64), (8, 2, 128), (4, 1, 64))
    if dtype == torch.float16:
        if name not in FP16_NAMES:
            pytest.skip("fp16 runs on a subset of the specs (FP16_NAMES)")
        shapes = ((4, 2, 64), (4, 1, 64))
    for i, (hq, hkv, d) in enumerate(shapes):
        run_case(name, lq, lk, hq, hkv, d, dtype, device="cuda", seed=i, variant=i, dlse=i == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_shapes(dtype, _cuda_built):
    """Many more queries than keys (causal), decode-shaped, MQA, zero-length sequences."""
    d = 128 if dtype == torch.bfloat16 else 64
    run_case("causal", [700, 64, 1, 129], [7, 0, 1, 128], 8, 8, d, dtype, device="cuda", seed=1)
    run_case("causal", [1] * 9, [100, 0, 37, 512, 1, 4096, 65, 128, 129], 16, 2, d, dtype, device="cuda", seed=2)
    run_case("dense", [257, 0, 3], [1000, 5, 0], 8, 1, 64, dtype, device="cuda", seed=3)
    run_case("causal", [0, 0], [0, 5], 2, 2, 64, dtype, device="cuda", seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_dropout(dtype, _cuda_built):
    lq, lk = GPU_LENS
    run_case("dropout", lq, lk, 4, 2, 64, dtype, device="cuda", dropout_p=0.2, seed=5)
    run_case("dropout", lq, lk, 8, 2, 128 if dtype == torch.bfloat16 else 64, dtype, device="cuda",
             dropout_p=0.5, seed=6, dlse=True)


@pytest.mark.gpu
def test_cuda_deterministic_and_metadata_errors(_cuda_built):
    c = op("causal")
    lq, lk = GPU_LENS
    q, k, v, dout = inputs(lq, lk, 8, 2, 128, torch.bfloat16, device="cuda", seed=7)
    kw = {"cu_seqlens_q": cu_seqlens(lq, "cuda"), "cu_seqlens_k": cu_seqlens(lk, "cuda"), "deterministic": True}
    first = None
    for _ in range(3):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        c(qq, kk, vv, **kw).backward(dout)
        got = (qq.grad, kk.grad, vv.grad)
        if first is None:
            first = got
        assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))
    with pytest.raises(ValueError, match="^cu_seqlens_k: on cpu but q is on cuda"):
        c(q, k, v, cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_k=cu_seqlens(lk))
    with pytest.raises(ValueError, match="^cu_seqlens_q: must be non-decreasing"):
        c(q, k, v, cu_seqlens_q=torch.tensor([0, 1, 0, 1000, 1037, 1550], dtype=torch.int32, device="cuda"),
          cu_seqlens_k=kw["cu_seqlens_k"])



CUDA_HEAD_DIMS = (32, 72, 160, 256)  # with 64 and 128 above: both kernel tile classes, odd multiples of 8


@pytest.fixture(scope="module")
def _cuda_head_dims_built():
    if not _cuda_varlen():
        pytest.skip("the CUDA family does not take packed batches in this version (ops.VARLEN_BACKENDS)")
    jobs = [(d, "packed") for d in CUDA_HEAD_DIMS] + [(d, "padded") for d in (72, 160)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: op("causal").build("cuda", ["bf16"], [j[0]], layouts=(j[1],), decode=False), jobs))


@pytest.mark.gpu
@pytest.mark.parametrize("d", CUDA_HEAD_DIMS)
def test_cuda_head_dims(d, _cuda_head_dims_built):
    """Head dims across the supported range, packed (and padded where no other GPU test has them)."""
    run_case("causal", [1, 0, 300, 37], [5, 3, 300, 64], 4, 2, d, torch.bfloat16, device="cuda", seed=d)
    if d in (72, 160):
        from variant_cases import run_case as run_padded
        run_padded("causal", 2, 4, 2, 131, 300, d, torch.bfloat16, device="cuda", seed=d)


def test_reference_without_queries_keeps_autograd():
    """The float64 reference of a batch whose sequences have no query is still differentiable."""
    q = torch.randn(0, 4, 32, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 2, 32, dtype=torch.float64, requires_grad=True)
    out = reference.attention(op("causal"), q, k, k, cu_seqlens_q=cu_seqlens([0]),
                              cu_seqlens_k=cu_seqlens([7]))
    out.sum().backward()
    assert out.shape == (0, 4, 32) and k.grad is not None and (k.grad == 0).all()


def test_double_backward_and_raw_backward_inputs_are_refused():
    c = op("causal")
    lens = [5, 0, 12]
    q, k, v, dout = inputs(lens, lens, 4, 2, 32, torch.float32, seed=21)
    kw = {"cu_seqlens_q": cu_seqlens(lens), "cu_seqlens_k": cu_seqlens(lens)}
    qq = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="double backward"):  # not silent zeros
        torch.autograd.grad((c(qq, k, v, **kw) ** 2).sum(), qq, create_graph=True)
    for padded in (False, True):
        qs, ks, vs, ds = (t.transpose(0, 1)[None][:, :, :5] if padded else t for t in (q, k, v, dout))
        args = {} if padded else kw
        out, lse = c.torch_op(qs, ks, vs, 0.125, False, **args)
        bwd = getattr(torch.ops.flashgen, c.torch_op._schema.name.split("::")[1] + "_bwd")
        for bad, what in ((lse.double(), "lse"), (lse[..., :1], "lse"), (out.double(), "out"), (ds.double(), "dout")):
            a = [qs, ks, vs, out, lse, ds]
            a[{"out": 3, "lse": 4, "dout": 5}[what]] = bad
            with pytest.raises(ValueError, match=f"^{what}: expected"):
                bwd(*a, None, 0.125, False, [], **args)


def test_parameter_shape_errors_in_the_packed_layout():
    """Shape errors give the derived max_seqlen's value (the one validation runs after the packed
    layout is resolved); all-empty batches are told to pass one."""
    doc = op("document")
    cq = cu_seqlens([5, 0, 12])
    q, k, v, _ = inputs([5, 0, 12], [5, 0, 12], 4, 2, 32, torch.float32, seed=23)
    with pytest.raises(ValueError, match=r"^document_id: dim 0 has size 4, expected 3 \(\[batch, seqlen_k\] = \[3, 12\]"):
        doc(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=cq, document_id=torch.zeros(4, 12, dtype=torch.int32))
    q0, k0, v0, _ = inputs([0], [0], 4, 2, 32, torch.float32, seed=24)
    c0 = cu_seqlens([0])
    with pytest.raises(ValueError, match="pass max_seqlen_q / max_seqlen_k >= 1"):
        doc(q0, k0, v0, cu_seqlens_q=c0, cu_seqlens_k=c0, document_id=torch.zeros(1, 1, dtype=torch.int32))
    out = doc(q0, k0, v0, cu_seqlens_q=c0, cu_seqlens_k=c0, max_seqlen_q=1, max_seqlen_k=1,
              document_id=torch.zeros(1, 1, dtype=torch.int32))
    assert out.shape == q0.shape
