"""Decoding with a KV cache (op.with_kvcache) on the CPU family, and flashgen.merge_attention.

The decode call must return exactly the last Sq rows of the prefill call on each whole sequence
(issue 20): checked for every example spec against the prefill op itself (a packed batch of the
whole sequences, max_seqlen = the capacity so parameters have the decode call's shapes); paged
caches against contiguous ones; appends, left padding, Sq > 1, device-side values out of range,
errors; merge_attention against attention over the union of the keys, forward and gradients.
Shapes are tiny and every op is the fp32 CPU library other test modules build too.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import SPECS
from variant_cases import make_params

import flashgen
from flashgen import families
from flashgen.lang import ir

ALL_SPECS = sorted(p.stem for p in SPECS.glob("*.attn"))
B, HQ, HKV, D, CAP = 3, 4, 2, 16, 48


@pytest.fixture(scope="module")
def ops():
    """Every example spec's op, their fp32 CPU kernels built at once (ninja in parallel)."""
    compiled = {n: flashgen.compile(SPECS / f"{n}.attn") for n in ALL_SPECS}
    with ThreadPoolExecutor(len(compiled)) as pool:
        list(pool.map(lambda o: o.build("cpu", ["fp32"]), compiled.values()))
    return compiled


def params_for(name: str, g: torch.Generator) -> dict:
    """Parameters with the decode call's shapes: seqlen_q and seqlen_k dims are the capacity."""
    if name == "dropout":
        return {}
    if name == "transformers_window":
        return {"left": 6, "right": 0}
    if name == "transformers":
        return {"key_mask": torch.rand(B, CAP, generator=g) > 0.2, "left": 9, "right": 2, "softcap": 20.0}
    if name in ("transformers_packed", "transformers_packed_plain"):  # two sequences per row, split at random
        cut = torch.randint(1, CAP, (B, 1), generator=g)
        p = {"seq_id": (torch.arange(CAP) >= cut).to(torch.int32), "left": 9, "right": 0}
        return p | {"softcap": 20.0} if name == "transformers_packed" else p
    return make_params(name, B, HQ, CAP, CAP, "cpu", g, variant=1)


def whole_sequences(kc, vc, seqlens, leftpad, kn, vn):
    """Per sequence b the keys and values of the whole sequence ([Hkv, L, d]): cache slots
    pad .. n - 1 (a contiguous cache before the call), then the new ones."""
    ks, vs = [], []
    for b in range(kc.shape[0]):
        n, pad = int(seqlens[b]), int(leftpad[b]) if leftpad is not None else 0
        kb, vb = kc[b, :, pad:n], vc[b, :, pad:n]
        if kn is not None:
            kb, vb = torch.cat([kb, kn[b]], 1), torch.cat([vb, vn[b]], 1)
        ks.append(kb)
        vs.append(vb)
    return ks, vs


def prefill_rows(op, q, ks, vs, params, g):
    """The last Sq rows of the prefill op on each whole sequence (one packed call; rows at
    negative positions: 0 and -inf), as out [B, Hq, Sq, d] and lse [B, Hq, Sq]."""
    Sq = q.shape[2]
    lens = [k.shape[1] for k in ks]
    qs = []
    for b, L in enumerate(lens):
        qf = torch.randn(q.shape[1], L, q.shape[3], generator=g)
        if L:
            qf[:, -min(L, Sq):] = q[b, :, -min(L, Sq):]
        qs.append(qf)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = op(torch.cat(qs, 1).transpose(0, 1), torch.cat(ks, 1).transpose(0, 1),
                  torch.cat(vs, 1).transpose(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=CAP,
                  max_seqlen_k=CAP, return_lse=True, **params)
    want_o = torch.zeros_like(q)
    want_l = torch.full(q.shape[:3], float("-inf"))
    for b, L in enumerate(lens):
        m = min(L, Sq)
        if m:
            want_o[b, :, Sq - m:] = out[int(cu[b + 1]) - m:int(cu[b + 1])].transpose(0, 1)
            want_l[b, :, Sq - m:] = lse[:, int(cu[b + 1]) - m:int(cu[b + 1])]
    return want_o, want_l


def caches(g, cap=CAP, hkv=HKV):
    kc = torch.randn(B, hkv, cap, D, generator=g)
    return kc, torch.randn(B, hkv, cap, D, generator=g)


@pytest.mark.parametrize("name", ALL_SPECS)
def test_last_rows_of_prefill_every_spec(ops, name):
    """The invariant for every example spec: mixed lengths (one empty cache), left padding, two
    appended keys, Sq = 2, GQA 2:1; the cache holds the new keys afterwards."""
    op, g = ops[name], torch.Generator().manual_seed(len(name))
    kc, vc = caches(g)
    kn, vn = torch.randn(B, HKV, 2, D, generator=g), torch.randn(B, HKV, 2, D, generator=g)
    q = torch.randn(B, HQ, 2, D, generator=g)
    seqlens = torch.tensor([0, 17, CAP - 2], dtype=torch.int32)
    leftpad = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = params_for(name, g)
    ks, vs = whole_sequences(kc, vc, seqlens, leftpad, kn, vn)
    before = kc.clone()
    out, lse = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, cache_leftpad=leftpad, k=kn, v=vn,
                               return_lse=True, **params)
    want_o, want_l = prefill_rows(op, q, ks, vs, params, g)
    torch.testing.assert_close(out, want_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=2e-5, rtol=1e-5)
    for b in range(B):
        n = int(seqlens[b])
        assert torch.equal(kc[b, :, n:n + 2], kn[b]) and torch.equal(vc[b, :, n:n + 2], vn[b])
        assert torch.equal(kc[b, :, :n], before[b, :, :n]) and torch.equal(kc[b, :, n + 2:], before[b, :, n + 2:])


def to_paged(kc, vc, page_size, g, share_first=False):
    """A paged copy of contiguous caches: pages shuffled in a pool with two spare pages; with
    ``share_first`` sequence 1 reads sequence 0's first page (its own first page is made equal)."""
    Bn, H, cap, d = kc.shape
    max_pages = cap // page_size
    if share_first:
        kc[1, :, :page_size], vc[1, :, :page_size] = kc[0, :, :page_size], vc[0, :, :page_size]
    perm = torch.randperm(Bn * max_pages + 2, generator=g)
    table = perm[:Bn * max_pages].view(Bn, max_pages).to(torch.int32)
    pool_k = torch.randn(Bn * max_pages + 2, page_size, H, d, generator=g).to(kc.dtype)
    pool_v = torch.randn_like(pool_k)
    for b in range(Bn):
        for j in range(max_pages):
            sl = slice(j * page_size, (j + 1) * page_size)
            pool_k[table[b, j]], pool_v[table[b, j]] = kc[b, :, sl].transpose(0, 1), vc[b, :, sl].transpose(0, 1)
    if share_first:
        table[1, 0] = table[0, 0]
    return pool_k, pool_v, table


def from_paged(pool, table, page_size):
    return torch.stack([torch.cat([pool[p] for p in row.tolist()], 0).transpose(0, 1) for row in table])


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_paged_equals_contiguous(ops, page_size):
    """Paged caches (shuffled pages, one shared by two sequences, appends across a page
    boundary) give what the contiguous cache gives, and hold the same keys afterwards."""
    op, g = ops["gemma"], torch.Generator().manual_seed(page_size)
    cap = max(CAP, page_size)
    kc, vc = caches(g, cap)
    share = cap // page_size > 1
    pool_k, pool_v, table = to_paged(kc, vc, page_size, g, share_first=share)
    kn, vn = torch.randn(B, HKV, 3, D, generator=g), torch.randn(B, HKV, 3, D, generator=g)
    q = torch.randn(B, HQ, 3, D, generator=g)
    n2 = 15 if page_size == 16 else 20  # sequence 2 appends across a page boundary at page size 16
    seqlens = torch.tensor([cap - 3 if share else 30, max(page_size, 25) if share else 9, n2], dtype=torch.int32)
    params = {"window": 11, "softcap": 30.0}
    want_o, want_l = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=kn, v=vn, return_lse=True, **params)
    out, lse = op.with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens, block_table=table, k=kn, v=vn,
                               return_lse=True, **params)
    torch.testing.assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)
    for b in range(B):
        end = int(seqlens[b]) + 3
        assert torch.equal(from_paged(pool_k, table, page_size)[b, :, :end], kc[b, :, :end])
        assert torch.equal(from_paged(pool_v, table, page_size)[b, :, :end], vc[b, :, :end])


def test_paged_leftpad_and_bf16(ops):
    """Left padding in a paged cache (the padding's pages may be anything), bf16 against the
    contiguous call, MQA."""
    op, g = ops["alibi"], torch.Generator().manual_seed(5)
    kc, vc = (t.to(torch.bfloat16) for t in caches(g, 64, 1))
    pool_k, pool_v, table = to_paged(kc, vc, 16, g)
    table[0, 0] = 10**6  # page of slots 0..15, all padding for sequence 0: never read
    seqlens = torch.tensor([40, 64, 1], dtype=torch.int32)
    leftpad = torch.tensor([16, 7, 0], dtype=torch.int32)
    q = torch.randn(B, HQ, 1, D, generator=g).to(torch.bfloat16)
    slopes = torch.linspace(0.1, 0.5, HQ)
    kw = {"cache_seqlens": seqlens, "cache_leftpad": leftpad, "slopes": slopes, "return_lse": True}
    out, lse = op.with_kvcache(q, pool_k, pool_v, block_table=table, **kw)
    want_o, want_l = op.with_kvcache(q, kc, vc, **kw)
    torch.testing.assert_close(out.float(), want_o.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, want_l, atol=1e-4, rtol=0)
    assert out.isfinite().all()


def test_more_queries_than_keys(ops):
    """Sq = 5 over sequences of 3 and 0 keys (no appends): rows without a row of the prefill call
    get 0 and -inf; a transposed [B, S, H, d] view works without a copy."""
    op, g = ops["causal"], torch.Generator().manual_seed(2)
    kc, vc = caches(g)
    q = torch.randn(B, 5, HQ, D, generator=g).transpose(1, 2)
    seqlens = torch.tensor([3, 0, 30], dtype=torch.int32)
    out, lse = op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=True)
    ks, vs = whole_sequences(kc, vc, seqlens, None, None, None)
    want_o, want_l = prefill_rows(op, q, ks, vs, {}, g)
    torch.testing.assert_close(out, want_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=2e-5, rtol=1e-5)
    assert (out[0, :, :2] == 0).all() and (lse[1] == float("-inf")).all() and (out[1] == 0).all()


def test_values_out_of_range_give_nan_never_out_of_bounds(ops):
    """Device-side values out of range: the sequence's rows are NaN and its cache untouched, the
    others are right; validate=True raises ValueError naming the argument instead."""
    op, g = ops["causal"], torch.Generator().manual_seed(3)
    kc, vc = caches(g)
    kn, vn = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    q = torch.randn(B, HQ, 1, D, generator=g)
    good = op.with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=torch.tensor([5, 9, 12], dtype=torch.int32),
                           k=kn, v=vn)
    for seqlens, leftpad in (([5, CAP, 12], None), ([5, -4, 12], None), ([5, 9, 12], [0, 10, 0])):
        seqlens = torch.tensor(seqlens, dtype=torch.int32)
        leftpad = torch.tensor(leftpad, dtype=torch.int32) if leftpad is not None else None
        k2, v2 = kc.clone(), vc.clone()
        out = op.with_kvcache(q, k2, v2, cache_seqlens=seqlens, cache_leftpad=leftpad, k=kn, v=vn)
        assert out[1].isnan().all() and torch.equal(k2[1], kc[1])
        torch.testing.assert_close(out[[0, 2]], good[[0, 2]], atol=1e-6, rtol=0)
        with pytest.raises(ValueError, match="cache_leftpad: entry 1" if leftpad is not None else
                           "cache_seqlens: entry 1"):
            op.with_kvcache(q, k2, v2, cache_seqlens=seqlens, cache_leftpad=leftpad, k=kn, v=vn, validate=True)
    pool_k, pool_v, table = to_paged(kc, vc, 16, g)
    table[2, 0] = pool_k.shape[0]  # outside the pool
    table[0, 2] = -1  # a page sequence 0 does not reach: harmless
    out = op.with_kvcache(q, pool_k, pool_v, block_table=table, cache_seqlens=torch.tensor([5, 9, 12],
                          dtype=torch.int32))
    assert out[2].isnan().all() and out[:2].isfinite().all()
    n = pool_k.shape[0]
    with pytest.raises(ValueError, match=rf"block_table: entry \[2, 0\] is {n}, outside the pool of {n} pages"):
        op.with_kvcache(q, pool_k, pool_v, block_table=table, cache_seqlens=torch.tensor([5, 9, 12],
                        dtype=torch.int32), validate=True)


def test_bad_arguments_name_the_argument(ops):
    op = ops["sliding_window"]
    q, kc, vc = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    n = torch.tensor([3, 4], dtype=torch.int32)
    ok = {"cache_seqlens": n, "window": 4}
    pool = torch.randn(4, 16, 2, 16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    cases = [
        (ValueError, "cache_seqlens: expected an int32", dict(ok, cache_seqlens=n.long())),
        (ValueError, r"cache_seqlens: expected .*\[batch\] = \[2\]", dict(ok, cache_seqlens=n[:1])),
        (ValueError, "block_table: expected an int32", dict(ok, block_table=table.long())),
        (ValueError, "v: k and v are given together", dict(ok, k=torch.randn(2, 2, 1, 16))),
        (ValueError, r"k: expected .*\[2, 2, 1, 16\]", dict(ok, k=torch.randn(2, 2, 1, 8), v=torch.randn(2, 2, 1, 8))),
        (ValueError, "k: 9 new keys exceed the cache's capacity of 8",
         dict(ok, k=torch.randn(2, 2, 9, 16), v=torch.randn(2, 2, 9, 16))),
        (ValueError, "cache_leftpad: expected an int32", dict(ok, cache_leftpad=torch.zeros(2))),
        (ValueError, "num_splits: expected an int >= 0", dict(ok, num_splits=-1)),
        (TypeError, "num_splits: expected an int", dict(ok, num_splits=1.5)),
        (NotImplementedError, "dropout_p: with_kvcache is inference only", dict(ok, dropout_p=0.1)),
        (TypeError, "block_mask: not an argument of with_kvcache", dict(ok, block_mask=None)),
        (TypeError, "missing parameter", {"cache_seqlens": n}),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            op.with_kvcache(q, kc, vc, **kw)
    with pytest.raises(ValueError, match="k_cache: page_size .* is 300, expected 1 to 256"):
        op.with_kvcache(q, torch.randn(2, 300, 2, 16), torch.randn(2, 300, 2, 16), block_table=table, **ok)
    with pytest.raises(ValueError, match="v_cache: shape"):
        op.with_kvcache(q, pool, pool[:3], block_table=table, **ok)
    with pytest.raises(ValueError, match=r"k_cache: 3 kv heads \(dim 1 of a contiguous cache .*needs block_table\) "
                                         "do not divide 4"):
        op.with_kvcache(q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16), **ok)
    # a cache in the other layout than block_table says: the error names the layout it was read as
    with pytest.raises(ValueError, match=r"k_cache: 8 kv heads \(dim 2 of a paged cache .*block_table is given\)"):
        op.with_kvcache(q, torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16), block_table=table, **ok)
    for name in ("cache_seqlens", "block_table", "cache_leftpad", "k", "v"):
        with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor"):
            op.with_kvcache(q, kc, vc, **(ok | {name: [5, 7]}))
    for i, name in enumerate(("q", "k_cache", "v_cache")):
        args = [q, kc, vc]
        args[i] = args[i].tolist()
        with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor, got list"):
            op.with_kvcache(*args, **ok)
    with pytest.raises(ValueError, match="k_cache: dtype"):
        op.with_kvcache(q, kc.double(), vc.double(), **ok)
    with pytest.raises(NotImplementedError, match="q: with_kvcache is inference only"):
        op.with_kvcache(q.requires_grad_(), kc, vc, **ok)
    with torch.no_grad():
        op.with_kvcache(q, kc, vc, **ok)  # fine without grad mode
    with pytest.raises(NotImplementedError, match="inference only"):
        op.torch_kvcache(q, kc, vc, n, None, None, None, None, None, 0, 4)
    # FlashAttention's keywords without a counterpart here say what to do instead
    for name, match in (("cache_batch_idx", "index the caches yourself"), ("rotary_cos", "rotary embedding"),
                        ("softmax_scale", "pass scale="), ("causal", "spec's mask"),
                        ("window_size", "sliding-window spec")):
        with pytest.raises(TypeError, match=f"^{name}: FlashAttention's flash_attn_with_kvcache takes it.*{match}"):
            op.with_kvcache(q, kc, vc, **(ok | {name: 1}))
    # one tensor as both caches: fine to read, refused when the call writes new keys into it
    with torch.no_grad():
        op.with_kvcache(q, kc, kc, **ok)
        new = torch.randn(2, 2, 1, 16)
        for vcache in (kc, kc[:, :, :]):
            with pytest.raises(ValueError, match="v_cache: is k_cache's memory"):
                op.with_kvcache(q, kc, vcache, k=new, v=new, **ok)
        both = torch.randn(2, 2, 2, 8, 16)  # k and v halves of one buffer (interleaved by batch): allowed
        op.with_kvcache(q, both[:, 0], both[:, 1], k=new, v=new, **ok)


def test_reserved_names_and_families_without_decode(ops):
    for name in ("k_cache", "cache_seqlens", "block_table", "cache_leftpad", "num_splits", "validate"):
        with pytest.raises(flashgen.SpecError, match=name):
            flashgen.compile(f"attention r {{ param {name}: int\n mask = kv < {name} }}")
    spec = ops["causal"].spec
    for arch in ("sm_90a", "sm_80"):  # sm90 has no decode kernels: sm80 serves decode calls on Hopper too
        call = families.Call("cuda", arch, ir.DType.BF16, 128, frozenset({"decode"}))
        assert families.choose(spec, call).family.name == "sm80"
    call = families.Call("cuda", "sm_90a", ir.DType.BF16, 128, frozenset({"decode"}))
    with pytest.raises(NotImplementedError, match="family sm90 .*has no decode kernels"):
        families.choose(spec, call, family="sm90")
    assert families.with_feature("decode") == ("sm80", "cpu")
    assert families.complete(families.get("sm80"))  # decode is not part of completeness


def test_opcheck_mutates_declared_caches(ops):
    """The decode op's schema (caches mutated), fake implementation and autograd registration."""
    op, g = ops["alibi"], torch.Generator().manual_seed(9)
    kc, vc = caches(g, 32)
    pool_k, pool_v, table = to_paged(kc, vc, 8, g)
    args = (torch.randn(B, HQ, 2, D, generator=g), pool_k, pool_v, torch.tensor([3, 9, 20], dtype=torch.int32),
            table, torch.randn(B, HKV, 2, D, generator=g), torch.randn(B, HKV, 2, D, generator=g), None, None, 0,
            torch.linspace(0.1, 0.4, HQ))
    torch.library.opcheck(op.torch_kvcache, args)


# ------------------------------------------------------------ merge_attention


def attention64(q, k, v):
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_merge_equals_attention_over_the_union(ops):
    """Partials of the kernels over three key chunks merge into attention over all keys."""
    op, g = ops["dense"], torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 9, D, generator=g), torch.randn(2, 4, 30, D, generator=g), \
        torch.randn(2, 4, 30, D, generator=g)
    parts = [op(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 7), (7, 8), (8, 30))]
    out, lse = flashgen.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    want_o, want_l = op(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_l, atol=1e-5, rtol=1e-5)


def test_merge_gradients_match_full_attention():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (5, 12, 12))
    parts = [attention64(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 4), (4, 12))]
    out, lse = flashgen.merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    w_o, w_l = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * w_o).sum() + (lse * w_l).sum(), (q, k, v))
    ref_o, ref_l = attention64(q, k, v)
    want = torch.autograd.grad((ref_o * w_o).sum() + (ref_l * w_l).sum(), (q, k, v))
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b)
    o1, o2 = (torch.randn(2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    l1 = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    l2 = torch.randn(2, 4, generator=g, dtype=torch.float64)
    l2[0, 1] = float("-inf")
    l2.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c, d: flashgen.merge_attention([a, b], [c, d]), (o1, o2, l1, l2))


def test_merge_minus_inf_partials_weigh_nothing():
    g = torch.Generator().manual_seed(8)
    o1 = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    l1 = torch.randn(2, 5, generator=g)
    l1[1, 2] = float("-inf")
    l1.requires_grad_()
    o2 = torch.full((2, 5, 4), float("nan"))
    o2[1, 2] = 3.0  # the one row where it is all there is... but with -inf too
    o2.requires_grad_()
    l2 = torch.full((2, 5), float("-inf"), requires_grad=True)
    out, lse = flashgen.merge_attention([o1, o2], [l1, l2])
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(out[keep], o1[keep].detach()) and torch.equal(lse[keep], l1[keep].detach())
    assert (out[1, 2] == 0).all() and lse[1, 2] == float("-inf")  # every partial -inf: 0 and -inf
    (out.sum() + lse[keep].sum()).backward()
    for t in (o1, l1, o2, l2):
        assert t.grad.isfinite().all()
    assert (o2.grad == 0).all() and (l2.grad == 0).all() and (o1.grad[1, 2] == 0).all()
    with pytest.raises(ValueError, match=r"lses\[1\]: expected shape \(2, 5\)"):
        flashgen.merge_attention([o1, o1], [l1, l1[0]])
    with pytest.raises(ValueError, match="outs: expected at least one"):
        flashgen.merge_attention([], [])
    with pytest.raises(ValueError, match="lses: 1 entries for 2 outs"):
        flashgen.merge_attention([o1, o1], [l1])


def test_calls_keep_none_of_their_tensors_alive(ops):
    """A decode call (eager and through the registered op, first and repeated metadata) holds no
    reference to its tensors afterwards: a cache that kept them would keep a CUDA graph pool's
    allocations alive (torch.compile's mode="reduce-overhead" refuses that)."""
    import gc
    import weakref

    op, g = ops["causal"], torch.Generator().manual_seed(5)
    kc, vc = caches(g, CAP)
    for call in ("eager", "op", "eager", "op"):
        tensors = {"q": torch.randn(B, HQ, 2, D, generator=g),
                   "cache_seqlens": torch.tensor([5, 17, 30], dtype=torch.int32),
                   "cache_leftpad": torch.tensor([0, 2, 1], dtype=torch.int32),
                   "k": torch.randn(B, HKV, 2, D, generator=g), "v": torch.randn(B, HKV, 2, D, generator=g)}
        refs = {n: weakref.ref(t) for n, t in tensors.items()}
        t = tensors
        if call == "eager":
            out = op.with_kvcache(t.pop("q"), kc, vc, **t)
        else:
            out, _ = op.torch_kvcache(t.pop("q"), kc, vc, t.pop("cache_seqlens"), None, t.pop("k"), t.pop("v"),
                                      t.pop("cache_leftpad"), None, 0)
        del tensors, t
        gc.collect()
        assert out.shape == (B, HQ, 2, D)
        alive = [n for n, r in refs.items() if r() is not None]
        assert not alive, f"{call} call: {alive} still referenced"


def test_appended_keys_in_the_caches_own_memory_are_copied_first(ops):
    """New k / v that are views of the cache they are written into (or of the other cache)
    reach the cache as they were before the call, not as the append half-overwrote them."""
    op = ops["causal"]
    base = torch.arange(CAP, dtype=torch.float32).view(1, 1, CAP, 1).expand(B, HKV, CAP, D).contiguous()
    kc, vc = base.clone(), base.clone() + 100
    want_k, want_v = kc[:, :, 4:8].clone(), vc[:, :, 2:6].clone()
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(1))
    lens = torch.full((B,), 5, dtype=torch.int32)
    op.with_kvcache(q, kc, vc, cache_seqlens=lens, k=kc[:, :, 4:8], v=vc[:, :, 2:6])
    assert torch.equal(kc[:, :, 5:9], want_k) and torch.equal(vc[:, :, 5:9], want_v)


def test_writing_into_caches_that_share_memory_is_refused_on_every_call(ops):
    """A call that appends k / v into caches with an element in common (views of one buffer that
    overlap fully or in part: shifted slots, shifted pages, a flat buffer cut with an overlap)
    raises ValueError naming k_cache and v_cache before anything is written, on the first call of
    its metadata and on later calls of the same metadata (the memoised validation and plan:
    pointers are no part of their keys). Views of one buffer that share no element still work:
    its two halves, k and v interleaved slot by slot."""
    op, g = ops["causal"], torch.Generator().manual_seed(6)
    q = torch.randn(B, HQ, 1, D, generator=g)
    kn, vn = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    lens = torch.tensor([3, 9, 20], dtype=torch.int32)

    def call(kc, vc, **kw):
        return op.with_kvcache(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, return_lse=True, **kw)

    def refused(kc, vc, **kw):
        before = kc.clone(), vc.clone()
        with pytest.raises(ValueError, match="^v_cache: is k_cache's memory.*pass k_cache and v_cache that share"):
            call(kc, vc, **kw)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # refused before any launch

    slots = torch.randn(B, HKV, 2 * CAP, D, generator=g)  # slots [0, CAP) and [CAP/2, 3 CAP/2) overlap
    n = B * HKV * CAP * D
    flat = torch.randn(2 * n, generator=g)  # two cuts of a flat buffer sharing 5 elements
    shifted = torch.randn(B, CAP + 1, HKV, D, generator=g)  # [B, S, H, d] caches one slot apart
    table = torch.arange(B * 3, dtype=torch.int32).view(B, 3)
    pool = torch.randn(B * 3 + 2, 16, HKV, D, generator=g)  # pages [0, 9) and [2, 11) overlap
    cases = [
        ((slots[:, :, :CAP], slots[:, :, CAP // 2:CAP // 2 + CAP]), (slots[:, :, :CAP], slots[:, :, CAP:]), {}),
        ((flat[:n].view(B, HKV, CAP, D), flat[n - 5:2 * n - 5].view(B, HKV, CAP, D)),
         (flat[:n].view(B, HKV, CAP, D), flat[n:].view(B, HKV, CAP, D)), {}),
        ((shifted[:, :CAP].transpose(1, 2), shifted[:, 1:].transpose(1, 2)), None, {}),
        ((pool[:B * 3], pool[2:]), (pool[:B * 3], torch.randn(B * 3, 16, HKV, D, generator=g)),
         {"block_table": table}),
    ]
    for overlapping, apart, kw in cases:
        refused(*overlapping, **kw)  # the metadata's first call: the full validation
        if apart is not None:  # the same metadata, caches apart: validated and planned ...
            kc, vc = apart
            want = call(kc.clone(), vc.clone(), **kw)
            got = call(kc, vc, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        refused(*overlapping, **kw)  # ... and overlapping caches of that metadata still refused
    # views of one buffer that share no element: its two halves, and k and v interleaved by slot
    halves = torch.randn(2, B, HKV, CAP, D, generator=g)
    inter = torch.randn(B, CAP, 2, HKV, D, generator=g)
    for kc, vc in ((halves[0], halves[1]), (inter[:, :, 0].transpose(1, 2), inter[:, :, 1].transpose(1, 2))):
        want_k, want_v = kc.clone(), vc.clone()
        want = call(want_k, want_v)
        for _ in range(2):  # validated, then planned
            got = call(kc, vc)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_dropout_p_zero_is_accepted_and_anything_else_refused(ops):
    op, g = ops["causal"], torch.Generator().manual_seed(2)
    kc, vc = caches(g, CAP)
    q = torch.randn(B, HQ, 1, D, generator=g)
    lens = torch.tensor([3, 9, 40], dtype=torch.int32)
    torch.testing.assert_close(op.with_kvcache(q, kc, vc, cache_seqlens=lens, dropout_p=0.0),
                               op.with_kvcache(q, kc, vc, cache_seqlens=lens), rtol=0, atol=0)
    for p in (0.1, True):
        with pytest.raises(NotImplementedError, match="dropout_p"):
            op.with_kvcache(q, kc, vc, cache_seqlens=lens, dropout_p=p)


def test_validate_under_fullgraph_compile_names_the_argument(ops):
    """validate=True reads device values on the host: fullgraph compilation refuses it with our
    reason (validate=False), a plain compile breaks the graph there and still validates."""
    op, g = ops["causal"], torch.Generator().manual_seed(3)
    kc, vc = caches(g, CAP)
    q = torch.randn(B, HQ, 1, D, generator=g)
    torch._dynamo.reset()
    f = torch.compile(lambda q, n: op.with_kvcache(q, kc, vc, cache_seqlens=n, validate=True), fullgraph=True)
    with pytest.raises(Exception, match="pass validate=False"):
        f(q, torch.tensor([3, 9, 40], dtype=torch.int32))
    f = torch.compile(lambda q, n: op.with_kvcache(q, kc, vc, cache_seqlens=n, validate=True))
    with pytest.raises(ValueError, match="cache_seqlens"):
        f(q, torch.tensor([3, 9, CAP + 1], dtype=torch.int32))


def test_planned_calls_equal_validated_calls_and_key_on_scale_and_values(ops):
    """A repeated decode call launches from its plan (runtime/decode.py): it gives what the first,
    fully validated call gave, and a different scale or parameter value is a different plan."""
    op, g = ops["sliding_window"], torch.Generator().manual_seed(4)
    kc, vc = caches(g, CAP)
    q = torch.randn(B, HQ, 2, D, generator=g)
    lens = torch.tensor([7, 20, 41], dtype=torch.int32)
    first = {(w, s): op.with_kvcache(q, kc, vc, cache_seqlens=lens, window=w, scale=s, return_lse=True)
             for w in (5, 9) for s in (None, 0.3)}
    for (w, s), (out, lse) in first.items():
        again = op.with_kvcache(q, kc, vc, cache_seqlens=lens.clone(), window=w, scale=s, return_lse=True)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    outs = [o for o, _ in first.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
    # a bad value after a planned call of the same metadata is still refused
    with pytest.raises(TypeError, match="window"):
        op.with_kvcache(q, kc, vc, cache_seqlens=lens, window=5.0)


def test_empty_calls_launch_nothing_and_load_no_library(ops, monkeypatch):
    op = ops["causal"]

    def refuse(*a, **k):
        raise AssertionError("an empty decode call asked for a library")
    monkeypatch.setattr(op, "decode_library", refuse)
    kc = torch.zeros(0, HKV, CAP, D)
    out, lse = op.with_kvcache(torch.zeros(0, HQ, 1, D), kc, kc.clone(), cache_seqlens=torch.zeros(0, dtype=torch.int32),
                               return_lse=True)
    assert out.shape == (0, HQ, 1, D) and lse.shape == (0, HQ, 1)
    kc, vc = caches(torch.Generator().manual_seed(6), CAP)
    out = op.with_kvcache(torch.zeros(B, HQ, 0, D), kc, vc, cache_seqlens=torch.full((B,), 4, dtype=torch.int32))
    assert out.shape == (B, HQ, 0, D)
