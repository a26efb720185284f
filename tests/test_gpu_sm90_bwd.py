"""The sm90 (Hopper) backward against the float64 reference, next to the sm80 backward in the
same process (gradient outputs poisoned with NaN before every launch: conftest's
poison_outputs). Every sm90 case forces the family with flashgen.use_family, so a backward call
the family does not serve raises instead of silently running on sm80; the module skips on
devices that are not compute capability 9.0. The sm90 backward serves every spec (masks, score
expressions, parameters and their gradients, dropout) at head dims 64 and 128, fp16/bf16, in the
padded and packed layouts, GQA/MQA included (with and without the group split), deterministic or
not; block-sparse calls run on sm80."""

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import dropout_cases
import variant_cases
from test_gpu import DTYPES, make  # the sm80 suite's inputs, reused

import flashgen
from flashgen import check

pytestmark = pytest.mark.gpu

# Sequence lengths on both sides of the 64-row query tiles and the 128-key tiles.
SEQLENS = [1, 17, 128, 200]
LAYOUTS = [(1, 1, 1, False), (3, 5, 5, True), (2, 3, 3, False), (1, 4, 4, True)]  # heads_q == heads_kv


@pytest.fixture(scope="module", autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on compute capability 9.0 only")


@pytest.fixture(scope="module")
def ops(dense_op, causal_op):
    all_ops = {"dense": dense_op, "causal": causal_op}
    with flashgen.use_family("sm90"), ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda op: op.build("cuda", None, [64, 128], decode=False), all_ops.values()))
    return all_ops


def grads_of(op, q, k, v, dout, family="sm90", **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with flashgen.use_family(family):
        assert op.family_for(q.device, q.dtype, q.shape[-1], backward=True).family.name == family
        op(q, k, v, **kw).backward(dout)
    return q.grad, k.grad, v.grad


def check_grads(op, q, k, v, dout, family="sm90", **kw):
    got = grads_of(op, q, k, v, dout, family, **kw)
    cmp = check.compare_grads(op.spec, q, k, v, dout, got)
    assert cmp.ok, f"{family} {op.name} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}: {cmp}"
    assert all(torch.isfinite(g).all() for g in got)
    return got


def test_sm90_serves_the_padded_backward(ops):
    for name in ("dense", "causal"):
        for d in (64, 128):
            for dt in (torch.float16, torch.bfloat16):
                assert ops[name].family_for("cuda", dt, d, backward=True).family.name == "sm90"
                assert ops[name].family_for("cuda", dt, d, backward=True, gqa=True).family.name == "sm90"
                for kw in ({"layout": "packed"}, {"sparse": True}):
                    assert ops[name].family_for("cuda", dt, d, backward=True, **kw).family.name == "sm90"
                # deterministic: served (the dQ writer orders each query tile's adds)
                assert ops[name].family_for("cuda", dt, d, backward=True,
                                            deterministic=True).family.name == "sm90"
    choice = ops["causal"].family_for("cuda", torch.bfloat16, 128, backward=True, sparse=True, deterministic=True)
    assert choice.family.name == "sm80" and choice.tried[0][0] == "sm90", choice.why()
    assert ops["causal"].family_for("cuda", torch.bfloat16, 256, backward=True).family.name == "sm80"


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradients_seqlen_cross_product(ops, mask, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(4000 + d)
    for i, (nq, nk) in enumerate(itertools.product(SEQLENS, SEQLENS)):
        b, h, _, transposed = LAYOUTS[i % len(LAYOUTS)]
        q, k, v = make(b, h, h, nq, nk, d, DTYPES[dtype], transposed, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
        g90 = check_grads(ops[mask], q, k, v, dout)
        g80 = grads_of(ops[mask], q, k, v, dout, family="sm80")
        for a, b_ in zip(g90, g80, strict=True):
            torch.testing.assert_close(a.float(), b_.float(), atol=3e-2, rtol=1.6e-2)  # bf16: one ulp at |g| ~ 4 is 0.03


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_gradients_larger_shapes(ops, mask):
    gen = torch.Generator(device="cuda").manual_seed(4100)
    shapes = [(1000, 1000), (1000, 333), (333, 1000), (2048, 2048), (1, 1000), (1000, 1)]
    for i, (nq, nk) in enumerate(shapes):
        d, dtype = (64, 128)[i % 2], (torch.bfloat16, torch.float16)[(i // 2) % 2]
        q, k, v = make(2, 4, 4, nq, nk, d, dtype, bool(i % 3 == 1), gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).to(dtype)
        check_grads(ops[mask], q, k, v, dout)


@pytest.mark.parametrize("d", [64, 128])
def test_rows_without_keys_get_zero_gradients(ops, d):
    gen = torch.Generator(device="cuda").manual_seed(4200 + d)
    q, k, v = make(2, 4, 4, 300, 100, d, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    dq, dk, dv = check_grads(ops["causal"], q, k, v, dout)
    assert torch.equal(dq[:, :, :200], torch.zeros_like(dq[:, :, :200]))


def test_gradient_through_lse(ops):
    gen = torch.Generator(device="cuda").manual_seed(4300)
    q, k, v = make(1, 4, 4, 200, 150, 64, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    dlse = torch.randn(q.shape[:3], device="cuda", generator=gen)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with flashgen.use_family("sm90"):
        out, lse = ops["causal"](qq, kk, vv, return_lse=True)
        ((out.float() * dout.float()).sum() + torch.where(torch.isfinite(lse), lse, 0.0).mul(dlse).sum()).backward()
    cmp = check.compare_grads(ops["causal"].spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), dlse=dlse)
    assert cmp.ok, str(cmp)


def test_unserved_backward_calls_run_on_sm80_or_raise_when_forced(ops):
    """Block lists with deterministic=True: the sm90 forward, then sm80's deterministic backward,
    bitwise repeatable; forced onto sm90 the backward raises."""
    gen = torch.Generator(device="cuda").manual_seed(4400)
    q, k, v = make(1, 4, 4, 300, 300, 128, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    bm = flashgen.BlockMask.from_pattern(torch.ones(1, 4, 3, 3, dtype=torch.bool, device="cuda").tril(), 128)
    runs = []
    for _ in range(2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        ops["causal"](qq, kk, vv, block_mask=bm, deterministic=True).backward(dout)
        runs.append((qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert check.compare_grads(ops["causal"].spec, q, k, v, dout, runs[0]).ok
    with flashgen.use_family("sm90"), pytest.raises(NotImplementedError, match="block lists"):
        ops["causal"](qq, kk, vv, block_mask=bm, deterministic=True).backward(dout)


# deterministic=True on the sm90 backward: each query tile's dQ adds in key-tile order behind a
# semaphore; bitwise repeatable, equal to the reference, within rounding of the default mode.
@pytest.mark.parametrize("name", ["causal", "dense", "sliding_window", "gemma", "document"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_on_the_sm90_backward(name, d):
    fop = variant_cases.op(name)
    gen = torch.Generator().manual_seed(4600 + d)
    for b, hq, hkv, n in [(2, 4, 2, 1000), (1, 8, 1, 257), (3, 2, 2, 64)]:
        q, k, v, dout = (torch.randn(b, h, n, d, generator=gen).bfloat16().cuda() for h in (hq, hkv, hkv, hq))
        params = variant_cases.make_params(name, b, hq, n, n, "cuda", gen)
        runs = []
        for det in (True, True, True, False):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            with flashgen.use_family("sm90"):
                fop(qq, kk, vv, deterministic=det, **params).backward(dout)
            runs.append((qq.grad, kk.grad, vv.grad))
        for other in runs[1:3]:
            assert all(torch.equal(a, b_) for a, b_ in zip(runs[0], other, strict=True)), f"{name} d{d} n{n}"
        cmp = check.compare_grads(fop.spec, q, k, v, dout, runs[0], params=params)
        assert cmp.ok, f"{name} d{d} b{b} h{hq}/{hkv} n{n}: {cmp}"
        for a, b_ in zip(runs[0], runs[3], strict=True):
            torch.testing.assert_close(a.float(), b_.float(), atol=2e-2, rtol=0)


def test_deterministic_packed_on_the_sm90_backward():
    import varlen_cases

    fop = variant_cases.op("causal")
    lens = [1, 0, 1000, 37, 512]
    cu = varlen_cases.cu_seqlens(lens, "cuda")
    q, k, v, dout = varlen_cases.inputs(lens, lens, 8, 2, 128, torch.bfloat16, device="cuda", seed=90)
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 1000, "max_seqlen_k": 1000, "deterministic": True}
    runs = []
    for _ in range(3):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with flashgen.use_family("sm90"):
            fop(qq, kk, vv, **kw).backward(dout)
        runs.append((qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
    c = cu.tolist()
    for b in range(len(lens)):
        seq = [varlen_cases.sequence(t, c, b) for t in (q, k, v, dout)]
        grads = tuple(varlen_cases.sequence(g, c, b) for g in runs[0])
        cmp = check.compare_grads(fop.spec, *seq, grads)
        assert cmp.ok, f"sequence {b}: {cmp}"


# Every example spec (masks, score expressions, int / float / tensor parameters and the gradients
# of the float tensors, which run_case makes require grad) on the sm90 backward, forced, at both
# head dims, in MHA, GQA and MQA layouts: variant_cases.run_case against the float64 reference.
SPEC_SEQLENS = [(1, 1), (65, 65), (128, 128), (257, 257), (129, 257), (257, 129), (700, 700)]
SPEC_LAYOUTS = [(1, 1, 1), (2, 4, 2), (2, 4, 1), (1, 6, 6), (1, 8, 2)]  # (batch, heads, kv_heads)


@pytest.fixture(scope="module")
def _examples_built():
    with flashgen.use_family("sm90"), ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: variant_cases.op(n).build("cuda", None, [64, 128], decode=False),
                      variant_cases.EXAMPLES))


@pytest.mark.parametrize("name", variant_cases.EXAMPLES)
@pytest.mark.parametrize("d", [64, 128])
def test_every_example_spec_on_the_sm90_backward(_examples_built, name, d):
    fop = variant_cases.op(name)
    for gqa in (False, True):
        assert fop.family_for("cuda", torch.bfloat16, d, backward=True, gqa=gqa).family.name == "sm90"
    for i, (nq, nk) in enumerate(SPEC_SEQLENS):
        if name in variant_cases.EQUAL_SEQLENS_ONLY and nq != nk:
            continue
        B, Hq, Hkv = SPEC_LAYOUTS[i % len(SPEC_LAYOUTS)]
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        with flashgen.use_family("sm90"):
            variant_cases.run_case(name, B, Hq, Hkv, nq, nk, d, dtype, device="cuda", seed=50 + i, variant=i)


@pytest.mark.parametrize("name", ["transformers_packed", "transformers_packed_plain"])
@pytest.mark.parametrize("d", [64, 128])
def test_transformers_packed_specs_on_the_sm90_backward(name, d):
    """The specs flashgen.integrations.transformers runs compiled training on (packed sequence
    ids, windows; soft-capping in one, 128-row backward query tiles at d 64 in the other), with
    their per-call block lists, against the float64 reference."""
    fop = variant_cases.op(name)
    assert fop.family_for("cuda", torch.bfloat16, d, sparse=True, backward=True).family.name == "sm90"
    for i, (nq, nk) in enumerate(SPEC_SEQLENS):
        if nq != nk:
            continue
        B, Hq, Hkv = SPEC_LAYOUTS[i % len(SPEC_LAYOUTS)]
        with flashgen.use_family("sm90"):
            variant_cases.run_case(name, B, Hq, Hkv, nq, nk, d, (torch.bfloat16, torch.float16)[i % 2],
                                   device="cuda", seed=80 + i, variant=i)


@pytest.mark.parametrize("name", ["dropout", "alibi", "window_softcap"])
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_on_the_sm90_backward(name, d):
    """The forward's Philox keep mask regenerated by the sm90 backward (the sm80 mainloop's
    element-wise step on the wgmma fragments), against the reference with the same mask."""
    for i, (nq, nk) in enumerate([(64, 64), (257, 257), (129, 257), (257, 129), (1000, 1000)]):
        B, Hq, Hkv = [(1, 2, 2), (2, 4, 2), (2, 4, 1)][i % 3]
        dtype = (torch.float16, torch.bfloat16)[i % 2]
        with flashgen.use_family("sm90"):
            dropout_cases.run_case(name, B, Hq, Hkv, nq, nk, d, dtype, (0.1, 0.5)[i % 2], seed=60 + i, device="cuda")


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_gqa_group_split_and_whole(ops, mask):
    """GQA with the group split across CTAs (few key tiles: dK, dV through the fp32 workspaces)
    and whole (many key tiles: one CTA walks every query head of its kv head), both against the
    reference and against the sm80 backward."""
    from flashgen.families import sm80

    gen = torch.Generator(device="cuda").manual_seed(4500)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, hq, hkv, n, d in [(1, 8, 2, 200, 128), (1, 8, 1, 300, 64), (2, 16, 2, 4096, 128), (1, 4, 1, 1, 64)]:
        splits = sm80.gqa_splits(-(-n // 128), hkv, b, hq // hkv, sms)
        assert (splits > 1) == (n <= 300), (b, hq, hkv, n, splits)
        q, k, v = make(b, hq, hkv, n, n, d, torch.bfloat16, False, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        g90 = check_grads(ops[mask], q, k, v, dout)
        g80 = grads_of(ops[mask], q, k, v, dout, family="sm80")
        for a, b_ in zip(g90, g80, strict=True):
            torch.testing.assert_close(a.float(), b_.float(), atol=3e-2, rtol=1.6e-2)  # bf16: one ulp at |g| ~ 4 is 0.03


# Packed (varlen) batches on the sm90 backward, forced: sequences shorter and longer than a tile,
# empty ones, a sequence that is only a partial tile, GQA; varlen_cases.run_case against the float64
# reference per sequence.
PACKED_LENS = ([1, 0, 1000, 37, 512], [1, 7, 1000, 0, 300])


@pytest.mark.parametrize("name", ["causal", "dense", "alibi", "sliding_window", "document", "key_padding"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_on_the_sm90_backward(name, d):
    import varlen_cases

    lq, lk = PACKED_LENS
    if name in variant_cases.EQUAL_SEQLENS_ONLY:
        lk = lq
    fop = variant_cases.op(name)
    assert fop.family_for("cuda", torch.bfloat16, d, layout="packed", backward=True, gqa=True).family.name == "sm90"
    for i, (hq, hkv, dtype) in enumerate([(4, 2, torch.bfloat16), (4, 4, torch.float16), (8, 1, torch.bfloat16)]):
        with flashgen.use_family("sm90"):
            varlen_cases.run_case(fop, lq, lk, hq, hkv, d, dtype, device="cuda", seed=70 + i, variant=i, dlse=i == 1)


def test_packed_sequences_never_see_their_neighbours():
    """A packed sequence full of NaN (q, k, v and dout) between two finite ones: the TMA tiles of
    its neighbours reach into its rows (the last partial query tile, the key tile past the end),
    which the sm90 backward zeroes, so the neighbours' gradients stay finite and exact."""
    import varlen_cases

    fop = variant_cases.op("causal")
    lens = [77, 50, 200]
    cu = varlen_cases.cu_seqlens(lens, "cuda")
    q, k, v, dout = varlen_cases.inputs(lens, lens, 4, 2, 128, torch.bfloat16, device="cuda", seed=80)
    for t in (q, k, v, dout):
        t[77:127] = float("nan")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with flashgen.use_family("sm90"):
        out = fop(qq, kk, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
        out.backward(dout)
    c = cu.tolist()
    for b in (0, 2):
        grads = tuple(varlen_cases.sequence(t.grad, c, b) for t in (qq, kk, vv))
        assert all(torch.isfinite(g).all() for g in grads), f"sequence {b} took NaN from its neighbour"
        seq = [varlen_cases.sequence(t, c, b) for t in (q, k, v, dout)]
        cmp = check.compare_grads(fop.spec, *seq, grads)
        assert cmp.ok, f"sequence {b}: {cmp}"


# Block lists on the sm90 backward, forced: random patterns (an empty query block, a key block
# nobody sees), block masks from the spec's own mask, the document spec's per-call lists (its
# block classifier at the backward's 128 x 64 tiles), GQA, packed.
@pytest.mark.parametrize("d", [64, 128])
def test_block_sparse_on_the_sm90_backward(d):
    import sparsity_cases

    cases = [("causal", 2, 4, 2, 700, 500, {}, None), ("dense", 1, 4, 4, 300, 640, {}, 0.5),
             ("sliding_window", 2, 4, 1, 900, 900, {"window": 200}, None), ("dense", 2, 2, 2, 257, 257, {}, 0.3)]
    for i, (name, B, Hq, Hkv, nq, nk, params, density) in enumerate(cases):
        with flashgen.use_family("sm90"):
            sparsity_cases.run_case(name, B, Hq, Hkv, nq, nk, d, torch.bfloat16, device="cuda", params=params,
                                    pattern=density, from_spec=density is None, seed=100 + i)
    with flashgen.use_family("sm90"):
        sparsity_cases.run_case("causal", 0, 4, 2, 700, 500, d, torch.bfloat16, device="cuda", from_spec=True,
                                seed=110, packed=([700, 0, 17, 300], [500, 5, 17, 0]))
        sparsity_cases.run_case("dropout", 1, 2, 1, 600, 600, d, torch.float16, device="cuda", pattern=0.5,
                                dropout_p=0.2, seed=111)


def test_document_auto_block_lists_on_the_sm90_backward():
    """The document spec without a block_mask: per-call block lists from the classifier for the
    forward's and the sm90 backward's tiles (no dq lists: sm90 has no separate dq pass)."""
    ids = torch.tensor([[0] * 300 + [1] * 450 + [2] * 250, [0] * 7 + [3] * 993], dtype=torch.int32)
    for d in (64, 128):
        assert variant_cases.op("document").family_for("cuda", torch.bfloat16, d, sparse=True,
                                                       backward=True).family.name == "sm90"
        with flashgen.use_family("sm90"):
            variant_cases.run_case("document", 2, 4, 2, 1000, 1000, d, torch.bfloat16, device="cuda", seed=120 + d)
    with flashgen.use_family("sm90"):
        fop = variant_cases.op("document")
        g = torch.Generator().manual_seed(7)
        q, k, v, dout = (torch.randn(2, h, 1000, 128, generator=g).bfloat16().cuda() for h in (4, 2, 2, 4))
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fop(qq, kk, vv, document_id=ids.cuda()).backward(dout)
        cmp = check.compare_grads(fop.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad),
                                  params={"document_id": ids.cuda()})
        assert cmp.ok, str(cmp)


@pytest.mark.parametrize("hkv", [16, 4])
def test_fwd_bwd_peak_memory_at_most_sdpa_flash(ops, hkv):
    """Peak memory of forward + backward (B 1, 16 query heads, d 128, causal, N 16K; MHA and GQA
    4:1) on the sm90 family at or below SDPA flash's on the same inputs (its kv heads expanded,
    as SDPA takes them with enable_gqa), both above the inputs' own allocation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = 16384
    gen = torch.Generator(device="cuda").manual_seed(4700)
    q = torch.randn(1, 16, n, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(1, hkv, n, 128, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    dout = torch.randn_like(q)

    def peak(fn):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().backward(dout)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with flashgen.use_family("sm90"):
        ours = peak(lambda: ops["causal"](q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        theirs = peak(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             enable_gqa=hkv != 16))
    print(f"peak fwd+bwd MiB, kv heads {hkv}: flashgen sm90 {ours / 2**20:.1f}, SDPA flash {theirs / 2**20:.1f}")
    assert ours <= theirs, (ours, theirs)


# dQ partials: the writer warp's tensor reduce-adds from shared-memory staging
# (FLASHGEN_SM90_BWD_DQ=writer, the default: kBwdDefaultDqWriter in sm90/bwd.cuh) and the
# consumers' fp32 atomics (=atomic; read per launch) both give the
# reference's gradients: padded with query tiles cut by seqlen_q, GQA, packed (whose partial last
# query tiles keep the atomics), and deterministic (the writer waits on the semaphores).
# Also the grid order with the key tiles slowest (FLASHGEN_SM90_BWD_ORDER=lpt) and the bare path
# without its split waits (FLASHGEN_SM90_BWD_SPLIT=0).
@pytest.mark.parametrize("path", ["writer", "atomic", "lpt", "nosplit"])
@pytest.mark.parametrize("d", [64, 128])
def test_dq_paths(ops, monkeypatch, path, d):
    import varlen_cases

    dq, order, split = {"writer": ("writer", "tile", "1"), "atomic": ("atomic", "tile", "0"),
                        "lpt": ("writer", "lpt", "1"), "nosplit": ("writer", "tile", "0")}[path]
    monkeypatch.setenv("FLASHGEN_SM90_BWD_DQ", dq)
    monkeypatch.setenv("FLASHGEN_SM90_BWD_ORDER", order)
    monkeypatch.setenv("FLASHGEN_SM90_BWD_SPLIT", split)
    gen = torch.Generator(device="cuda").manual_seed(4900 + d)
    for name, b, hq, hkv, nq, nk in [("causal", 2, 4, 4, 200, 200), ("dense", 1, 4, 2, 333, 129),
                                     ("causal", 2, 8, 1, 1000, 1000)]:
        q, k, v = make(b, hq, hkv, nq, nk, d, torch.bfloat16, False, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        check_grads(ops[name], q, k, v, dout)
        first = check_grads(ops[name], q, k, v, dout, deterministic=True)
        again = grads_of(ops[name], q, k, v, dout, deterministic=True)
        assert all(torch.equal(x, y) for x, y in zip(first, again)), f"{name}: deterministic dQ not repeatable"
    fop = variant_cases.op("causal")
    with flashgen.use_family("sm90"):
        varlen_cases.run_case(fop, *PACKED_LENS, 4, 2, d, torch.bfloat16, device="cuda", seed=95, variant=0,
                              dlse=False)
    monkeypatch.setenv("FLASHGEN_SM90_BWD_DQ", "on")  # a value the switch does not take: an error, no launch
    q, k, v = make(1, 2, 2, 64, 64, d, torch.bfloat16, False, gen)
    with pytest.raises(flashgen.KernelError, match="FLASHGEN_SM90_BWD_DQ=on: expected atomic or writer"):
        grads_of(ops["causal"], q, k, v, torch.ones_like(q))


# The tile scheduler's persistent grid (FLASHGEN_SM90_BWD_PERSIST=1; off by default) with the
# multiprocessor count the launches see cut to 3 or 7, so that each CTA loops over many items:
# items whose walks are empty between ones that load K and V (causal with seqlen_q < seqlen_k,
# windows), GQA with and without the group split, packed sequences (key tiles past a sequence
# skipped by every role), block lists and dropout, against the float64 reference; and one CTA
# per item (=0) on the same shapes.
@pytest.mark.parametrize("persist,sms", [("1", 3), ("1", 7), ("0", 7)])
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_backward_many_items_per_cta(ops, monkeypatch, persist, sms, d):
    import sparsity_cases
    import varlen_cases

    from flashgen.runtime import launch

    monkeypatch.setenv("FLASHGEN_SM90_BWD_PERSIST", persist)
    monkeypatch.setattr(launch, "_sms", {torch.cuda.current_device(): sms})
    gen = torch.Generator(device="cuda").manual_seed(5100 + d + sms)
    for name, b, hq, hkv, nq, nk in [("causal", 2, 4, 4, 300, 900), ("causal", 3, 8, 2, 700, 700),
                                     ("dense", 2, 4, 1, 333, 1000), ("causal", 1, 6, 6, 1000, 129)]:
        q, k, v = make(b, hq, hkv, nq, nk, d, torch.bfloat16, False, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        check_grads(ops[name], q, k, v, dout)
    with flashgen.use_family("sm90"):
        varlen_cases.run_case(variant_cases.op("causal"), *PACKED_LENS, 4, 2, d, torch.bfloat16, device="cuda",
                              seed=96, variant=0, dlse=False)
        variant_cases.run_case("sliding_window", 2, 4, 2, 900, 900, d, torch.bfloat16, device="cuda", seed=97)
        sparsity_cases.run_case("dense", 2, 4, 2, 300, 640, d, torch.bfloat16, device="cuda", pattern=0.5,
                                seed=98)
        sparsity_cases.run_case("dropout", 1, 2, 1, 600, 600, d, torch.float16, device="cuda", pattern=0.5,
                                dropout_p=0.2, seed=99)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_single_query_with_strongly_negative_scores(ops, family):
    """edge-cases C12 (cuDNN returned NaN dK/dV for Sq = 1, Sk = 128, LSE about -122.5): one
    query row against Sk keys, every score shifted by about -125 through a constant last channel
    of q and k. The unshifted call's gradients equal the float64 reference's; the shifted call's
    are finite and the shift changes nothing (metamorphic): dV, and dQ, dK off the shift channel."""
    gen = torch.Generator(device="cuda").manual_seed(4400)
    d = 64
    for nk in (1, 64, 97, 127, 128, 129):
        q, k, v = make(1, 2, 2, 1, nk, d, torch.bfloat16, False, gen)
        q[..., -1], k[..., -1] = 0.0, 0.0
        dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
        plain = check_grads(ops["dense"], q, k, v, dout, family)
        qs, ks = q.clone(), k.clone()
        qs[..., -1], ks[..., -1] = 32.0, -31.25  # 32 * -31.25 / 8 = -125 added to every score
        # The shift channel's dQ, dK cancel terms of size |32| (the FlashAttention backward's D comes
        # from the rounded O): conditioned by the shift, not by the kernel; the other channels and
        # dV carry the check, against the plain call, which the reference checked.
        shifted = grads_of(ops["dense"], qs, ks, v, dout, family)
        assert all(torch.isfinite(g).all() for g in shifted)
        torch.testing.assert_close(shifted[2], plain[2], atol=2e-2, rtol=2e-2)  # dV
        for a, b in zip(shifted[:2], plain[:2], strict=True):  # dQ, dK off the shift channel
            torch.testing.assert_close(a[..., :-1], b[..., :-1], atol=2e-2, rtol=2e-2)
