"""Benchmarks: our forward next to PyTorch's attention implementations, measured in one run.

TFLOP/s count visible entries only: 4 · B · H · d · (kept (query, key) pairs) for the forward.
CUDA timings use CUDA events around each repeat (median); CPU timings use perf_counter (median).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import ir, reference
from .ops import TORCH_DTYPE, AttentionOp


@dataclass
class Row:
    impl: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    dtype: str
    mask: str
    direction: str  # 'fwd' or 'fwd+bwd'
    device: str
    ms: float | None
    tflops: float | None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of one call of ``fn`` after ``warmup`` calls.

    CUDA: a pair of events around each call, all calls queued back to back with one
    synchronisation at the end, so a call's host-side overhead overlaps the previous call's
    kernel (the steady state of a training or serving loop) instead of idling the GPU. CPU:
    perf_counter around each call.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peers(spec: ir.Spec, device: torch.device) -> dict[str, Callable | None]:
    """Name → fn(q, k, v) for the implementations we compare against (None if unavailable)."""
    causal = spec.mask is ir.MaskKind.CAUSAL
    if spec.mask is ir.MaskKind.CAUSAL_TOP_LEFT:
        causal = "top_left"

    def sdpa(backend=None):
        def run(q, k, v):
            kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            mask = None
            is_causal = False
            if causal == "top_left":
                is_causal = True  # SDPA's is_causal is top-left aligned
            elif causal:
                if q.shape[2] == k.shape[2]:
                    is_causal = True
                else:
                    mask = reference.keep_mask(spec, q.shape[2], k.shape[2], q.device)
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)

        return run

    def eager(q, k, v):
        return reference.attention(spec, q, k, v)

    out: dict[str, Callable | None] = {}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        out["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        out["sdpa-efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
        out["flex"] = _flex(spec)
    else:
        out["sdpa"] = sdpa()
    out["eager"] = eager
    return out


def _flex(spec: ir.Spec):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    masks: dict = {}

    def run(q, k, v):
        Nq, Nk = q.shape[2], k.shape[2]
        block_mask = None
        if spec.mask is not ir.MaskKind.NONE:
            key = (Nq, Nk)
            if key not in masks:
                delta = Nk - Nq if spec.mask is ir.MaskKind.CAUSAL else 0
                masks[key] = create_block_mask(lambda b, h, qi, kv: kv <= qi + delta, None, None, Nq, Nk,
                                               device=q.device)
            block_mask = masks[key]
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return run


def run(op: AttentionOp, shapes: list[tuple[int, int, int, int]], dtype: ir.DType, device: torch.device,
        *, reps: int = 10, include: set[str] | None = None, eager_max_bytes: float = 8e9,
        backward: bool = False, log: Callable[[str], None] = print) -> list[Row]:
    """Time ours and the peers on each (batch, heads, seqlen, head_dim): the forward, or with
    ``backward`` forward+backward (gradients of q, k, v for a random dout; FLOPs 3.5× the
    forward's, the backward counted as 2.5× as in FlashAttention's benchmarks)."""
    rows: list[Row] = []
    tdtype = TORCH_DTYPE[dtype]
    impls = {"flashgen": lambda q, k, v: op(q, k, v)}
    if backward:  # the cost of bitwise-repeatable gradients, next to the default
        impls["flashgen-det"] = lambda q, k, v: op(q, k, v, deterministic=True)
    impls |= peers(op.spec, device)
    for B, H, N, d in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, N, d, device=device, dtype=tdtype, generator=gen) for _ in range(4))
        flops = 4 * B * H * d * reference.visible_pairs(op.spec, N, N) * (3.5 if backward else 1.0)
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        for name, fn in impls.items():
            if include and name not in include and not name.startswith("flashgen"):
                continue
            row = Row(name, B, H, N, d, dtype.value, op.spec.mask.value, "fwd+bwd" if backward else "fwd",
                      device.type, None, None)
            if fn is None:
                row.note = "unavailable"
            elif name == "eager" and B * H * N * N * (36 if backward else 12) > eager_max_bytes:
                row.note = "skipped (N×N scores too large)"
            else:
                try:
                    if backward:
                        def step(fn=fn):
                            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

                        ms = time_fn(step, device, reps=reps)
                    else:
                        with torch.no_grad():
                            ms = time_fn(lambda fn=fn: fn(q, k, v), device, reps=reps)
                    row.ms, row.tflops = ms, flops / ms / 1e9
                except Exception as e:  # a peer that cannot run this shape is reported, not fatal
                    row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows.append(row)
            log(format_row(row))
    return rows


def format_row(r: Row) -> str:
    if r.ms is None:
        perf = " " * 28
    elif r.device == "cpu":
        perf = f"{r.ms:9.2f} ms {r.tflops * 1e3:8.1f} GFLOP/s"
    else:
        perf = f"{r.ms:9.3f} ms {r.tflops:8.1f} TFLOP/s"
    return (f"{r.impl:15s} B={r.batch:<3d} H={r.heads:<3d} N={r.seqlen:<6d} d={r.head_dim:<4d} {r.dtype} "
            f"{r.mask:8s} {r.direction:8s} {perf} {r.note}")


def default_shapes(device: torch.device, head_dims: list[int] | None, seqlens: list[int] | None,
                   batch: int | None, heads: int | None) -> list[tuple[int, int, int, int]]:
    """CUDA: B·N = 16K tokens, H·d = 2048 (FlashAttention's benchmark grid); CPU: B=2, H=8."""
    if device.type == "cuda":
        ds = head_dims or [64, 128]
        ns = seqlens or [512, 1024, 2048, 4096, 8192, 16384]
        return [(batch or max(1, 16384 // n), heads or 2048 // d, n, d) for d in ds for n in ns]
    ds = head_dims or [64]
    ns = seqlens or [1024, 4096]
    return [(batch or 2, heads or 8, n, d) for d in ds for n in ns]
