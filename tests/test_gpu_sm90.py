"""The sm90 (Hopper) forward against the float64 reference, next to the sm80 family in the same
process (outputs poisoned with NaN before every launch). Every case forces the family with
flashgen.use_family, so a call sm90 cannot serve raises instead of silently running elsewhere;
the whole module skips on devices that are not compute capability 9.0."""

import functools
import itertools

import pytest
import torch
from conftest import SPECS
from test_gpu import DTYPES, LAYOUTS, SEQLENS, make  # the sm80 suite's inputs, reused
from variant_cases import EQUAL_SEQLENS_ONLY, EXAMPLES, run_case

import flashgen
from flashgen import check, philox
from flashgen.lang import ir

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on compute capability 9.0 only")


@pytest.fixture(scope="module")
def ops(dense_op, causal_op):
    return {"dense": dense_op, "causal": causal_op}


def check_case(op, q, k, v, family="sm90", **kw):
    with flashgen.use_family(family):
        assert op.family_for(q.device, q.dtype, q.shape[-1]).family.name == family
        out, lse = op(q, k, v, return_lse=True, **kw)
    cmp = check.compare(op.spec, q, k, v, out, lse, scale=kw.get("scale"))
    assert cmp.ok, f"{family} {op.name} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}: {cmp}"
    return out, lse


def test_sm90_is_chosen_first_for_the_forward(ops):
    op = ops["causal"]
    assert op.family_for("cuda", torch.bfloat16, 128).family.name == "sm90"
    assert op.family_for("cuda", torch.float16, 64, dropout=True).family.name == "sm90"
    assert op.family_for("cuda", torch.bfloat16, 256, sparse=True).family.name == "sm90"
    assert op.family_for("cuda", torch.bfloat16, 128, layout="packed").family.name == "sm90"
    # What sm90 does not serve yet (here: the backward at head dims other than 64 and 128, see
    # tests/test_gpu_sm90_bwd.py) runs on sm80, and the choice says why.
    assert op.family_for("cuda", torch.bfloat16, 128, backward=True).family.name == "sm90"
    choice = op.family_for("cuda", torch.bfloat16, 256, backward=True)
    assert choice.family.name == "sm80" and choice.tried[0][0] == "sm90", choice.why()


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_seqlen_cross_product(ops, mask, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(d)
    for i, (nq, nk) in enumerate(itertools.product(SEQLENS, SEQLENS)):
        b, hq, hkv, transposed = LAYOUTS[i % len(LAYOUTS)]
        tensors = make(b, hq, hkv, nq, nk, d, DTYPES[dtype], transposed, gen)
        out90, lse90 = check_case(ops[mask], *tensors)
        out80, lse80 = check_case(ops[mask], *tensors, family="sm80")
        torch.testing.assert_close(out90, out80, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse90, lse80, atol=1e-3, rtol=0)


LARGER = [(256, 256), (1000, 1000), (2048, 2048), (333, 4096), (4096, 333), (1025, 3000)]


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_larger_shapes(ops, mask, d):
    gen = torch.Generator(device="cuda").manual_seed(7)
    for i, (nq, nk) in enumerate(LARGER):
        b, hq, hkv, transposed = LAYOUTS[(i + 1) % len(LAYOUTS)]
        check_case(ops[mask], *make(b, hq, hkv, nq, nk, d, torch.bfloat16, transposed, gen))


@pytest.mark.parametrize("d", [8, 40, 64, 96, 112, 128, 136, 192, 200, 256])
def test_head_dims(ops, d):
    gen = torch.Generator(device="cuda").manual_seed(d)
    for nq, nk in [(65, 65), (300, 517), (1024, 1024)]:
        check_case(ops["causal"], *make(2, 4, 2, nq, nk, d, torch.bfloat16, False, gen))
        check_case(ops["dense"], *make(1, 3, 3, nq, nk, d, torch.float16, True, gen))


@pytest.mark.parametrize("hq, hkv", [(5, 5), (8, 2), (8, 1)])
def test_gqa(ops, hq, hkv):
    gen = torch.Generator(device="cuda").manual_seed(hq * 10 + hkv)
    for d in (64, 128):
        check_case(ops["causal"], *make(2, hq, hkv, 777, 777, d, torch.bfloat16, False, gen))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_specs(name):
    """Every example spec at d 128 bf16 (and d 64 fp16), forward on sm90 (forced), with the
    variant's parameters; then forward on sm90 + backward on sm80 unforced (the backward
    recomputes from the sm90 forward's out and LSE)."""
    seqlens = [(1, 1), (65, 65), (257, 257), (1000, 1000), (129, 257), (257, 129)]
    for i, (nq, nk) in enumerate(seqlens):
        if name in EQUAL_SEQLENS_ONLY and nq != nk:
            continue
        B, Hq, Hkv = [(1, 1, 1), (2, 4, 2), (2, 4, 1), (1, 6, 6)][i % 4]
        with flashgen.use_family("sm90"):
            run_case(name, B, Hq, Hkv, nq, nk, 128, torch.bfloat16, device="cuda", seed=i, variant=i, backward=False)
            run_case(name, B, Hq, Hkv, nq, nk, 64, torch.float16, device="cuda", seed=i, variant=i, backward=False)
        run_case(name, B, Hq, Hkv, nq, nk, 128, torch.bfloat16, device="cuda", seed=i, variant=i, backward=True)


def _sparse_cases():
    ids = torch.tensor([[0] * 300 + [1] * 450 + [2] * 250, [0] * 7 + [3] * 993], dtype=torch.int32)
    # (spec, B, Hq, Hkv, Nq, Nk, params, block mask: a random pattern's density, or None: the spec's own)
    return [("dense", 2, 4, 2, 1000, 700, {}, 0.5), ("causal", 1, 4, 4, 1300, 1300, {}, 0.6),
            ("sliding_window", 1, 2, 2, 1500, 1500, {"window": 300}, None),
            ("document", 2, 4, 2, 1000, 1000, {"document_id": ids}, None),
            ("alibi", 1, 4, 2, 400, 600, {"slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}, 0.7)]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_sparse(d):
    """Block lists on sm90: a random pattern of 128 x 128 blocks (with an empty query block and a
    key block nobody sees) and the spec's own block mask, forward forced onto sm90; then the
    same calls recording grad, unforced: the sm90 forward's lists for its tiles, the sm80
    backward's for its own (op.block_args), against the float64 reference."""
    from sparsity_cases import random_pattern
    from sparsity_cases import run_case as sparse_case
    from variant_cases import op

    for i, (name, B, Hq, Hkv, Nq, Nk, params, density) in enumerate(_sparse_cases()):
        fop = op(name)
        params = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in params.items()}
        gen = torch.Generator(device="cuda").manual_seed(100 * d + i)
        q, k, v = make(B, Hq, Hkv, Nq, Nk, d, torch.bfloat16, False, gen)
        if density is None:
            bm = flashgen.block_mask(fop, Nq, Nk, B, Hq, block_size=128, device="cuda", **params)
        else:
            bm = flashgen.BlockMask.from_pattern(random_pattern(B, Hq, -(-Nq // 128), -(-Nk // 128), density,
                                                                i).cuda(), 128)
        with flashgen.use_family("sm90"):
            assert fop.family_for("cuda", torch.bfloat16, d, sparse=True).family.name == "sm90"
            out, lse = fop(q, k, v, return_lse=True, block_mask=bm, **params)
        cmp = check.compare(fop.spec, q, k, v, out, lse, block_mask=bm, **params)
        assert cmp.ok, f"sm90 {name} d{d} {bm}: {cmp}"
        if d != 256:
            sparse_case(name, B, Hq, Hkv, Nq, Nk, d, torch.bfloat16, device="cuda", params=params,
                        pattern=density, from_spec=density is None, seed=i)


def test_per_call_block_lists(ops):
    """Masks without a closed-form key range (document ids) get block lists from the classifier
    per call on sm90 too: same output as the sm80 family's, and the reference's."""
    from variant_cases import op

    doc = op("document")
    assert doc.auto_sparse
    gen = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = make(2, 4, 2, 2000, 2000, 128, torch.bfloat16, False, gen)
    ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate([700, 13, 900, 387])])
    ids = torch.stack([ids, ids.flip(0)]).cuda()
    outs = {}
    for fam in ("sm90", "sm80"):
        with flashgen.use_family(fam):
            outs[fam] = doc(q, k, v, return_lse=True, document_id=ids)
        cmp = check.compare(doc.spec, q, k, v, *outs[fam], document_id=ids)
        assert cmp.ok, f"{fam}: {cmp}"
    torch.testing.assert_close(outs["sm90"][1], outs["sm80"][1], atol=1e-3, rtol=0)


@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.bfloat16)])
def test_packed(d, dtype):
    """Packed (varlen) batches on sm90 (forced), forward against the float64 reference and the
    sm80 family's output: sequences shorter and longer than a tile, empty ones (no queries, no
    keys), GQA, a mask of positions, one of ids and one of lengths; then the training step
    (sm90 forward, sm80 backward) of varlen_cases.run_case."""
    from variant_cases import make_params, op
    from varlen_cases import cu_seqlens, inputs
    from varlen_cases import run_case as packed_case

    lens = [([700, 64, 1, 129, 0, 300], [7, 0, 1, 128, 5, 300]), ([1000, 257, 3], [1000, 5, 0]),
            ([1] * 5 + [2049], [100, 0, 37, 512, 1, 2049])]
    for i, name in enumerate(["causal", "dense", "document", "key_padding"]):
        fop = op(name)
        lq, lk = lens[i % len(lens)]
        if name == "document":  # ids compare query and key positions: equal lengths
            lk = lq
        cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
        varlen = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": max(lq), "max_seqlen_k": max(lk)}
        q, k, v, _ = inputs(lq, lk, 8, 2, d, dtype, device="cuda", seed=10 * d + i)
        params = make_params(name, len(lq), 8, max(lq), max(lk), "cuda", torch.Generator().manual_seed(i), i) \
            if fop.spec.params else {}
        outs = {}
        for fam in ("sm90", "sm80"):
            with flashgen.use_family(fam):
                assert fop.family_for("cuda", dtype, d, layout="packed").family.name == fam
                outs[fam] = fop(q, k, v, return_lse=True, **varlen, **params)
            cmp = check.compare(fop.spec, q, k, v, *outs[fam], **varlen, **params)
            assert cmp.ok, f"{fam} {name} d{d} lens {lq} / {lk}: {cmp}"
        torch.testing.assert_close(outs["sm90"][1], outs["sm80"][1], atol=1e-3, rtol=0)
    if d != 256:
        packed_case("causal", [300, 0, 129, 1], [300, 5, 129, 64], 4, 2, d, dtype, device="cuda", seed=d)


@pytest.mark.parametrize("d", [64, 128])
def test_packed_many_sequences(d):
    """The packed work enumeration (each sequence's slots read off cu_seqlens, sm90/fwd.cuh
    ``coord``): many sequences whose lengths straddle the 128- and 192-row query tiles, empty
    ones among them, every query row written (outputs poisoned) and right against the float64
    reference, for a mask-free, a causal and a block-sparse call (dense at d 64 takes the
    192-row tiles of three consumer warpgroups)."""
    from varlen_cases import cu_seqlens, inputs

    g = torch.Generator().manual_seed(d)
    edges = [0, 1, 63, 64, 127, 128, 129, 191, 192, 193, 255, 256, 383, 384, 385, 577]
    lens = edges + [int(x) for x in torch.randint(1, 1500, (21,), generator=g)]
    lens = [lens[i] for i in torch.randperm(len(lens), generator=g)]
    cq = cu_seqlens(lens, "cuda")
    varlen = {"cu_seqlens_q": cq, "cu_seqlens_k": cq, "max_seqlen_q": max(lens), "max_seqlen_k": max(lens)}
    q, k, v, _ = inputs(lens, lens, 4, 2, d, torch.bfloat16, device="cuda", seed=d)
    for name in ("dense", "causal"):
        fop = flashgen.compile(SPECS / f"{name}.attn")
        with flashgen.use_family("sm90"):
            assert fop.family_for("cuda", torch.bfloat16, d, layout="packed").family.name == "sm90"
            out, lse = fop(q, k, v, return_lse=True, **varlen)
        cmp = check.compare(fop.spec, q, k, v, out, lse, **varlen)
        assert cmp.ok, f"{name} d{d}: {cmp}"
    # block-sparse packed call: the lists a block mask of the causal spec gives
    fop = flashgen.compile(SPECS / "causal.attn")
    bm = flashgen.block_mask(fop, max(lens), max(lens), block_size=128, device="cuda",
                             cu_seqlens_q=cq, cu_seqlens_k=cq)
    with flashgen.use_family("sm90"):
        out, lse = fop(q, k, v, return_lse=True, block_mask=bm, **varlen)
    cmp = check.compare(fop.spec, q, k, v, out, lse, **varlen)
    assert cmp.ok, f"block-sparse causal d{d}: {cmp}"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_tma_store_epilogue_equals_direct_stores(ops, monkeypatch, d):
    """The padded forward's TMA-store epilogue (head dims 64, 128, 192, 256) writes exactly what
    the direct stores write (FLASHGEN_SM90_TMA_STORE=0), LSE included, with query tiles cut
    by seqlen_q (rows the tensor map must clip) and against the float64 reference."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    for (nq, nk), transposed in itertools.product([(1, 1), (129, 200), (700, 700)], (False, True)):
        q, k, v = make(2, 3, 3, nq, nk, d, torch.bfloat16, transposed, gen)
        outs = {}
        for arm in ("1", "0"):
            monkeypatch.setenv("FLASHGEN_SM90_TMA_STORE", arm)
            with flashgen.use_family("sm90"):
                outs[arm] = ops["causal"](q, k, v, return_lse=True)
        cmp = check.compare(ops["causal"].spec, q, k, v, *outs["1"])
        assert cmp.ok, f"{nq}x{nk} d{d}: {cmp}"
        assert torch.equal(outs["1"][0], outs["0"][0]) and torch.equal(outs["1"][1], outs["0"][1])


def test_packed_neighbours_holding_nan_do_not_leak():
    """A packed sequence's last key tile reaches into the next sequence's rows (and its last
    query tile into the next one's queries): those rows holding NaN must not reach its output."""
    from varlen_cases import cu_seqlens, inputs

    lq, lk = [100, 200, 77], [150, 200, 90]
    cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    varlen = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": 200, "max_seqlen_k": 200}
    q, k, v, _ = inputs(lq, lk, 2, 2, 128, torch.bfloat16, device="cuda", seed=5)
    op = flashgen.compile(SPECS / "dense.attn")
    with flashgen.use_family("sm90"):
        ref = op(q, k, v, **varlen)
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[100:300], k2[150:350], v2[150:350] = float("nan"), float("nan"), float("nan")  # sequence 1
        out = op(q2, k2, v2, **varlen)
    assert torch.equal(out[:100], ref[:100]) and torch.equal(out[300:], ref[300:])
    assert out[100:300].isnan().all()  # sequence 1 itself: NaN scores at kept keys, NaN rows (DESIGN.md)


@pytest.mark.parametrize("d", [64, 128])
def test_dropout_same_stream_as_sm80(d):
    """Fused dropout with the sm80 family's Philox stream: the same keep mask, so the same output
    (up to rounding), and the float64 reference with that mask."""
    op = flashgen.compile(SPECS / "dropout.attn")
    gen = torch.Generator(device="cuda").manual_seed(d)
    for nq, nk in [(64, 64), (129, 257), (1000, 1000)]:
        q, k, v = make(2, 4, 2, nq, nk, d, torch.bfloat16, False, gen)
        outs = {}
        for fam in ("sm90", "sm80"):
            with flashgen.use_family(fam):
                outs[fam] = op(q, k, v, return_lse=True, dropout_p=0.3, dropout_seed=11)
            cmp = check.compare(op.spec, q, k, v, *outs[fam], dropout_p=0.3, dropout_seed=11)
            assert cmp.ok, f"{fam} {nq}x{nk} d{d}: {cmp}"
        torch.testing.assert_close(outs["sm90"][0], outs["sm80"][0], atol=2e-2, rtol=0)
        torch.testing.assert_close(outs["sm90"][1], outs["sm80"][1], atol=1e-3, rtol=0)
    # the mask itself
    N = 128
    q = torch.zeros(1, 2, N, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(N, device="cuda", dtype=torch.bfloat16).expand(1, 2, N, N).contiguous()
    with flashgen.use_family("sm90"):
        out = op(q, torch.randn_like(v), v, dropout_p=0.3, dropout_seed=99)
    lower = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    assert torch.equal(out > 0, philox.keep_mask(99, 0, 1, 2, N, N, 0.3, "cuda") & lower)


def test_keys_outside_the_key_range_holding_nan_do_not_leak(ops):
    """K/V rows inside the tensor but outside a tile's key range reach shared memory through TMA;
    they must not reach the output (edge-cases C05): masked keys holding NaN / inf (as the sm80
    test: K, whose scores are replaced by selection) and V rows past each sequence's key range
    (padded keys, which the producer zero-fills)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = make(1, 2, 2, 200, 200, 64, torch.bfloat16, False, gen)
    k2 = k.clone()
    k2[:, :, 150:] = float("nan")  # invisible to rows < 150
    k2[:, :, 151, 5] = float("inf")
    with flashgen.use_family("sm90"):
        assert torch.equal(ops["causal"](q, k2, v)[:, :, :150], ops["causal"](q, k, v)[:, :, :150])
    kp = flashgen.compile(SPECS / "key_padding.attn")
    q, k, v = make(2, 2, 2, 77, 300, 128, torch.bfloat16, False, gen)
    kv_len = torch.tensor([40, 300], dtype=torch.int32, device="cuda")
    k[0, :, 40:] = float("nan")
    v[0, :, 40:] = float("nan")
    with flashgen.use_family("sm90"):
        out, lse = kp(q, k, v, return_lse=True, kv_len=kv_len)
    assert not out.isnan().any()
    cmp = check.compare(kp.spec, q, k.nan_to_num(), v.nan_to_num(), out, lse, kv_len=kv_len)
    assert cmp.ok, str(cmp)


def test_memory_past_seqlen_is_never_read(ops):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = make(1, 2, 2, 70, 130, 128, torch.float16, False, gen)
    big_k = torch.full((1, 2, 256, 128), float("nan"), dtype=torch.float16, device="cuda")
    big_v = big_k.clone()
    big_k[:, :, :130], big_v[:, :, :130] = k, v
    with flashgen.use_family("sm90"):
        assert torch.equal(ops["dense"](q, big_k[:, :, :130], big_v[:, :, :130]), ops["dense"](q, k, v))


@pytest.mark.parametrize("nq, nk, b", [(0, 5, 1), (5, 0, 1), (0, 0, 1), (5, 5, 0)])
def test_empty_sizes(ops, nq, nk, b):
    q = torch.randn(b, 2, nq, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 2, nk, 64, device="cuda", dtype=torch.bfloat16)
    with flashgen.use_family("sm90"):
        out, lse = ops["causal"](q, k, k.clone(), return_lse=True)
    assert out.shape == q.shape and not out.isnan().any()
    if nk == 0:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_broadcast_kv_and_many_heads(ops):
    """Stride-0 (expanded) K/V and more work items than a grid needs for one wave."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(3, 4, 300, 64, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, 1, 300, 64, device="cuda", generator=gen).bfloat16().expand(3, 4, 300, 64)
    v = torch.randn(1, 1, 300, 64, device="cuda", generator=gen).bfloat16().expand(3, 4, 300, 64)
    check_case(ops["causal"], q, k, v)
    check_case(ops["dense"], *make(1, 20000, 20000, 3, 5, 64, torch.float16, False, gen))


def test_non_default_stream_and_no_host_sync(ops):
    gen = torch.Generator(device="cuda").manual_seed(5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), flashgen.use_family("sm90"):
        q, k, v = make(2, 4, 4, 1024, 1024, 128, torch.bfloat16, False, gen)
        ops["dense"](q, k, v)  # warm: loads the library
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = ops["dense"](q, k, v, return_lse=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    stream.synchronize()
    cmp = check.compare(ops["dense"].spec, q, k, v, out, lse)
    assert cmp.ok, str(cmp)


def test_cuda_graph_capture(ops):
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = make(1, 4, 4, 512, 512, 64, torch.float16, False, gen)
    op = ops["causal"]
    with flashgen.use_family("sm90"):
        op(q, k, v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(q, k, v)
        q2, k2, v2 = make(1, 4, 4, 512, 512, 64, torch.float16, False, gen)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, op(q2, k2, v2), rtol=0, atol=0)


def test_opcheck_and_compile(ops):
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = make(1, 2, 2, 200, 200, 64, torch.bfloat16, False, gen)
    op = ops["causal"]
    with flashgen.use_family("sm90"):
        torch.library.opcheck(op.torch_op, (q, k, v, 0.125, False))
        compiled = torch.compile(lambda a, b, c: op(a, b, c), fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), op(q, k, v), rtol=0, atol=0)


def test_training_step_pairs_sm90_forward_with_sm80_backward(ops):
    # d 256: the sm90 forward, and sm80's backward (the sm90 backward serves d 64 and 128)
    gen = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 500, 500, 256, torch.bfloat16, False, gen))
    dout = torch.randn_like(q)
    choose = functools.partial(ops["causal"].choose_family, q.device, ir.DType.BF16, 256, False, False, False,
                               gqa=True)
    assert (choose().family.name, choose(backward=True).family.name) == ("sm90", "sm80")
    out = ops["causal"](q, k, v)
    out.backward(dout)
    gc = check.compare_grads(ops["causal"].spec, q.detach(), k.detach(), v.detach(), dout,
                             (q.grad, k.grad, v.grad))
    assert gc.ok, str(gc)
    with flashgen.use_family("sm90"), pytest.raises(NotImplementedError, match="family sm90 .*backward"):
        ops["causal"](q, k, v).sum().backward()


# Non-default tile configs (keys x stages x overlap x ping-pong x persistent-up-to-seqlen_k):
# O staging overlaying the K/V rings (176 keys at d 128), ping-pong, persistent launches whose
# CTAs loop over several items (also with O in the rings: the next item waits for the epilogue),
# a 3-stage ring and key tiles that do not divide the query tile.
TILE_VARIANTS = ["176x2x1x0x0", "176x2x1x0x1073741824", "128x2x1x1x0", "128x2x0x0x1073741824",
                 "144x2x0x0x0", "64x3x1x1x1073741824"]


@pytest.fixture(scope="module")
def tile_libs(ops):
    """(spec, d, tiles) -> loaded library, built in parallel."""
    import concurrent.futures

    from flashgen import families
    from flashgen.families.sm90 import tiles_from_text
    from flashgen.lang import ir
    from flashgen.runtime import loader

    insts = {}
    for mask, op in ops.items():
        for d in (64, 128):
            for t in TILE_VARIANTS:
                tiles = tiles_from_text(t)
                insts[mask, d, t] = families.get("sm90").instantiation(op.spec, "sm_90a", ir.DType.BF16, d,
                                                                       tiles=tiles)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(zip(insts, pool.map(loader.load, insts.values()), strict=True))


@pytest.mark.parametrize("tiles", TILE_VARIANTS)
def test_tile_variants(ops, tile_libs, tiles):
    from flashgen.runtime import launch

    gen = torch.Generator(device="cuda").manual_seed(len(tiles))
    # (B, Hq, Hkv, Nq, Nk): 192 and 256 items (more than the 132 multiprocessors) and ragged ones
    for b, hq, hkv, nq, nk in [(4, 8, 8, 700, 700), (2, 8, 2, 2048, 2048), (3, 5, 5, 129, 1000),
                               (1, 4, 1, 1000, 77), (2, 2, 2, 1, 300)]:
        for mask, op in ops.items():
            for d in (64, 128):
                q, k, v = make(b, hq, hkv, nq, nk, d, torch.bfloat16, False, gen)
                out, lse = launch.launch_forward(op, q, k, v, d ** -0.5, lib=tile_libs[mask, d, tiles])
                cmp = check.compare(op.spec, q, k, v, out, lse)
                assert cmp.ok, f"{tiles} {mask} d{d} q{tuple(q.shape)} k{tuple(k.shape)}: {cmp}"
