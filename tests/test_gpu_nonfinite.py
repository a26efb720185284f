"""Non-finite inputs on the CUDA families (DESIGN.md, "Non-finite values"): the CPU suite's
cases (test_nonfinite.py, checks in nonfinite_cases.py) on the sm80 and the sm90 family, bf16,
head dim 128, padded, packed and block-sparse calls, forward and backward. Each case forces its
family with flashgen.use_family; an sm90 forward's backward runs on sm90 where that family
serves it (dense and causal, padded, heads_q == heads_kv), else on sm80. Outputs are poisoned
with NaN before every launch (conftest)."""

import pytest
import torch
from nonfinite_cases import run_case
from test_nonfinite import (BIAS, BLOCK, PACKED, PADDED, SPECS, block_pattern, packed_inputs, padded_inputs,
                            poison, poisoned)
from variant_cases import op

import flashgen

pytestmark = pytest.mark.gpu

D_GPU = 128
FAMILIES = ["sm80", "sm90"]


def heads_of(family):
    # sm80: GQA 2:1; sm90: heads_q == heads_kv, so that its own backward serves dense / causal
    return (4, 2) if family == "sm80" else (2, 2)


@pytest.fixture(autouse=True)
def _device(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fam = request.node.callspec.params.get("family") if hasattr(request.node, "callspec") else None
    if fam == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on compute capability 9.0 only")


def families_of(fop, family, layout="padded", sparse=False, gqa=False):
    """(forward family, backward family, deterministic) of a case."""
    if family == "sm80":
        return "sm80", "sm80", True
    fop.family_for("cuda", torch.bfloat16, D_GPU, layout=layout, sparse=sparse, family="sm90")  # must serve
    try:
        fop.family_for("cuda", torch.bfloat16, D_GPU, layout=layout, sparse=sparse, family="sm90", backward=True)
        if not gqa:
            return "sm90", "sm90", False  # its backward has no deterministic mode
    except NotImplementedError:
        pass
    return "sm90", "sm80", True


@pytest.mark.parametrize("case", list(PADDED))
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_padded(family, name, case):
    what, index, value, pos = PADDED[case]
    hq, hkv = heads_of(family)
    if index[1] >= (hq if what == "q" else hkv):
        index = (index[0], index[1] % (hq if what == "q" else hkv), *index[2:])
    clean, params = padded_inputs(name, seed=len(name), positive_q0=pos, dtype=torch.bfloat16, device="cuda",
                                  heads=(hq, hkv), d=D_GPU)
    fop = op(name)
    fwd, bwd, det = families_of(fop, family, gqa=hq != hkv)
    run_case(fop, clean, poisoned(clean, what, index, value), params=params, family=fwd, bwd_family=bwd,
             deterministic=det, where=f"{family} {name} {case}")


@pytest.mark.parametrize("case", list(BIAS))
@pytest.mark.parametrize("family", FAMILIES)
def test_score_expression_non_finite(family, case):
    index, value = BIAS[case]
    hq, hkv = heads_of(family)
    index = (index[0], index[1] % hq, *index[2:])
    clean, _ = padded_inputs("dense", seed=3, dtype=torch.bfloat16, device="cuda", heads=(hq, hkv), d=D_GPU)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(2, hq, clean[0].shape[2], clean[1].shape[2], generator=g).cuda()
    fop = op("bias")
    fwd, bwd, det = families_of(fop, family, gqa=hq != hkv)
    run_case(fop, clean, clean, params={"bias": bias}, poisoned_params={"bias": poison(bias, index, value)},
             family=fwd, bwd_family=bwd, deterministic=det, where=f"{family} bias {case}")


@pytest.mark.parametrize("case", list(BLOCK))
@pytest.mark.parametrize("name", ["dense", "causal", "sliding_window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_sparse(family, name, case):
    hq, hkv = heads_of(family)
    clean, params = padded_inputs(name, seed=11, positive_q0=True, dtype=torch.bfloat16, device="cuda",
                                  heads=(hq, hkv), d=D_GPU)
    bm = flashgen.BlockMask.from_pattern(block_pattern(hq).cuda(), 128)
    bad = clean
    for what, index, value in BLOCK[case]:
        if len(index) > 1 and isinstance(index[1], int):
            index = (index[0], index[1] % (hq if what == "q" else hkv), *index[2:])
        bad = poisoned(bad, what, index, value)
    fop = op(name)
    fwd, bwd, det = families_of(fop, family, sparse=True, gqa=hq != hkv)
    ex = run_case(fop, clean, bad, params=params, call={"block_mask": bm}, family=fwd, bwd_family=bwd,
                  deterministic=det, where=f"{family} {name} {case} {bm}")
    if case.startswith("excluded") or case.startswith("empty"):
        assert not ex.reachable


@pytest.mark.parametrize("case", list(PACKED))
@pytest.mark.parametrize("name", ["dense", "causal", "sliding_window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed(family, name, case):
    hq, hkv = heads_of(family)
    clean, call = packed_inputs(seed=5, dtype=torch.bfloat16, device="cuda", heads=(hq, hkv), d=D_GPU)
    params = {"window": 16} if name == "sliding_window" else {}
    bad = clean
    for what, index, value in PACKED[case]:
        if isinstance(index, tuple) and len(index) > 1:
            index = (index[0], index[1] % (hq if what == "q" else hkv), *index[2:])
        bad = poisoned(bad, what, index, value)
    fop = op(name)
    fwd, bwd, det = families_of(fop, family, layout="packed", gqa=hq != hkv)
    ex = run_case(fop, clean, bad, params=params, call=call, family=fwd, bwd_family=bwd, deterministic=det,
                  where=f"{family} {name} {case}")
    if case.startswith("whole") or case.startswith("neighbour"):
        assert ex.score_nan[0, :, 100:300].all() and not ex.score_nan[0, :, :100].any()
