"""Fused dropout on the CUDA family: forward and backward against the float64 reference with the
regenerated keep mask, the mask itself, reproducibility and CUDA graph capture. Every test skips
while ops.DROPOUT_BACKENDS lacks "sm80" (the op then refuses dropout on CUDA)."""

import pytest
import torch
from dropout_cases import fwd_bwd, inputs, run_case, spec_op

from flashgen import check, ops, philox

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda_dropout():
    if "sm80" not in ops.DROPOUT_BACKENDS:
        pytest.skip("the CUDA kernels do not apply dropout in this version (ops.DROPOUT_BACKENDS)")


GPU_SEQLENS = [(64, 64), (65, 65), (128, 128), (257, 257), (1000, 1000), (129, 257), (257, 129)]


@pytest.mark.parametrize("name", ["dropout", "alibi", "window_softcap"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_matches_reference(name, dtype, d):
    for i, (nq, nk) in enumerate(GPU_SEQLENS):
        B, Hq, Hkv = [(1, 2, 2), (2, 4, 2), (2, 4, 1)][i % 3]
        run_case(name, B, Hq, Hkv, nq, nk, d, dtype, (0.1, 0.5)[i % 2], seed=i, device="cuda")


def test_cuda_mask_is_the_reference_mask():
    op = spec_op("dropout")
    B, Hq, Hkv, N, p = 2, 4, 2, 256, 0.3
    q = torch.zeros(B, Hq, N, N, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(N, device="cuda", dtype=torch.bfloat16).expand(B, Hkv, N, N)
    out = op(q, torch.randn_like(v), v, dropout_p=p, dropout_seed=99)
    lower = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    assert torch.equal(out > 0, philox.keep_mask(99, 0, B, Hq, N, N, p, "cuda") & lower)


def test_cuda_reproducible_and_graph_capture():
    op = spec_op("dropout")
    q, k, v, dout = (t.cuda().half() for t in inputs(2, 4, 2, 300, 64))
    # The same seed: the same output; bitwise the same gradients too with deterministic=True (by
    # default the backwards add dQ partials with fp32 atomics in arrival order).
    a = fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=5, deterministic=True)
    b = fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=5, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=5)
    assert torch.equal(a[0], c[0])
    for x, y in zip(a[1:], c[1:], strict=True):
        torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-2)
    torch.manual_seed(3)
    c = op(q, k, v, dropout_p=0.2)
    assert not torch.equal(c, op(q, k, v, dropout_p=0.2))
    torch.manual_seed(3)
    assert torch.equal(c, op(q, k, v, dropout_p=0.2))
    # Captured with dropout_seed=None: every replay draws a fresh (seed, offset) on the device.
    op(q, k, v, dropout_p=0.2)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, k, v, dropout_p=0.2)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)


@pytest.mark.parametrize("name", ["dropout", "alibi"])
def test_cuda_deterministic_backward_with_dropout(name):
    """deterministic=True computes dQ in a separate query-major kernel, which regenerates the
    mask in the forward's fragment layout: bitwise repeatable, equal to the reference, and
    within rounding of the default mode's dQ."""
    op = spec_op(name)
    B, Hq, Hkv, N, d = 2, 4, 2, 300, 64
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(B, h, N, d, generator=g).cuda().half() for h in (Hq, Hkv, Hkv, Hq))
    params = {"slopes": torch.rand(Hq, device="cuda")} if name == "alibi" else {}
    kw = dict(dropout_p=0.3, dropout_seed=11, **params)
    a = fwd_bwd(op, q, k, v, dout, deterministic=True, **kw)
    b = fwd_bwd(op, q, k, v, dout, deterministic=True, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    gc = check.compare_grads(op.spec, q, k, v, dout, a[1:], params=params, dropout_p=0.3, dropout_seed=11)
    assert gc.ok, f"{name}: deterministic backward {gc}"
    c = fwd_bwd(op, q, k, v, dout, **kw)
    torch.testing.assert_close(a[1].float(), c[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_backward_pair_shared_philox_is_the_same_mask(family, d, monkeypatch):
    """FLASHGEN_DROPOUT_BWD_SHARE=1 (the default: lane pairs share their Philox calls in the
    backward, the path whose gradients test_cuda_matches_reference checks against the float64
    reference) gives bitwise the gradients of =0 (every lane computes its own groups): the same
    keep mask, the same arithmetic order (deterministic=True), on both CUDA families."""
    import flashgen

    if family == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 needs compute capability 9.0")
    op = spec_op("dropout")
    q, k, v, dout = (t.cuda().bfloat16() for t in inputs(2, 4, 2, 333, d))
    with flashgen.use_family(family):
        monkeypatch.setenv("FLASHGEN_DROPOUT_BWD_SHARE", "0")
        a = fwd_bwd(op, q, k, v, dout, dropout_p=0.3, dropout_seed=11, deterministic=True)
        monkeypatch.setenv("FLASHGEN_DROPOUT_BWD_SHARE", "1")
        b = fwd_bwd(op, q, k, v, dout, dropout_p=0.3, dropout_seed=11, deterministic=True)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a[1], torch.zeros_like(a[1]))
