"""The example specs on the CUDA family: forward, backward and parameter gradients against the
float64 reference (outputs poisoned with NaN before every launch)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from variant_cases import EQUAL_SEQLENS_ONLY, EXAMPLES, op, run_case

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (65, 65), (128, 128), (257, 257), (1000, 1000), (129, 257), (257, 129)]
LAYOUTS = [(1, 1, 1), (2, 4, 2), (2, 4, 1), (1, 6, 6)]  # (batch, heads, kv_heads)
EXTRA_HEAD_DIMS = {"alibi": [32], "gemma": [256], "softcap": [256], "bias": [32], "sliding_window": [96]}


@pytest.fixture(scope="module", autouse=True)
def _built():
    def one(name):
        op(name).build("cuda", None, [64, 128] + EXTRA_HEAD_DIMS.get(name, []), decode=False)

    with ThreadPoolExecutor(len(EXAMPLES)) as pool:
        list(pool.map(one, EXAMPLES))


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_example_cuda(name, d, dtype):
    for i, (nq, nk) in enumerate(SEQLENS):
        if name in EQUAL_SEQLENS_ONLY and nq != nk:
            continue
        B, Hq, Hkv = LAYOUTS[i % len(LAYOUTS)]
        run_case(name, B, Hq, Hkv, nq, nk, d, dtype, device="cuda", seed=i, variant=i)


@pytest.mark.parametrize("name", sorted(EXTRA_HEAD_DIMS))
def test_example_cuda_head_dims(name):
    for d in EXTRA_HEAD_DIMS[name]:
        for i, (nq, nk) in enumerate([(65, 65), (300, 300)]):
            run_case(name, 2, 4, 2, nq, nk, d, torch.bfloat16, device="cuda", seed=d + i, variant=i)


def test_softcap_large_logits_cuda():
    """C37: logits far past the cap, bf16, causal + window + softcap, GQA."""
    run_case("gemma", 2, 8, 2, 512, 512, 128, torch.bfloat16, device="cuda", q_scale=10.0, variant=1)
    run_case("softcap", 2, 4, 4, 333, 333, 64, torch.float16, device="cuda", q_scale=10.0)


def test_key_padding_nan_never_leaks_cuda():
    kp = op("key_padding")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    kv_len = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    k[0, :, 100:] = float("nan")
    v[0, :, 100:] = float("nan")
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = kp(qq, kk, vv, kv_len=kv_len)
    assert not out.isnan().any()
    out.float().sum().backward()
    assert not qq.grad.isnan().any()
    assert (kk.grad[0, :, 100:] == 0).all() and (vv.grad[0, :, 100:] == 0).all()


def test_deterministic_variants_cuda():
    """Bitwise-equal gradients over repeated runs with deterministic=True (score mod + mask)."""
    gm = op("gemma")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(2, 8, 1000, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    first = None
    for _ in range(5):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        gm(qq, kk, vv, deterministic=True, window=100, softcap=20.0).backward(dout)
        got = (qq.grad, kk.grad, vv.grad)
        if first is None:
            first = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))


@pytest.mark.parametrize("n", [127, 128, 129, 1023, 1024, 1025, 1089])
def test_large_position_bias_tail_tiles_cuda(n):
    """C08 on the GPU: causal + score + (q − kv), bf16, loss 0.01·mean(out)."""
    import flashgen
    from flashgen import check

    op = flashgen.compile("attention rel_causal {\n    mask = causal\n    score = score + (q - kv)\n}\n")
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, 1, n, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = op(qq, kk, vv)
    (0.01 * out.float().mean()).backward()
    dout = torch.full_like(out, 0.01 / out.numel())
    for t in (qq, kk, vv):
        assert torch.isfinite(t.grad).all()
    gc = check.compare_grads(op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad))
    assert gc.ok, str(gc)
