"""Launch plans of the raw ops (runtime/plans.py): a call of ``torch.ops.flashgen.<spec>`` or
its ``_bwd`` with input metadata seen before skips the validation and the family and library
choice. Checked on the CPU family: the planned call's results equal the validated full path's
bit for bit on fresh inputs (so the plan takes each call's pointers), a new scalar value, dtype
or shape is validated anew (and refused when bad), and calls that cannot be planned are not."""

import pytest
import torch
from variant_cases import op as spec_op

import flashgen
from flashgen.runtime import launch, plans


@pytest.fixture(autouse=True)
def _unpoisoned(monkeypatch):
    monkeypatch.setattr(launch, "poison_outputs", False)  # poisoned calls are never planned


def inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 40, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 56, 32, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(2, 4, 40, 32, generator=g).to(dtype)
    return q, k, v, dout


def raw_args(op, params: dict) -> list:
    """The spec's parameters in declaration order, then the dropout arguments (p 0)."""
    return [params[p.name] for p in op.spec.params] + ([0.0, None] if op.spec.dropout else [])


def spy(monkeypatch, name: str) -> list:
    """Record the results of plans.<name> (None: the planned call fell back)."""
    seen, real = [], getattr(plans, name)
    monkeypatch.setattr(plans, name, lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    return seen


@pytest.mark.parametrize("name", ["causal", "alibi", "gemma"])
def test_planned_raw_calls_match_the_full_path(name, monkeypatch):
    op = spec_op(name)
    fwd_plans, bwd_plans = op.raw_plans
    g = torch.Generator().manual_seed(2)
    params = {"alibi": {"slopes": torch.rand(4, generator=g)}, "gemma": {"window": 9, "softcap": 20.0}}.get(name, {})
    grads = [False] * len(op.grad_params)
    bwd = getattr(torch.ops.flashgen, op.name.split("::")[1] + "_bwd").default

    def run(seed):
        q, k, v, dout = inputs(seed)
        out, lse = op.torch_op(q, k, v, None, False, *raw_args(op, params))
        dq, dk, dv, _ = bwd(q, k, v, out, lse, dout, None, None, False, *params.values(), grads,
                            *([0.0, None] if op.spec.dropout else []))
        return q, k, v, out, lse, dq, dk, dv

    fwd_plans.clear()
    bwd_plans.clear()
    full = run(10)[3:]  # validated, planned
    assert len(fwd_plans) == 1 and len(bwd_plans) == 1
    fwd_runs, bwd_runs = spy(monkeypatch, "run_forward"), spy(monkeypatch, "run_backward")
    q, k, v, *planned = run(11)  # fresh tensors, same metadata: from the plans
    assert len(fwd_runs) == 1 and fwd_runs[0] is not None and len(bwd_runs) == 1
    fwd_plans.clear()
    bwd_plans.clear()
    again = run(11)[3:]  # the full path on the same inputs
    for a, b in zip(planned, again, strict=True):
        assert torch.equal(a, b)
    ref = flashgen.reference.attention(op.spec, q.double(), k.double(), v.double(), **params)
    assert (planned[0].double() - ref).abs().max() < 1e-4
    assert not all(torch.equal(a, b) for a, b in zip(full, planned, strict=True))  # other inputs, other results
    if name == "gemma":  # a new scalar value is validated anew (its own plan), a bad one refused
        q, k, v, _ = inputs(12)
        n = len(fwd_plans)
        out = op.torch_op(q, k, v, None, False, 3, 20.0)[0]
        ref3 = flashgen.reference.attention(op.spec, q.double(), k.double(), v.double(), window=3, softcap=20.0)
        assert (out.double() - ref3).abs().max() < 1e-4 and len(fwd_plans) == n + 1
        with pytest.raises(ValueError, match="softcap"):
            op.torch_op(q, k, v, None, False, 9, float("inf"))
        with pytest.raises(ValueError, match="differs from k"):  # new metadata (k's head dim) is validated
            op.torch_op(q, k[..., :16].contiguous(), v, None, False, 3, 20.0)


def test_raw_plans_follow_each_calls_block_lists(monkeypatch):
    """The planned forward and backward read each call's block lists: two patterns of the same
    shape give what the full path gives for each."""
    op = spec_op("causal")
    fwd_plans, bwd_plans = op.raw_plans
    q, k, v, dout = (t.requires_grad_(False) for t in inputs(20))
    pats = [torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(s)) > 0.4 for s in (1, 2)]
    masks = [flashgen.BlockMask.from_pattern(p, block_size=8) for p in pats]

    def grads(bm):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = op(qq, kk, vv, block_mask=bm)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    fwd_plans.clear()
    bwd_plans.clear()
    full = [grads(bm) for bm in masks]  # the first validated, the second from the plans
    assert len(fwd_plans) == 1 and len(bwd_plans) == 1
    fwd_plans.clear()
    bwd_plans.clear()
    second = grads(masks[1])  # the full path
    for a, b in zip(full[1], second, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(full[0][0], full[1][0])


def test_raw_calls_that_are_not_planned(monkeypatch):
    """Dropout p > 0 and the packed layout take the full path every time; a change of the
    environment that selects libraries plans anew."""
    drop = spec_op("dropout")
    fwd_plans, _ = drop.raw_plans
    q, k, v, _ = inputs(30)
    fwd_plans.clear()
    state = flashgen.dropout_state(1, "cpu")
    drop.torch_op(q, k, v, None, False, 0.2, state)
    assert not fwd_plans
    drop.torch_op(q, k, v, None, False, 0.0, None)
    assert len(fwd_plans) == 1
    causal = spec_op("causal")
    fwd_plans, _ = causal.raw_plans
    fwd_plans.clear()
    qp, kp, vp = torch.randn(30, 4, 32), torch.randn(30, 2, 32), torch.randn(30, 2, 32)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    causal.torch_op(qp, kp, vp, None, False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20, max_seqlen_k=20)
    assert not fwd_plans
    causal.torch_op(q, k, v, None, False)
    causal.torch_op(q, k, v, None, False)
    assert len(fwd_plans) == 1
    monkeypatch.setattr(flashgen.env, "library_selection", lambda: ("another",))
    causal.torch_op(q, k, v, None, False)
    assert len(fwd_plans) == 2


def test_negative_zero_scale_is_its_own_plan():
    """-0.0 and 0.0 are equal floats: the plans key the scale by its bits, so a -0.0 call after a
    0.0 one runs with -0.0 (1 / score flips sign), as the full path does."""
    op = flashgen.compile("attention inv { score = tanh(1.0 / score) }")
    fwd_plans, _ = op.raw_plans
    q, k, v, _ = inputs(40)
    fwd_plans.clear()
    op.torch_op(q, k, v, 0.0, False)
    planned = op.torch_op(q, k, v, -0.0, False)[0]
    fwd_plans.clear()
    full = op.torch_op(q, k, v, -0.0, False)[0]
    assert torch.equal(planned, full)
    assert not torch.equal(full, op.torch_op(q, k, v, 0.0, False)[0])
    # the eager call's own plans alike
    op.plans.clear()
    op(q, k, v, scale=0.0)
    assert torch.equal(op(q, k, v, scale=-0.0), full)


def test_a_bad_auto_block_mask_value_is_refused_only_where_read(monkeypatch):
    """The plan key holds FLASHGEN_AUTO_BLOCK_MASK's raw value: a value the full path would refuse
    where it reads it (CUDA per-call lists) does not fail a CPU call."""
    op = spec_op("causal")
    q, k, v, _ = inputs(41)
    monkeypatch.setenv("FLASHGEN_AUTO_BLOCK_MASK", "bogus")
    out = op.torch_op(q, k, v, None, False)[0]
    ref = flashgen.reference.attention(op.spec, q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 1e-4


def test_a_negated_view_is_materialised():
    """A lazily negated view (torch._neg_view) reads as its values, on the eager path too (which
    otherwise skips the dispatcher that materialises it)."""
    op = spec_op("causal")
    q, k, v, _ = inputs(42)
    ref = op.torch_op(-q, k, v, None, False)[0]
    assert torch.equal(op(torch._neg_view(q), k, v), ref)
    assert torch.equal(op.torch_op(torch._neg_view(q), k, v, None, False)[0], ref)


@pytest.mark.parametrize("value", [[0.1, 0.2], {"a": 1}, "slopes"], ids=["list", "dict", "str"])
def test_unplannable_parameter_values_get_the_validations_error(value):
    """A parameter passed as a value a plan key cannot hold (a list, a dict: unhashable) or of the
    wrong type takes the full path, whose validation names the argument, in the eager op call, the
    raw op and the decode call alike (not a TypeError from the plan lookup)."""
    import numpy as np

    op = spec_op("alibi")
    q, k, v, _ = inputs(7)
    want = r"^slopes: expected a torch.Tensor \(slopes: f32\[heads\]\), got "
    for bad in (value, np.asarray([0.1, 0.2], dtype=np.float32)):
        with pytest.raises(TypeError, match=want):
            op(q, k, v, slopes=bad)
        kc, vc = torch.zeros(2, 2, 64, 32), torch.zeros(2, 2, 64, 32)
        with pytest.raises(TypeError, match=want):
            op.with_kvcache(q[:, :, :1], kc, vc, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), slopes=bad)
    window = spec_op("sliding_window")
    with pytest.raises(TypeError, match=r"^window: expected an int, got list"):
        window(q, k, v, window=[3])
    assert plans.forward_key(op, q, k, v, None, [[0.1]], (), (None,) * 4, (None, None, None, [])) is None
