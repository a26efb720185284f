"""CUDA family against the float64 reference (outputs poisoned with NaN before every launch)."""

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flashgen
from flashgen import check

pytestmark = pytest.mark.gpu

# The kernel family these tests run on (forced for the whole module: on Hopper the sm90 family
# would take the forward; tests/test_gpu_sm90.py runs it); every case asserts it.
FAMILY = "sm80"


@pytest.fixture(autouse=True)
def _sm80():
    with flashgen.use_family(FAMILY):
        yield

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SEQLENS = [1, 7, 64, 127, 128, 129]
# (batch, heads, kv_heads, transposed) cycled over the cross product: MHA, GQA 4:1, MQA, views.
LAYOUTS = [(1, 1, 1, False), (3, 5, 5, True), (1, 4, 1, False), (3, 8, 2, False), (1, 5, 5, True), (3, 4, 1, True)]


@pytest.fixture(scope="module")
def ops(dense_op, causal_op, top_left_op):
    """Build every instantiation the tests use at once (ninja and nvcc run in parallel)."""
    all_ops = {"dense": dense_op, "causal": causal_op, "top_left": top_left_op}
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda op: op.build("cuda", None, [64, 128], decode=False), all_ops.values()))
    return all_ops


def make(b, hq, hkv, nq, nk, d, dtype, transposed, gen):
    def one(h, n):
        if transposed:
            return torch.randn(b, n, h, d, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, device="cuda", generator=gen).to(dtype)

    return one(hq, nq), one(hkv, nk), one(hkv, nk)


def check_case(op, q, k, v, **kw):
    assert op.family_for(q.device, q.dtype, q.shape[-1]).family.name == FAMILY
    out, lse = op(q, k, v, return_lse=True, **kw)
    cmp = check.compare(op.spec, q, k, v, out, lse, scale=kw.get("scale"))
    assert cmp.ok, f"{op.name} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}: {cmp}"
    return out, lse


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_seqlen_cross_product(ops, mask, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(d)
    for i, (nq, nk) in enumerate(itertools.product(SEQLENS, SEQLENS)):
        b, hq, hkv, transposed = LAYOUTS[i % len(LAYOUTS)]
        check_case(ops[mask], *make(b, hq, hkv, nq, nk, d, DTYPES[dtype], transposed, gen))


LARGER = [(256, 256), (1000, 1000), (2048, 2048), (4096, 4096), (333, 4096), (4096, 333), (1025, 3000), (3000, 1025)]


@pytest.mark.parametrize("mask", ["dense", "causal", "top_left"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_larger_shapes(ops, mask, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1000 + d)
    for i, (nq, nk) in enumerate(LARGER):
        b, hq, hkv, transposed = [(1, 4, 1, False), (2, 4, 4, True), (1, 8, 2, False)][i % 3]
        check_case(ops[mask], *make(b, hq, hkv, nq, nk, d, DTYPES[dtype], transposed, gen))


def test_causal_empty_rows(ops):
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = make(2, 4, 4, 300, 100, 128, torch.bfloat16, False, gen)
    out, lse = check_case(ops["causal"], q, k, v)
    assert torch.equal(out[:, :, :200], torch.zeros_like(out[:, :, :200]))
    assert torch.isneginf(lse[:, :, :200]).all() and torch.isfinite(lse[:, :, 200:]).all()


@pytest.mark.parametrize("nq, nk, b", [(0, 5, 1), (5, 0, 1), (0, 0, 1), (5, 5, 0)])
def test_empty_sizes(ops, nq, nk, b):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = make(b, 2, 2, nq, nk, 64, torch.float16, False, gen)
    out, lse = ops["causal"](q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_masked_keys_holding_nan_do_not_leak(ops):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = make(1, 2, 2, 200, 200, 64, torch.bfloat16, False, gen)
    k2 = k.clone()
    k2[:, :, 150:] = float("nan")  # invisible to rows < 150
    k2[:, :, 151, 5] = float("inf")
    assert torch.equal(ops["causal"](q, k2, v)[:, :, :150], ops["causal"](q, k, v)[:, :, :150])


def test_memory_past_seqlen_is_never_read(ops):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = make(1, 2, 2, 70, 130, 128, torch.float16, False, gen)
    big_k = torch.full((1, 2, 256, 128), float("nan"), dtype=torch.float16, device="cuda")
    big_v = big_k.clone()
    big_k[:, :, :130], big_v[:, :, :130] = k, v
    assert torch.equal(ops["dense"](q, big_k[:, :, :130], big_v[:, :, :130]), ops["dense"](q, k, v))


def test_non_default_stream_and_no_host_sync(ops):
    gen = torch.Generator(device="cuda").manual_seed(5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
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
    op(q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, k, v)
    q2, k2, v2 = make(1, 4, 4, 512, 512, 64, torch.float16, False, gen)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, op(q2, k2, v2), rtol=0, atol=0)


def test_many_heads_beyond_grid_limit(ops):
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = make(1, 70000, 70000, 3, 5, 64, torch.float16, False, gen)
    check_case(ops["dense"], q, k, v)


def test_batch_offsets_beyond_32_bits(ops):
    """k and v live 2^31 elements apart per batch: pointer offsets need 64 bits."""
    n, d = 256, 64
    stride_b = 2**31 + 4096
    base = torch.empty(stride_b + n * d, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(9)
    base[: n * d].normal_(generator=gen)
    base[stride_b:].normal_(generator=gen)
    k = base.as_strided((2, 1, n, d), (stride_b, n * d, d, 1))
    q = torch.randn(2, 1, n, d, device="cuda", generator=gen).bfloat16()
    out, lse = ops["dense"](q, k, k, return_lse=True)
    cmp = check.compare(ops["dense"].spec, q, k.contiguous(), k.contiguous(), out, lse)
    assert cmp.ok, str(cmp)


def test_errors_before_launch_and_context_survives(ops):
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="^k: on cpu but q is on cuda"):
        ops["dense"](q, q.cpu(), q.cpu())
    with pytest.raises(ValueError, match="^q: dtype torch.float32 is not supported by spec 'dense' on cuda"):
        ops["dense"](q.float(), q.float(), q.float())
    torch.cuda.synchronize()
    check_case(ops["dense"], q, q, q)


def test_opcheck_and_compile(ops):
    gen = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = make(1, 4, 2, 100, 130, 64, torch.bfloat16, False, gen)
    torch.library.opcheck(ops["causal"].torch_op, (q, k, v, 0.125, False))
    fn = torch.compile(lambda q, k, v: ops["causal"](q, k, v), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), ops["causal"](q, k, v), rtol=0, atol=0)


def test_same_op_runs_cpu_and_cuda(ops):
    """Unforced, one op serves CUDA and CPU tensors (each call on the first family that serves it)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = make(1, 2, 2, 65, 65, 64, torch.bfloat16, False, gen)
    with flashgen.use_family(None):
        gpu = ops["causal"](q, k, v)
        cpu = ops["causal"](q.cpu(), k.cpu(), v.cpu())
    assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=2e-2, rtol=0)


# ---------------------------------------------------------------- backward


def grads_of(op, q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    op(q, k, v, **kw).backward(dout)
    return q.grad, k.grad, v.grad


def check_grads(op, q, k, v, dout, **kw):
    got = grads_of(op, q, k, v, dout, **kw)
    cmp = check.compare_grads(op.spec, q, k, v, dout, got)
    assert cmp.ok, f"{op.name} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}: {cmp}"
    return got


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradients_seqlen_cross_product(ops, mask, d, dtype):
    gen = torch.Generator(device="cuda").manual_seed(2000 + d)
    for i, (nq, nk) in enumerate(itertools.product(SEQLENS, SEQLENS)):
        b, hq, hkv, transposed = LAYOUTS[i % len(LAYOUTS)]
        q, k, v = make(b, hq, hkv, nq, nk, d, DTYPES[dtype], transposed, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
        check_grads(ops[mask], q, k, v, dout, deterministic=bool(i % 2))


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradients_larger_shapes(ops, mask, dtype):
    gen = torch.Generator(device="cuda").manual_seed(3000)
    for i, (nq, nk) in enumerate([(1000, 1000), (2048, 2048), (333, 1500), (1500, 333), (4096, 1024)]):
        b, hq, hkv, transposed = [(1, 4, 1, False), (2, 4, 4, True), (1, 8, 2, False)][i % 3]
        d = (64, 128)[i % 2]
        q, k, v = make(b, hq, hkv, nq, nk, d, DTYPES[dtype], transposed, gen)
        dout = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
        check_grads(ops[mask], q, k, v, dout)


def test_gradients_empty_rows_zero_no_nan(ops):
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = make(2, 4, 2, 300, 100, 128, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    dq, dk, dv = check_grads(ops["causal"], q, k, v, dout)
    assert torch.equal(dq[:, :, :200], torch.zeros_like(dq[:, :, :200]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("how", ["sum", "transpose", "slice"])
def test_non_contiguous_dout(ops, how):
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = make(2, 4, 2, 257, 300, 64, torch.float16, False, gen)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = ops["causal"](qq, kk, vv)
    if how == "sum":
        out.sum().backward()
        expected = torch.ones_like(out)
    elif how == "transpose":
        g = torch.randn(2, 257, 4, 64, device="cuda", generator=gen).half()
        out.backward(g.transpose(1, 2))
        expected = g.transpose(1, 2).contiguous()
    else:
        big = torch.randn(2, 4, 257, 128, device="cuda", generator=gen).half()
        out.backward(big[..., :64])
        expected = big[..., :64].contiguous()
    ref = grads_of(ops["causal"], q, k, v, expected, deterministic=True)
    got = (qq.grad, kk.grad, vv.grad)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)  # dq atomics reorder; values agree
    cmp = check.compare_grads(ops["causal"].spec, q, k, v, expected, got)
    assert cmp.ok, str(cmp)


def test_deterministic_backward_bitwise(ops):
    gen = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = make(2, 8, 2, 1000, 1100, 128, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    first = grads_of(ops["causal"], q, k, v, dout, deterministic=True)
    for _ in range(5):
        again = grads_of(ops["causal"], q, k, v, dout, deterministic=True)
        for a, b in zip(again, first, strict=True):
            assert torch.equal(a, b)
    torch.use_deterministic_algorithms(True)
    try:
        glob = grads_of(ops["causal"], q, k, v, dout)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(glob, first, strict=True):
        assert torch.equal(a, b)


def test_gradient_through_lse_and_subset(ops):
    gen = torch.Generator(device="cuda").manual_seed(14)
    q, k, v = make(1, 4, 2, 200, 150, 64, torch.bfloat16, False, gen)
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    dlse = torch.randn(q.shape[:3], device="cuda", generator=gen)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ops["causal"](qq, kk, vv, return_lse=True)
    ((out.float() * dout.float()).sum() + torch.where(torch.isfinite(lse), lse, 0.0).mul(dlse).sum()).backward()
    cmp = check.compare_grads(ops["causal"].spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), dlse=dlse)
    assert cmp.ok, str(cmp)
    vv = v.detach().requires_grad_()
    ops["causal"](q, k, vv).backward(dout)
    assert vv.grad is not None and torch.isfinite(vv.grad).all()


def test_opcheck_autograd_and_compiled_backward(ops):
    gen = torch.Generator(device="cuda").manual_seed(15)
    q, k, v = make(1, 4, 2, 100, 130, 64, torch.bfloat16, False, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops["causal"].torch_op, (q, k, v, 0.125, True))
    dout = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    fn = torch.compile(lambda q, k, v: ops["causal"](q, k, v, deterministic=True), fullgraph=True)
    got = grads_of(fn, q, k, v, dout)
    ref = grads_of(ops["causal"], q, k, v, dout, deterministic=True)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_fwd_bwd_peak_memory_is_linear(ops):
    """B=1, H=16, d=128: peak memory of forward+backward per token stays flat from 4K to 32K."""
    per_token = {}
    for n in (4096, 8192, 16384, 32768):
        torch.cuda.empty_cache()
        q, k, v = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ops["causal"](q, k, v).backward(dout)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        per_token[n] = peak / n
        print(f"peak fwd+bwd memory N={n}: {peak / 2**20:.1f} MiB ({peak / n:.0f} B/token)")
        del q, k, v, dout
    ratios = [per_token[n] / per_token[4096] for n in per_token]
    assert max(ratios) < 1.25 and min(ratios) > 0.8, per_token


def test_family_choice_and_forcing_on_cuda(ops):
    """CUDA calls run on sm80; forcing the cpu family with CUDA tensors raises, naming why."""
    op = ops["causal"]
    choice = op.family_for("cuda", torch.bfloat16, 128, layout="packed", sparse=True, dropout=True)
    assert choice.family.name == FAMILY and choice.tried == ()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = make(1, 2, 2, 100, 100, 64, torch.bfloat16, False, gen)
    with flashgen.use_family("cpu"), pytest.raises(NotImplementedError, match="runs on cpu tensors, not cuda"):
        op(q, k, v)
    with flashgen.use_family(FAMILY):
        check_case(op, q, k, v)


def test_planned_eager_calls_on_cuda(ops, monkeypatch):
    """Repeated eager calls launch from their plan (runtime/launch.py): the same bits as the
    validated full path, on the current stream, and a misaligned view falls back to it."""
    from flashgen.runtime import launch

    monkeypatch.setattr(launch, "poison_outputs", False)
    op = ops["causal"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = make(2, 8, 2, 300, 300, 64, torch.bfloat16, True, gen)
    op.plans.clear()
    first = op(q, k, v, return_lse=True)
    assert op.plans
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        again = op(q, k, v, return_lse=True)
    stream.synchronize()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    check_case(op, q, k, v)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")[1:q.numel() + 1].view(q.shape)
    flat.copy_(q)
    assert flat.data_ptr() % 16
    check_case(op, flat, k, v)
