"""Block sparsity (block_mask=): BlockMask construction, its mapping onto kernel tiles, and the
kernels' forward and backward against the float64 reference on the CPU (CUDA cases are marked gpu)."""

import pytest
import torch
from sparsity_cases import run_case
from variant_cases import alibi_slopes, op

import flashgen
from flashgen import reference
from flashgen.runtime import masks

# ------------------------------------------------------------------ BlockMask itself


def brute_classes(keep: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Block classes of an element mask [B, H, Nq, Nk] by direct reduction (the test's oracle)."""
    B, H, Nq, Nk = keep.shape
    out = torch.zeros(B, H, -(-Nq // bq), -(-Nk // bk), dtype=torch.int8)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            blk = keep[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[:, :, i, j] = torch.where(blk.all(-1).all(-1), 2, torch.where(blk.any(-1).any(-1), 1, 0))
    return out


@pytest.mark.parametrize("name, Nq, Nk, bs, params", [
    ("causal", 300, 200, 64, {}), ("causal", 130, 500, (32, 64), {}),
    ("sliding_window", 333, 333, 32, {"window": 40}),
    ("prefix_lm", 260, 260, 64, {"prefix_len": torch.tensor([0, 100, 259], dtype=torch.int32)}),
    ("document", 300, 300, 64, {"document_id": torch.tensor([[0] * 100 + [1] * 150 + [2] * 50,
                                                             [0] * 7 + [3] * 293], dtype=torch.int32)}),
])
def test_block_mask_classifies_the_spec_mask(name, Nq, Nk, bs, params):
    fop = op(name)
    batch = next((t.shape[0] for t in params.values() if isinstance(t, torch.Tensor)), None)
    bm = flashgen.block_mask(fop, Nq, Nk, batch=batch, block_size=bs, **params)
    keep = reference.keep_mask(fop.spec, Nq, Nk, batch=batch or 1, heads=1, **params)
    bq, bk = (bs, bs) if isinstance(bs, int) else bs
    want = brute_classes(keep, bq, bk)
    assert bm.full_kept and bm.block_size == (bq, bk)
    assert torch.equal(bm.to_dense().expand_as(want), want)
    # compact lists: the first n entries of each row are exactly that row's blocks of the class
    for num, idx, cls, tr in ((bm.kv_num_blocks, bm.kv_indices, 1, False), (bm.full_kv_num_blocks,
                              bm.full_kv_indices, 2, False), (bm.q_num_blocks, bm.q_indices, 1, True),
                              (bm.full_q_num_blocks, bm.full_q_indices, 2, True)):
        st = bm.to_dense().transpose(-1, -2) if tr else bm.to_dense()
        for b in range(st.shape[0]):
            for r in range(st.shape[2]):
                got = sorted(idx[b, 0, r, :num[b, 0, r]].tolist())
                assert got == torch.nonzero(st[b, 0, r] == cls).flatten().tolist()


def test_block_mask_chunks_rows_without_an_n_by_n_tensor(monkeypatch):
    """Evaluated in row chunks: a tiny chunk budget gives the same classes."""
    fop = op("sliding_window")
    a = flashgen.block_mask(fop, 500, 500, block_size=32, window=50)
    monkeypatch.setattr(masks, "_CHUNK_ELEMS", 1)
    b = flashgen.block_mask(fop, 500, 500, block_size=32, window=50)
    assert torch.equal(a.to_dense(), b.to_dense())


@pytest.mark.parametrize("tile", [(32, 32), (64, 128), (128, 64), (24, 40), (256, 256), (96, 48)])
def test_tile_lists_map_blocks_onto_any_tile(tile):
    g = torch.Generator().manual_seed(sum(tile))
    Nq, Nk, bq, bk = 333, 270, 64, 32
    st = torch.randint(0, 3, (2, 3, -(-Nq // bq), -(-Nk // bk)), generator=g, dtype=torch.int8)
    bm = flashgen.BlockMask(st, (bq, bk), Nq, Nk)
    for transpose in (False, True):
        tr, tc = tile
        lists = bm.tile_lists(tr, tc, Nq, Nk, transpose=transpose)
        # oracle: element-level classes, reduced over each tile
        el = st.repeat_interleave(bq, 2)[:, :, :Nq].repeat_interleave(bk, 3)[..., :Nk]
        if transpose:
            el = el.transpose(-1, -2)
        nonempty = brute_classes(el != 0, tr, tc)
        full = brute_classes(el == 2, tr, tc)
        want = torch.where(nonempty == 0, 0, torch.where(full == 2, 2, 1))
        assert lists.shape == (*want.shape[:3], want.shape[3] + 2) and lists.dtype == torch.int32
        for b in range(2):
            for h in range(3):
                for r in range(want.shape[2]):
                    row = lists[b, h, r].tolist()
                    npart, nfull = row[0], row[1]
                    assert sorted(row[2:2 + npart]) == torch.nonzero(want[b, h, r] == 1).flatten().tolist()
                    assert sorted(row[2 + npart:2 + npart + nfull]) == \
                        torch.nonzero(want[b, h, r] == 2).flatten().tolist()
        assert bm.tile_lists(tr, tc, Nq, Nk, transpose=transpose) is lists  # cached


def test_from_pattern_and_call_errors_name_the_argument():
    c = op("causal")
    q = torch.randn(1, 2, 100, 32)
    with pytest.raises(TypeError, match="^pattern"):
        flashgen.BlockMask.from_pattern([[True]])
    with pytest.raises(ValueError, match="^pattern: dtype"):
        flashgen.BlockMask.from_pattern(torch.ones(1, 1, 1, 1))
    with pytest.raises(ValueError, match="^block_size"):
        flashgen.BlockMask.from_pattern(torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=100)
    with pytest.raises(TypeError, match="^block_mask: expected a flashgen.BlockMask"):
        c(q, q, q, block_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool))
    wrong = flashgen.BlockMask.from_pattern(torch.ones(1, 1, 2, 1, dtype=torch.bool), block_size=64)
    with pytest.raises(ValueError, match="^block_mask: 2 x 1 blocks of 64 x 64"):
        c(q, torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32), block_mask=wrong)
    heads = flashgen.BlockMask.from_pattern(torch.ones(1, 3, 2, 2, dtype=torch.bool), block_size=64)
    with pytest.raises(ValueError, match="^block_mask: heads dim is 3"):
        c(q, q, q, block_mask=heads)
    made = flashgen.block_mask(c, 100, 120, block_size=64)
    with pytest.raises(ValueError, match="^block_mask: made for seqlen_q = 100, seqlen_k = 120"):
        c(q, torch.randn(1, 2, 100, 32), torch.randn(1, 2, 100, 32), block_mask=made)
    with pytest.raises(ValueError, match="^seqlen_q"):
        flashgen.block_mask(c, -1, 10)
    with pytest.raises(TypeError, match="missing parameter"):
        flashgen.block_mask(op("sliding_window"), 10, 10)


# ------------------------------------------------------------------ kernels (CPU)

CPU_CASES = [
    # name, B, Hq, Hkv, Nq, Nk, d, params, block size, pattern density (None: from the spec)
    ("dense", 2, 4, 2, 300, 200, 32, {}, 64, 0.5),           # the paper's block-sparse attention, GQA
    ("dense", 1, 2, 2, 130, 257, 64, {}, (32, 64), 0.3),
    ("causal", 1, 4, 1, 250, 250, 32, {}, 64, 0.6),          # pattern AND the spec's mask, MQA
    ("causal", 2, 2, 2, 200, 330, 32, {}, 64, None),         # the spec's own mask, Nq != Nk
    ("sliding_window", 1, 2, 1, 400, 400, 32, {"window": 50}, 32, None),
    ("prefix_lm", 2, 2, 2, 260, 260, 32, {"prefix_len": torch.tensor([10, 200], dtype=torch.int32)}, 64, None),
    ("alibi", 1, 4, 2, 190, 190, 32, {"slopes": alibi_slopes(4, "cpu")}, 64, 0.5),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}-{c[9]}" for c in CPU_CASES])
def test_cpu_block_sparse_matches_reference(case):
    name, B, Hq, Hkv, Nq, Nk, d, params, bs, density = case
    run_case(name, B, Hq, Hkv, Nq, Nk, d, torch.float32, params=params, block_size=bs,
             pattern=density, from_spec=density is None, seed=Nq + Nk)


def test_cpu_document_mask_from_spec_with_per_batch_blocks():
    ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 7 + [3] * 293], dtype=torch.int32)
    bm, *_ = run_case("document", 2, 2, 2, 300, 300, 32, torch.float32, params={"document_id": ids},
                      block_size=64, from_spec=True, seed=3)
    assert bm.shape[0] == 2 and bm.density() < 1


def test_cpu_empty_query_block_writes_zero_and_neg_inf():
    pat = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    pat[0, 0, 0, :2] = True
    pat[0, 0, 2, 2] = True
    bm, out, lse, (dq, dk, dv) = run_case("dense", 1, 2, 2, 150, 150, 32, torch.float32, pattern=pat,
                                          block_size=64, seed=4)
    assert (out[:, :, 64:128] == 0).all() and torch.isneginf(lse[:, :, 64:128]).all()
    assert (dq[:, :, 64:128] == 0).all()


def test_cpu_block_lists_are_the_authority_with_a_trivial_mask():
    """Without any element mask, blocks the pattern leaves out are never visited."""
    pat = torch.eye(4, dtype=torch.bool)[None, None]
    _, out, _, _ = run_case("dense", 1, 1, 1, 256, 256, 32, torch.float32, pattern=pat, block_size=64, seed=5)
    q = torch.randn(1, 1, 256, 32)
    full = flashgen.BlockMask.from_pattern(torch.ones(1, 1, 4, 4, dtype=torch.bool), 64)
    dense = op("dense")
    assert torch.equal(dense(q, q, q, block_mask=full), dense(q, q, q))


def test_cpu_block_sparse_with_dropout_and_varlen():
    run_case("dropout", 1, 2, 1, 200, 200, 32, torch.float32, pattern=0.5, block_size=64, dropout_p=0.2, seed=6)
    run_case("causal", 0, 2, 1, 300, 200, 32, torch.float32, from_spec=True, block_size=64, seed=7,
             packed=([300, 0, 17, 120], [200, 5, 17, 0]))
    run_case("dense", 0, 2, 2, 300, 200, 32, torch.float32, pattern=0.5, block_size=64, seed=8,
             packed=([300, 1, 17], [200, 130, 0]))


def test_cpu_block_sparse_bf16():
    run_case("causal", 1, 2, 2, 256, 256, 64, torch.bfloat16, pattern=0.5, block_size=128, seed=9)


@pytest.mark.parametrize("hkv", [2, 1])
def test_cpu_gqa_with_per_head_block_masks(hkv):
    """Edge case C33: GQA/MQA with a block mask that differs per query head (heads 0-3 causal
    blocks, 4-7 a window of blocks) and one shared by all heads; each query head uses its own row."""
    nb = 8
    i = torch.arange(nb)
    causal = i[:, None] >= i[None, :]
    window = causal & (i[:, None] - i[None, :] <= 2)
    pat = torch.stack([causal] * 4 + [window] * 4)[None].expand(2, 8, nb, nb)
    run_case("dense", 2, 8, hkv, 256, 256, 32, torch.float32, pattern=pat.contiguous(), block_size=32, seed=30 + hkv)
    run_case("causal", 2, 8, hkv, 250, 256, 32, torch.float32, pattern=window[None, None], block_size=32,
             seed=40 + hkv)


def test_cpu_block_mask_survives_copies():
    """Edge case C35: a block mask means the same after to(), deepcopy and pickling."""
    import copy
    import pickle

    ids = torch.tensor([[0] * 100 + [1] * 37 + [2] * 63], dtype=torch.int32)
    doc = op("document")
    bm = flashgen.block_mask(doc, 200, 200, block_size=32, document_id=ids)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    ref = doc(q, k, v, block_mask=bm, document_id=ids)
    for other in (bm.to("cpu"), copy.deepcopy(bm), pickle.loads(pickle.dumps(bm))):
        assert torch.equal(other.to_dense(), bm.to_dense()) and other.full_kept
        assert torch.equal(doc(q, k, v, block_mask=other, document_id=ids), ref)
        if other is not bm:  # a copy compares the call's document ids by value
            assert torch.equal(doc(q, k, v, block_mask=other, document_id=ids.clone()), ref)
        with pytest.raises(ValueError, match="^block_mask: made with another document_id tensor"):
            doc(q, k, v, block_mask=other, document_id=torch.zeros_like(ids))


@pytest.mark.parametrize("n", [127, 129, 1025])
def test_cpu_tail_tiles_with_a_position_score_and_block_mask(n):
    """Edge case C08: seqlen not a multiple of the block size, a causal block mask and a score
    that grows with the distance (ALiBi slope 1: logits down to -n): finite gradients equal to
    the reference, the tail block's rows past the end never enter."""
    run_case("alibi", 1, 1, 1, n, n, 32, torch.float32, params={"slopes": torch.ones(1)}, from_spec=True,
             block_size=128, seed=n)


@pytest.mark.parametrize("bs", [(264, 16), (24, 520), (16, 24)])
def test_cpu_pattern_blocks_of_any_size_stay_exact(bs):
    """Block sizes that are not multiples of the CPU's preferred tiles: the tiles become a divisor
    of the block, so a tile never mixes a kept and an empty block (whose inside would otherwise
    see only the spec's mask)."""
    from flashgen.families.cpu import divisor_tile as _cpu_tile

    assert _cpu_tile(264, 256) == 88 and _cpu_tile(520, 512) == 104 and _cpu_tile(128, 256) == 128
    nq, nk = 2 * bs[0] + 5, 2 * bs[1] + 7
    pat = torch.tensor([[True, False, True], [False, True, False], [True, True, False]])
    run_case("dense", 1, 2, 1, nq, nk, 16, torch.float32, pattern=pat[None, None], block_size=bs, seed=sum(bs))


def test_cpu_block_mask_bound_to_its_spec_values_and_layout():
    """A mask from flashgen.block_mask skips the element mask on its full blocks, so it refuses a
    call with another spec, other parameter values, a tensor changed in place, or another layout."""
    sw, c, doc = op("sliding_window"), op("causal"), op("document")
    q = torch.randn(1, 2, 64, 16)
    bm = flashgen.block_mask(sw, 64, 64, block_size=16, window=48)
    sw(q, q, q, block_mask=bm, window=48)
    with pytest.raises(ValueError, match="^block_mask: made with window = 48, called with 4"):
        sw(q, q, q, block_mask=bm, window=4)
    with pytest.raises(ValueError, match="^block_mask: made by flashgen.block_mask from another spec"):
        c(q, q, q, block_mask=bm)
    ids = torch.zeros(1, 64, dtype=torch.int32)
    bmd = flashgen.block_mask(doc, 64, 64, block_size=16, document_id=ids)
    doc(q, q, q, block_mask=bmd, document_id=ids)
    with pytest.raises(ValueError, match="^block_mask: made with another document_id tensor"):
        doc(q, q, q, block_mask=bmd, document_id=ids.clone())
    ids[0, 40:] = 1  # changed in place
    with pytest.raises(ValueError, match="^block_mask: made with another document_id tensor"):
        doc(q, q, q, block_mask=bmd, document_id=ids)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    qp = torch.randn(64, 2, 16)
    with pytest.raises(ValueError, match="^block_mask: made for the padded layout"):
        c(qp, qp, qp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64,
          block_mask=flashgen.block_mask(c, 64, 64, block_size=16))
    packed = flashgen.block_mask(c, 34, 34, block_size=16, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = c(qp, qp, qp, cu_seqlens_q=cu, cu_seqlens_k=cu, block_mask=packed)  # max_seqlen from the mask
    assert torch.equal(out, c(qp, qp, qp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=34, max_seqlen_k=34,
                              block_mask=packed))
    with pytest.raises(ValueError, match="^block_mask: made with another cu_seqlens_q tensor"):
        c(qp, qp, qp, cu_seqlens_q=cu.clone(), cu_seqlens_k=cu, block_mask=packed)
    with pytest.raises(ValueError, match="^block_mask: made for the packed layout"):
        c(q, q, q, block_mask=flashgen.block_mask(c, 64, 64, block_size=16, cu_seqlens_q=torch.tensor(
            [0, 64], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 64], dtype=torch.int32)))


def test_cpu_block_mask_of_a_mask_that_depends_on_the_head():
    """A mask using h (or b) needs heads= (batch=): refused without it, exact with it."""
    hm = flashgen.compile("attention head_mask {\n    mask = kv <= q or h % 2 == 1\n}\n")
    with pytest.raises(ValueError, match="^heads: the mask of spec 'head_mask' depends on h"):
        flashgen.block_mask(hm, 64, 64, block_size=16)
    bm = flashgen.block_mask(hm, 64, 64, heads=4, block_size=16)
    assert bm.shape[:2] == (1, 4)
    g = torch.Generator().manual_seed(50)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
    ref = reference.attention(hm, q.double(), k.double(), v.double())
    assert (hm(q, k, v, block_mask=bm).double() - ref).abs().max() < 1e-5
    one = flashgen.block_mask(hm, 64, 64, heads=1, block_size=16)  # e.g. the kv heads of MQA by mistake
    with pytest.raises(ValueError, match=r"^block_mask: heads dim is 1, expected 4 \(the call's heads: the mask "
                                         r"depends on h\)"):
        hm(q, k, v, block_mask=one)


def test_cpu_block_mask_binding_is_by_object_and_only_for_what_the_mask_reads():
    """Score-only parameters do not bind (a learnable ALiBi slope may change); a new tensor object
    does, even at a freed tensor's address; inference tensors work; a float mask keeps the
    kernels' own element mask on full blocks."""
    al = op("alibi")
    q = torch.randn(1, 4, 64, 16)
    bm = flashgen.block_mask(al, 64, 64, block_size=16, slopes=alibi_slopes(4, "cpu"))
    al(q, q, q, block_mask=bm, slopes=alibi_slopes(4, "cpu") * 2)  # slopes only enter the score
    doc = op("document")
    bmd = flashgen.block_mask(doc, 64, 64, block_size=16, document_id=torch.zeros(1, 64, dtype=torch.int32))
    for _ in range(20):  # new tensors, possibly at the freed one's address
        with pytest.raises(ValueError, match="^block_mask: made with another document_id tensor"):
            doc(q, q, q, block_mask=bmd, document_id=torch.zeros(1, 64, dtype=torch.int32))
    with torch.inference_mode():
        ids = torch.zeros(1, 64, dtype=torch.int32)
        bmi = flashgen.block_mask(doc, 64, 64, block_size=16, document_id=ids)
        doc(q, q, q, block_mask=bmi, document_id=ids)
    fm = flashgen.compile("attention float_mask {\n    param r: float\n    mask = q * r + kv * r <= 37.0\n}\n")
    assert not flashgen.block_mask(fm, 64, 64, block_size=8, r=1 / 3).full_kept
    assert flashgen.BlockMask.from_pattern(torch.ones(1, 1, dtype=torch.bool), np_int(64)).block_size == (64, 64)


def test_cpu_block_mask_without_the_parameters_the_mask_does_not_read():
    """A block mask is built without score-only parameters (ALiBi's slopes, a float and a
    tensor of a custom spec) and serves calls that pass them: the same result as without it;
    a parameter the mask reads is still required, named."""
    al = op("alibi")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    bm = flashgen.block_mask(al, 64, 64, block_size=16)
    slopes = alibi_slopes(4, "cpu")
    torch.testing.assert_close(al(q, k, v, block_mask=bm, slopes=slopes), al(q, k, v, slopes=slopes),
                               rtol=1e-6, atol=1e-6)
    custom = flashgen.compile("attention score_params {\n    param n: int\n    param c: float\n"
                              "    param bias: f32[heads, seqlen_q|1]\n    mask = kv <= q and kv + n > q\n"
                              "    score = score * c + bias[h, q]\n}\n")
    bm = flashgen.block_mask(custom, 64, 64, block_size=16, n=24)
    bias = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(custom(q, k, v, block_mask=bm, n=24, c=0.5, bias=bias),
                               custom(q, k, v, n=24, c=0.5, bias=bias), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"^missing parameter\(s\) of spec 'score_params': n: int"):
        flashgen.block_mask(custom, 64, 64, block_size=16)


def np_int(x):
    import numpy as np

    return np.int64(x)


def test_cpu_block_mask_from_the_spec_in_a_fullgraph_compile():
    """A mask made by flashgen.block_mask passes into torch.compile(fullgraph=True) code."""
    c = op("causal")
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(60))
    bm = flashgen.block_mask(c, 128, 128, block_size=32)
    f = torch.compile(lambda x, m: c(x, x, x, block_mask=m), fullgraph=True)
    assert torch.equal(f(q, bm), c(q, q, q, block_mask=bm))


def test_cpu_block_mask_argument_errors():
    import numpy as np

    c = op("causal")
    assert flashgen.block_mask(c, np.int64(40), 40, block_size=np.int64(16)).shape == (1, 1, 3, 3)
    with pytest.raises(ValueError, match="^seqlen_q: 2147483648 is out of range"):
        flashgen.block_mask(c, 2**31, 8)
    with pytest.raises(TypeError, match="^seqlen_k: expected an int"):
        flashgen.block_mask(c, 8, 8.0)
    with pytest.raises(TypeError, match="^cu_seqlens_q: expected an int32 tensor"):
        flashgen.block_mask(c, 8, 8, cu_seqlens_q=[0, 8], cu_seqlens_k=[0, 8])
    with pytest.raises(ValueError, match="^cu_seqlens_q: expected non-decreasing boundaries starting at 0"):
        flashgen.block_mask(c, 8, 8, cu_seqlens_q=torch.tensor([1, 8], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="^batch: 3, but cu_seqlens_q holds 1 sequences"):
        flashgen.block_mask(c, 8, 8, 3, cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="^state: values must be"):
        flashgen.BlockMask(torch.full((1, 1, 1, 1), 3, dtype=torch.int8), 16)
    with pytest.raises(ValueError, match="^pattern: on the meta device"):
        flashgen.BlockMask.from_pattern(torch.ones(1, 1, 1, 1, dtype=torch.bool, device="meta"))
    q = torch.randn(1, 1, 40, 16)
    with pytest.raises(TypeError, match="^block_mask: expected a flashgen.BlockMask"):
        reference.attention(c, q, q, q, block_mask=torch.ones(1))
    with pytest.raises(ValueError, match="^block_mask: 1 x 1 blocks of 16 x 16 do not cover"):
        reference.attention(c, q, q, q, block_mask=flashgen.BlockMask.from_pattern(torch.ones(1, 1, dtype=torch.bool), 16))
    bm = flashgen.BlockMask.from_pattern(torch.ones(3, 3, dtype=torch.bool), 16)
    bm.to_dense().zero_()  # a copy: the mask itself is unchanged
    assert bool((bm.to_dense() == 2).all())


def test_cpu_block_mask_under_torch_compile():
    """A block mask passes through torch.compile(fullgraph=True), forward and backward, with the
    eager results (also a mask whose tile lists are first built inside the compiled region)."""
    c = op("causal")
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 2, 200, 32, generator=g, requires_grad=True)
    bm = flashgen.BlockMask.from_pattern(torch.rand(1, 1, 4, 4, generator=g) < 0.6, 64)
    ref = c(q, q, q, block_mask=bm)
    (gref,) = torch.autograd.grad(ref.sum(), q)
    f = torch.compile(lambda x, m: c(x, x, x, block_mask=m), fullgraph=True)
    out = f(q, bm)
    (gout,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(out, ref) and torch.equal(gout, gref)
    fresh = flashgen.BlockMask.from_pattern(torch.rand(1, 1, 4, 4, generator=g) < 0.6, 64)
    assert torch.equal(f(q, fresh), c(q, q, q, block_mask=fresh))


# ------------------------------------------------------------------ kernels (CUDA)

GPU_CASES = [
    ("document", 1, 12, 12, 124, 124, 64, {"document_id": torch.tensor([[0] * 64 + [1] * 60], dtype=torch.int32)},
     64, None, True),  # edge case C29: the deterministic backward with a document mask

    ("dense", 2, 4, 2, 300, 200, 64, {}, 128, 0.5, False),
    ("dense", 1, 2, 2, 1000, 777, 128, {}, 128, 0.3, True),      # deterministic dq kernel
    ("causal", 1, 4, 1, 700, 700, 128, {}, 128, 0.6, False),
    ("causal", 2, 2, 2, 500, 900, 64, {}, 64, None, False),
    ("sliding_window", 1, 4, 2, 1500, 1500, 128, {"window": 200}, 128, None, False),
    ("sliding_window", 1, 2, 2, 600, 600, 64, {"window": 50}, 128, None, True),
    ("prefix_lm", 2, 2, 2, 520, 520, 64, {"prefix_len": torch.tensor([10, 300], dtype=torch.int32)}, 128, None,
     False),
    ("alibi", 1, 4, 2, 400, 400, 128, {"slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}, 128, 0.5, False),
]


@pytest.fixture(scope="module")
def _cuda_sparse_built():
    """Build every block-sparse instantiation the CUDA cases use at once (in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {(c[0], c[6], "padded") for c in GPU_CASES} | {("document", 128, "padded"), ("dropout", 64, "padded"),
                                                            ("causal", 128, "packed"), ("dense", 64, "packed")}
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: op(j[0]).build("cuda", ["bf16"], [j[1]], layouts=(j[2],), sparse=(True,),
                                               decode=False), jobs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-{c[4]}x{c[5]}-d{c[6]}-{c[9]}-{c[10]}" for c in GPU_CASES])
def test_cuda_block_sparse_matches_reference(case, _cuda_sparse_built):
    name, B, Hq, Hkv, Nq, Nk, d, params, bs, density, det = case
    params = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    run_case(name, B, Hq, Hkv, Nq, Nk, d, torch.bfloat16, device="cuda", params=params, block_size=bs,
             pattern=density, from_spec=density is None, seed=Nq + Nk, deterministic=det)


@pytest.mark.gpu
def test_cuda_pattern_block_size_must_nest_the_tiles(_cuda_sparse_built):
    """A pattern whose blocks are smaller than the CUDA tiles is refused (a straddling tile could not
    honour it); block 128 fits every default tile, and block masks from the spec fit any size.
    Forced onto sm80 so that the dense and the sparse call run the same kernel family (bit-equal)."""
    c = op("causal")
    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    small = flashgen.BlockMask.from_pattern(torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda"), 64)
    with pytest.raises(ValueError, match="^block_mask: a pattern's block size 64 x 64 must be a multiple"):
        c(q, q, q, block_mask=small)
    spec64 = flashgen.block_mask(c, 256, 256, block_size=64, device="cuda")
    with flashgen.use_family("sm80"):
        assert torch.equal(c(q, q, q, block_mask=spec64), c(q, q, q))


@pytest.mark.gpu
def test_cuda_block_sparse_document_dropout_varlen(_cuda_sparse_built):
    ids = torch.tensor([[0] * 300 + [1] * 450 + [2] * 250, [0] * 7 + [3] * 993], dtype=torch.int32).cuda()
    run_case("document", 2, 4, 2, 1000, 1000, 128, torch.bfloat16, device="cuda", params={"document_id": ids},
             from_spec=True, seed=11)
    run_case("dropout", 1, 2, 1, 600, 600, 64, torch.bfloat16, device="cuda", pattern=0.5, dropout_p=0.2, seed=12)
    run_case("causal", 0, 4, 2, 700, 500, 128, torch.bfloat16, device="cuda", from_spec=True, seed=13,
             packed=([700, 0, 17, 300], [500, 5, 17, 0]))
    run_case("dense", 0, 2, 2, 700, 500, 64, torch.bfloat16, device="cuda", pattern=0.5, seed=14,
             packed=([700, 1, 130], [500, 300, 0]))


@pytest.mark.gpu
@pytest.mark.parametrize("name, Nq, Nk, bs, params", [
    ("causal", 1000, 700, 128, {}), ("sliding_window", 900, 900, 64, {"window": 100}),
    ("document", 1000, 1000, (128, 64), {"document_id": torch.tensor([[0] * 300 + [1] * 450 + [2] * 250,
                                                                     [0] * 7 + [3] * 993], dtype=torch.int32)}),
    ("key_padding", 500, 800, 128, {"kv_len": torch.tensor([0, 555, 800], dtype=torch.int32)}),
])
def test_cuda_classifier_matches_the_cpu_classification(name, Nq, Nk, bs, params):
    """flashgen.block_mask on CUDA (the generated classifier kernel) equals the CPU's row-chunked
    evaluation of the same mask, and the brute-force reduction of the element mask."""
    fop = op(name)
    batch = next((t.shape[0] for t in params.values() if isinstance(t, torch.Tensor)), None)
    cpu = flashgen.block_mask(fop, Nq, Nk, batch=batch, block_size=bs, **params)
    gpu = flashgen.block_mask(fop, Nq, Nk, batch=batch, block_size=bs, device="cuda",
                              **{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in params.items()})
    a, b = cpu.to_dense(), gpu.to_dense().cpu()
    assert torch.equal(a.expand(torch.broadcast_shapes(a.shape, b.shape)), b.expand(torch.broadcast_shapes(a.shape, b.shape)))
    keep = reference.keep_mask(fop.spec, Nq, Nk, batch=batch or 1, heads=1, **params)
    bq, bk = (bs, bs) if isinstance(bs, int) else bs
    want = brute_classes(keep, bq, bk)
    assert torch.equal(b.expand_as(want), want)


@pytest.mark.gpu
def test_cuda_classifier_packed_and_auto_block_lists(monkeypatch):
    """The packed classifier classifies each sequence with its own lengths; the document spec
    without a block_mask (per-call block lists, FLASHGEN_AUTO_BLOCK_MASK) and with it switched
    off both match the reference."""
    fop = op("causal")
    lq, lk = [300, 0, 17, 260], [200, 5, 17, 300]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    gpu = flashgen.block_mask(fop, 300, 300, block_size=64, device="cuda", cu_seqlens_q=cu(lq).cuda(),
                              cu_seqlens_k=cu(lk).cuda())
    cpu = flashgen.block_mask(fop, 300, 300, block_size=64, cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk))
    assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense().expand_as(gpu.to_dense().cpu()))
    from variant_cases import run_case as run_padded

    assert op("document").auto_sparse
    run_padded("document", 2, 4, 2, 700, 700, 128, torch.bfloat16, device="cuda", seed=21)
    monkeypatch.setenv("FLASHGEN_AUTO_BLOCK_MASK", "0")
    run_padded("document", 2, 4, 2, 700, 700, 128, torch.bfloat16, device="cuda", seed=22)
