"""The example specs (specs/*.attn) on the CPU family: forward, backward and parameter gradients
against the float64 reference, edge cases of masks and score modifications."""

import pytest
import torch
from variant_cases import EQUAL_SEQLENS_ONLY, EXAMPLES, make_params, op, run_case

from flashgen import reference

SEQLENS = [(1, 1), (65, 65), (127, 129), (129, 127), (300, 300), (7, 300)]
# bf16 on the CPU for the specs whose score modification or parameter gradient is most exposed to
# rounding (every spec runs fp16 and bf16 on the GPU); keeps CI's compile time in bounds.
BF16 = ("alibi", "softcap", "bias", "relative_bias", "gemma")


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Compile the example specs' CPU kernels at once: ninja runs them in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(EXAMPLES)) as pool:
        list(pool.map(lambda n: op(n).build("cpu", ["fp32", "bf16"] if n in BF16 else ["fp32"]), EXAMPLES))


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_example_fp32(name, nq, nk):
    if name in EQUAL_SEQLENS_ONLY and nq != nk:
        pytest.skip("this spec needs seqlen_q == seqlen_k")
    variant = SEQLENS.index((nq, nk))
    d = (32, 64)[variant % 2]
    run_case(name, 2, 4, 2, nq, nk, d, torch.float32, seed=variant, variant=variant)


@pytest.mark.parametrize("name", BF16)
def test_example_bf16_gqa(name):
    run_case(name, 2, 4, 1, 130, 130, 64, torch.bfloat16, seed=7, variant=1)


@pytest.mark.parametrize("name", ["alibi", "bias", "gemma", "relative_bias"])
@pytest.mark.parametrize("d", [96, 256])
def test_example_head_dims(name, d):
    run_case(name, 1, 2, 2, 67, 67, d, torch.float32, seed=d, variant=2)


def test_softcap_large_logits_finite_gradients():
    """Softcap with logits far beyond the cap (q ×10): the backward applies 1 − tanh² (C37)."""
    run_case("softcap", 2, 2, 2, 129, 129, 64, torch.float32, q_scale=10.0, variant=0)
    run_case("gemma", 2, 4, 2, 129, 129, 64, torch.bfloat16, q_scale=10.0, variant=1)


def test_sliding_window_bounds_are_exact():
    """window = 1 sees only the diagonal; a window larger than the sequence is causal (C07)."""
    sw, causal = op("sliding_window"), reference.keep_mask
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 50, 32, generator=g) for _ in range(3))
    out = sw(q, k, v, window=1)
    torch.testing.assert_close(out, v, atol=1e-6, rtol=0)  # each row sees exactly its own key
    import flashgen

    c = flashgen.compile("attention c { mask = causal }")
    torch.testing.assert_close(sw(q, k, v, window=50), c(q, k, v), atol=1e-6, rtol=0)
    keep = causal(sw.spec, 5, 5, window=2)[0, 0]
    assert keep.tolist() == [[j <= i and j > i - 2 for j in range(5)] for i in range(5)]


def test_key_padding_nan_in_padded_keys_never_leaks():
    """NaN in K and V at padded positions (kv >= kv_len) must not reach any output (C05)."""
    kp = op("key_padding")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 77, 64, generator=g) for _ in range(3))
    kv_len = torch.tensor([40, 77], dtype=torch.int32)
    k[0, :, 40:] = float("nan")
    v[0, :, 40:] = float("nan")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = kp(qq, kk, vv, kv_len=kv_len)
    assert not out.isnan().any()
    out.sum().backward()
    assert not qq.grad.isnan().any()
    assert (kk.grad[0, :, 40:] == 0).all() and (vv.grad[0, :, 40:] == 0).all()
    ref = reference.attention(kp.spec, q[:, :, :, :].double().nan_to_num(), k.double().nan_to_num(),
                              v.double().nan_to_num(), kv_len=kv_len)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_fully_masked_rows_zero_output_and_gradients():
    """kv_len = 0 for a batch element: every row is empty — out 0, lse −inf, zero grads, no NaN."""
    kp = op("key_padding")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 33, 32, generator=g).requires_grad_() for _ in range(3))
    out, lse = kp(q, k, v, return_lse=True, kv_len=torch.tensor([0, 20], dtype=torch.int32))
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    assert (q.grad[0] == 0).all() and (k.grad[0] == 0).all() and (v.grad[0] == 0).all()
    assert (k.grad[1, :, 20:] == 0).all()


def test_shift_invariance_of_additive_bias():
    """Adding a constant to every score of a row changes nothing but the LSE (by that constant)."""
    b = op("bias")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 40, 40, generator=g)
    o1, l1 = b(q, k, v, bias=bias, return_lse=True)
    o2, l2 = b(q, k, v, bias=bias + 1000.0, return_lse=True)
    # scores near 1000 carry fp32 rounding of 1000·2^-24 ≈ 6e-5 each; far from any leak of the shift
    torch.testing.assert_close(o1, o2, atol=5e-4, rtol=0)
    torch.testing.assert_close(l2 - l1, torch.full_like(l1, 1000.0), atol=1e-3, rtol=0)


def test_broadcast_bias_gradient_sums_over_broadcast_dims():
    """A bias [1, 1, Nq, Nk] receives the gradient summed over batch and heads."""
    run_case("bias", 3, 2, 2, 45, 45, 32, torch.float32, variant=3)


def test_parameter_gradient_only_when_requested():
    al = op("alibi")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 30, 32, generator=g).requires_grad_() for _ in range(3))
    slopes = torch.rand(4, generator=g)
    al(q, k, v, slopes=slopes).sum().backward()
    assert slopes.grad is None and q.grad is not None
    slopes.requires_grad_()
    q2 = q.detach()  # gradient for the parameter alone
    al(q2, k.detach(), v.detach(), slopes=slopes).sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0


def test_scalar_parameters_do_not_recompile():
    """A new window or softcap value reuses the same compiled kernel."""
    gm = op("gemma")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 32, generator=g) for _ in range(3))
    gm(q, k, v, window=3, softcap=5.0)
    libs = dict(gm._libs)
    for w, c in ((1, 1.0), (100, 30.0), (7, 0.5)):
        out = gm(q, k, v, window=w, softcap=c)
        ref = reference.attention(gm.spec, q.double(), k.double(), v.double(), window=w, softcap=c)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert gm._libs == libs


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_params_validate(name):
    """Missing, unknown, mis-shaped and wrongly typed parameters raise naming the parameter."""
    fop = op(name)
    q = torch.randn(2, 4, 16, 32)
    k = torch.randn(2, 2, 16, 32)
    good = make_params(name, 2, 4, 16, 16, "cpu", torch.Generator().manual_seed(0))
    fop(q, k, k, **good)
    first = fop.spec.params[0].name
    with pytest.raises(TypeError, match=first):
        fop(q, k, k, **{n: x for n, x in good.items() if n != first})
    with pytest.raises(TypeError, match="unknown parameter 'nonsense'"):
        fop(q, k, k, nonsense=1, **good)
    for p in fop.spec.params:
        bad = dict(good)
        if p.is_tensor:
            bad[p.name] = good[p.name][..., :1] if good[p.name].shape[-1] > 1 else good[p.name].expand(
                *good[p.name].shape[:-1], 2)
            with pytest.raises(ValueError, match=p.name):
                fop(q, k, k, **bad)
            bad[p.name] = good[p.name].to(torch.float64)
            with pytest.raises(ValueError, match=p.name):
                fop(q, k, k, **bad)
            bad[p.name] = 3
            with pytest.raises(TypeError, match=p.name):
                fop(q, k, k, **bad)
        else:
            bad[p.name] = "7"
            with pytest.raises(TypeError, match=p.name):
                fop(q, k, k, **bad)


C08_SPEC = "attention rel_causal {\n    mask = causal\n    score = score + (q - kv)\n}\n"


@pytest.mark.parametrize("n", [127, 128, 129, 1025])
def test_large_position_bias_tail_tiles_finite_gradients(n):
    """C08: causal + a score mod adding (q − kv) (up to +n, dominating the logits), seqlens that
    are not multiples of any tile; loss 0.01·mean(out): finite gradients equal to the reference."""
    import flashgen
    from flashgen import check

    op = flashgen.compile(C08_SPEC)
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g) for _ in range(3))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = op(qq, kk, vv)
    (0.01 * out.mean()).backward()
    dout = torch.full_like(out, 0.01 / out.numel())
    for t in (qq, kk, vv):
        assert torch.isfinite(t.grad).all()
    gc = check.compare_grads(op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad))
    assert gc.ok, str(gc)


def test_int_parameter_under_torch_compile_does_not_recompile_per_value():
    """Int parameters are SymInt in the op schema: after the first recompile they are dynamic."""
    from torch._dynamo.utils import counters

    sw = op("sliding_window")
    q = torch.randn(1, 2, 64, 32)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda q, w: sw(q, q, q, window=w), fullgraph=True)
    for w in range(3, 12):
        assert torch.equal(f(q, w), sw(q, q, q, window=w)), w
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_spec_names_that_would_clash_are_rejected():
    import flashgen
    from flashgen.errors import SpecError

    for text, what in (("param and: int", "'and' cannot name"), ("param int: int", "'int' cannot name"),
                       ("param scale: int", "'scale' cannot name"),
                       ("param t: f32[heads]\n param t_grad: int", "clashes with the generated member")):
        with pytest.raises(SpecError, match=what):
            flashgen.compile(f"attention x {{\n {text}\n}}")


def test_reference_exact_for_huge_scores_and_minus_inf_rows():
    """Rows whose scores are all ~−1e30 keep exact probabilities (max-subtracted softmax); a row
    masked entirely by a −inf bias is empty: output 0, LSE −inf, like the kernels."""
    b = op("bias")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 20, 32, generator=g) for _ in range(3))
    bias = torch.full((1, 1, 20, 20), -1e30)
    bias[0, 0, 3] = float("-inf")
    out, lse = b(q, k, v, bias=bias, return_lse=True)
    ref, ref_lse = reference.attention(b.spec, q.double(), k.double(), v.double(), bias=bias.double(),
                                       return_lse=True)
    rows = torch.arange(20) != 3
    torch.testing.assert_close(ref[0, 0, rows], v.double()[0, 0].mean(0).expand(19, 32), atol=1e-6, rtol=0)
    assert (ref[0, 0, 3] == 0).all() and torch.isneginf(ref_lse[0, 0, 3])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.isneginf(lse[0, 0, 3])


def test_zero_heads_is_an_empty_call():
    sw = op("sliding_window")
    q = torch.randn(2, 0, 5, 32, requires_grad=True)
    out = sw(q, q, q, window=3)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape
