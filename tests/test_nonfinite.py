"""Non-finite inputs on the CPU family (DESIGN.md, "Non-finite values"; the checks are in
nonfinite_cases.py): NaN / +inf scores at kept keys give NaN rows (out and LSE), −inf scores
count as masked, NaN / inf in V reaches the rows that keep that key, and masked or out-of-range
poison never reaches a row; forward and backward, padded, packed, block-sparse and decode calls."""

import pytest
import torch
from nonfinite_cases import INF, NAN, float64_params, poison, probabilities, run_case
from variant_cases import make_params, op

import flashgen
from flashgen import reference

SPECS = ["dense", "causal", "softcap", "alibi", "sliding_window", "document"]
B, HQ, HKV, N, D = 2, 4, 2, 320, 32


def padded_inputs(name, seed=0, positive_q0=False, dtype=torch.float32, device="cpu", heads=(HQ, HKV), d=D):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q, k, v = (torch.randn(B, h, N, d, generator=g) for h in (hq, hkv, hkv))
    if positive_q0:  # q·k = +inf for every row at a key holding +inf in element 0
        q[..., 0] = q[..., 0].abs() + 0.5
    params = make_params(name, B, hq, N, N, "cpu", g, variant=1 if name == "sliding_window" else 0)
    params = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in params.items()}
    return [t.to(dtype).to(device) for t in (q, k, v)], params


# (what, index, value, q[..., 0] > 0): one poisoned element or row of q, k or v.
PADDED = {
    "q_nan": ("q", (0, 1, 100, 3), NAN, False),
    "k_inf_kept": ("k", (1, 0, 50, 0), INF, True),
    "k_inf_mixed_sign": ("k", (1, 1, 60, 0), INF, False),  # +inf or −inf scores, by q's sign
    "k_nan_late_key": ("k", (0, 1, N - 30), NAN, False),  # kept by late rows only when causal
    "v_nan_row": ("v", (0, 0, 7), NAN, False),
    "v_inf": ("v", (1, 1, 200, 5), INF, False),
}


def poisoned(tensors, what, index, value):
    i = "qkv".index(what)
    return [poison(t, index, value) if j == i else t for j, t in enumerate(tensors)]


@pytest.mark.parametrize("case", list(PADDED))
@pytest.mark.parametrize("name", SPECS)
def test_padded(name, case):
    what, index, value, pos = PADDED[case]
    clean, params = padded_inputs(name, seed=len(name), positive_q0=pos)
    run_case(op(name), clean, poisoned(clean, what, index, value), params=params, where=f"{name} {case}")


def test_rows_without_keys_stay_empty_with_nan_queries():
    """A row that sees no key (causal, Nq > Nk) stays out 0 / LSE −inf even with NaN in q: only
    a kept key's score can make a row NaN."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 48, 16, generator=g), torch.randn(1, 2, 16, 16, generator=g), \
        torch.randn(1, 2, 16, 16, generator=g)
    q2 = poison(q, (0, 0, slice(0, 40)), NAN)  # rows 0..31 see no key; 32..39 do
    out, lse = op("causal")(q2, k, v, return_lse=True)
    assert torch.equal(out[0, 0, :32], torch.zeros(32, 16)) and torch.isneginf(lse[0, 0, :32]).all()
    assert out[0, 0, 32:40].isnan().all() and lse[0, 0, 32:40].isnan().all()
    assert torch.equal(out[0, 1], op("causal")(q, k, v)[0, 1]) and out[0, 0, 40:].isfinite().all()


BIAS = {  # (index into bias [B, Hq, N, N], value)
    "row_all_neg_inf": ((0, 1, 10), -INF),  # every score −inf: an empty row (out 0, LSE −inf, zero grads)
    "some_neg_inf": ((1, 2, slice(0, 200), slice(3, 90)), -INF),  # masked entries
    "pos_inf": ((0, 3, 77, 5), INF),
    "nan": ((1, 0, 250, 300), NAN),
}


@pytest.mark.parametrize("case", list(BIAS))
def test_score_expression_non_finite(case):
    """Scores made −inf, +inf or NaN by a score expression (an additive bias)."""
    index, value = BIAS[case]
    clean, _ = padded_inputs("dense", seed=3)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(B, HQ, N, N, generator=g)
    run_case(op("bias"), clean, clean, params={"bias": bias}, poisoned_params={"bias": poison(bias, index, value)},
             where=f"bias {case}")
    if case == "row_all_neg_inf":
        out, lse = op("bias")(*clean, bias=poison(bias, index, value), return_lse=True)
        assert torch.equal(out[0, 1, 10], torch.zeros(D)) and torch.isneginf(lse[0, 1, 10])


# ---- block-sparse calls --------------------------------------------------------------------

def block_pattern(hq=HQ):
    pat = torch.ones(B, hq, 3, 3, dtype=torch.bool)  # 128-blocks of N = 320: 3 x 3
    pat[..., 1, :] = False  # query block 1 (rows 128..255) sees nothing
    pat[..., :, 2] = False  # key block 2 (keys 256..319) is seen by nobody
    pat[0, 1, 0, 1] = False
    return pat


BLOCK = {
    "excluded_key_block_nan": [("k", (0, slice(None), slice(256, N)), NAN), ("v", (1, 0, 300), NAN)],
    "empty_query_block_nan_q": [("q", (0, 2, slice(130, 250)), NAN)],
    "k_inf_listed": [("k", (1, 1, 140, 0), INF)],
    "v_nan_listed": [("v", (0, 1, 20), NAN)],
    "q_nan_listed": [("q", (1, 3, 60, 0), NAN)],
}


@pytest.mark.parametrize("case", list(BLOCK))
@pytest.mark.parametrize("name", ["dense", "causal", "sliding_window"])
def test_block_sparse(name, case):
    clean, params = padded_inputs(name, seed=11, positive_q0=True)
    bm = flashgen.BlockMask.from_pattern(block_pattern(), 128)
    bad = clean
    for what, index, value in BLOCK[case]:
        bad = poisoned(bad, what, index, value)
    ex = run_case(op(name), clean, bad, params=params, call={"block_mask": bm}, where=f"{name} {case} {bm}")
    if case.startswith("excluded") or case.startswith("empty"):
        assert not ex.reachable


# ---- packed (varlen) calls -----------------------------------------------------------------

LQ, LK = [100, 200, 77], [150, 200, 90]


def packed_inputs(seed, positive_q0=True, dtype=torch.float32, device="cpu", heads=(HQ, HKV), d=D):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q, k, v = (torch.randn(sum(n), h, d, generator=g) for n, h in ((LQ, hq), (LK, hkv), (LK, hkv)))
    if positive_q0:
        q[..., 0] = q[..., 0].abs() + 0.5
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                   device=device)
    call = {"cu_seqlens_q": cu(LQ), "cu_seqlens_k": cu(LK), "max_seqlen_q": max(LQ), "max_seqlen_k": max(LK)}
    return [t.to(dtype).to(device) for t in (q, k, v)], call


PACKED = {
    "whole_sequence_nan": [("q", slice(100, 300), NAN), ("k", slice(150, 350), NAN), ("v", slice(150, 350), NAN)],
    "neighbour_keys_nan": [("k", slice(150, 350), NAN), ("v", slice(150, 350), NAN)],
    "k_inf_last_sequence": [("k", (400, 1, 0), INF)],
    "v_nan_first_sequence": [("v", (3, 0), NAN)],
    "q_nan": [("q", (290, 2, 1), NAN)],
}


@pytest.mark.parametrize("case", list(PACKED))
@pytest.mark.parametrize("name", ["dense", "causal", "sliding_window"])
def test_packed(name, case):
    clean, call = packed_inputs(seed=5)
    params = {"window": 16} if name == "sliding_window" else {}
    bad = clean
    for what, index, value in PACKED[case]:
        bad = poisoned(bad, what, index, value)
    ex = run_case(op(name), clean, bad, params=params, call=call, where=f"{name} {case}")
    if case.startswith("whole") or case.startswith("neighbour"):  # sequence 1's rows are NaN
        assert ex.score_nan[0, :, 100:300].all() and not ex.score_nan[0, :, :100].any()


# ---- decode with a KV cache ----------------------------------------------------------------

CAP, SQ = 48, 3


def decode_reference(spec, q, kc, vc, seqlens, params, g):
    """out, lse [B, Hq, Sq] and P [B, Hq, Sq, CAP] of the float64 reference on each whole
    sequence (its last Sq rows are q's)."""
    Bn, Hq, Sq, d = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], -INF, dtype=torch.float64)
    P = torch.zeros(Bn, Hq, Sq, kc.shape[2], dtype=torch.float64)
    for b in range(Bn):
        L = int(seqlens[b])
        qf = torch.randn(1, Hq, L, d, generator=g, dtype=torch.float64)
        qf[0, :, L - Sq:] = q[b].double()
        kb, vb = kc[b:b + 1, :, :L].double(), vc[b:b + 1, :, :L].double()
        o, l = reference.attention(spec, qf, kb, vb, return_lse=True, **params)
        out[b], lse[b] = o[0, :, L - Sq:], l[0, :, L - Sq:]
        P[b, :, :, :L] = probabilities(spec, qf, kb, packed=False, **params)[0, :, L - Sq:]
    return out, lse, P


DECODE = {
    "past_seqlen_nan": [("k", (slice(None), slice(None), slice(40, CAP)), NAN),
                        ("v", (slice(None), slice(None), slice(40, CAP)), NAN)],
    "q_nan": [("q", (1, 2, 0, 5), NAN)],
    "k_inf_kept": [("k", (0, 1, 38, 0), INF)],
    "k_nan_kept": [("k", (2, 0, 20), NAN)],
    "v_nan_kept": [("v", (2, 1, 30), NAN)],
}


@pytest.mark.parametrize("case", list(DECODE))
@pytest.mark.parametrize("name", ["dense", "causal", "sliding_window", "softcap"])
def test_decode(name, case):
    fop = op(name)
    g = torch.Generator().manual_seed(17)
    q = torch.randn(B + 1, HQ, SQ, D, generator=g)
    q[..., 0] = q[..., 0].abs() + 0.5
    kc, vc = torch.randn(B + 1, HKV, CAP, D, generator=g), torch.randn(B + 1, HKV, CAP, D, generator=g)
    seqlens = torch.tensor([40, 17, 40], dtype=torch.int32)
    params = {"window": 16} if name == "sliding_window" else {"softcap": 30.0} if name == "softcap" else {}
    bad = [q, kc, vc]
    for what, index, value in DECODE[case]:
        bad = poisoned(bad, what, index, value)
    o0, l0 = fop.with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=seqlens, return_lse=True, **params)
    o1, l1 = fop.with_kvcache(bad[0], bad[1].clone(), bad[2].clone(), cache_seqlens=seqlens, return_lse=True,
                              **params)
    p64 = float64_params(params)
    ref0, lref0, P = decode_reference(fop.spec, q, kc, vc, seqlens, p64, torch.Generator().manual_seed(1))
    ref1, lref1, _ = decode_reference(fop.spec, bad[0], bad[1], vc, seqlens, p64, torch.Generator().manual_seed(1))
    torch.testing.assert_close(o0.double(), ref0, atol=1e-5, rtol=1e-5)
    S = lref1.isnan()
    vbad = ~bad[2].isfinite().all(-1)[:, :, None, :].repeat_interleave(HQ // HKV, 1)  # [B, Hq, 1, CAP]
    keeps_bad_v = ((P > 0) & vbad).any(-1) & ~S
    assert l1[S].isnan().all() and o1[S].isnan().all()
    assert not o1[keeps_bad_v].isfinite().all(-1).any()
    # Other rows: bitwise the clean call's where the reference did not change; rows of a sequence
    # with a NaN V row that mask it may see 0 x NaN (one tile holds all Sq rows).
    rest = ~S & ~keeps_bad_v & ~vbad.any(-1).expand(S.shape)
    assert l1[~S].isfinite().all()
    same = rest & (ref1 == ref0).all(-1) & (lref1 == lref0)
    assert torch.equal(o1[same], o0[same]) and torch.equal(l1[same], l0[same])
    torch.testing.assert_close(o1[rest].double(), ref1[rest], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1[~S].double(), lref1[~S], atol=1e-5, rtol=1e-5)
