"""Benchmarks: our forward next to PyTorch's attention implementations, measured in one run.

TFLOP/s count visible entries only: 4 · B · H · d · (kept (query, key) pairs) for the forward.
CUDA timings use CUDA events around each repeat (median); CPU timings use perf_counter (median).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import flops as flop_count
from . import reference
from .errors import did_you_mean
from .lang import expr as X
from .lang import ir
from .ops import TORCH_DTYPE, AttentionOp
from .params import example_params
from .runtime import masks as block_masks


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


# How `flashgen bench` times every implementation (DESIGN.md, Measuring): triton.testing.do_bench's
# method, 25 warm-up calls, an L2 flush before each timed call, at least 100 ms of timed calls.
DO_BENCH = {"warmup": 25, "min_ms": 100.0, "flush_l2": True}
_L2_FLUSH_BYTES = 256 << 20  # above any current GPU's L2 (H100/H200: 50 MB), as triton's do_bench
_flush_buffers: dict = {}


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    buf = _flush_buffers.get(key)
    if buf is None:
        buf = _flush_buffers[key] = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    return buf


def _cuda_times(fn: Callable[[], object], device: torch.device, n: int, flush: torch.Tensor | None) -> list[float]:
    """Milliseconds of each of ``n`` calls queued back to back (events around each call; ``flush``
    zeroed before each, outside them), after one synchronisation."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            flush_l2: bool = False, min_ms: float = 0.0) -> float:
    """Median milliseconds of one call of ``fn`` after ``warmup`` calls.

    CUDA: a pair of events around each call, all calls queued back to back with one
    synchronisation at the end, so a call's host-side overhead overlaps the previous call's
    kernel (the steady state of a training or serving loop) instead of idling the GPU. With
    ``flush_l2`` a 256 MB buffer is zeroed before each timed call, outside its events, so that no
    call finds its inputs in L2; with ``min_ms`` the number of timed calls is raised from
    ``reps`` until they span at least that many milliseconds (estimated from five calls):
    together, triton.testing.do_bench's method (``flashgen bench`` uses warmup=25, min_ms=100,
    flush_l2=True: DESIGN.md, Measuring). CPU: perf_counter around each call (no flush).
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        flush = _l2_flush_buffer(device) if flush_l2 else None
        if min_ms > 0:
            per_call = max(statistics.median(_cuda_times(fn, device, 5, flush)), 1e-3)
            reps = max(reps, math.ceil(min_ms / per_call))
        return statistics.median(_cuda_times(fn, device, reps, flush))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _additive_bias(spec: ir.Spec) -> ir.Expr | None:
    """``f`` when the score expression is ``score + f`` (f free of score): what SDPA takes as a
    float attn_mask; None otherwise."""
    e = spec.score
    if isinstance(e, ir.BinOp) and e.op == "+":
        for s_side, f in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
            if s_side == ir.Name("score") and not X.uses(f, "score"):
                return f
    return None


def sdpa_mask(spec: ir.Spec, B: int, H: int, Nq: int, Nk: int, device, dtype, params: dict, *,
              decode: bool = False):
    """The materialised attn_mask a user of SDPA would build for ``spec``: bool for a mask alone,
    float (bias, −inf where masked) for an additive score modification; None for no mask;
    raises NotImplementedError for score modifications SDPA cannot express (e.g. softcap).
    ``decode``: the Nq queries are the last Nq positions of sequences of Nk keys, as
    ``with_kvcache`` places them (query row i at position Nk − Nq + i, seqlen_q = seqlen_k = Nk)."""
    env = reference.positions(B, H, Nq, Nk, device)
    if decode:
        env |= {"q": env["q"] + (Nk - Nq), "seqlen_q": Nk}
    keep = None
    if spec.mask is not None:
        m = reference.evaluate(spec.mask, spec, env, params, torch.float64)
        keep = torch.broadcast_to(m, torch.broadcast_shapes(m.shape, (1, 1, Nq, Nk)))
    if spec.score is None:
        return keep
    f = _additive_bias(spec)
    if f is None:
        raise NotImplementedError("score modification not expressible as an SDPA attn_mask")
    bias = reference.evaluate(f, spec, env, params, torch.float32, check_bounds=False)
    bias = torch.broadcast_to(bias, torch.broadcast_shapes(bias.shape, (1, 1, Nq, Nk)))
    if keep is not None:
        bias = torch.where(keep, bias, float("-inf"))
    return bias.to(dtype)


# The peers timed next to ours on each device type (``peers``); FlexAttention and eager have no
# dropout and are left out when it is set.
PEERS = {"cuda": ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "eager"), "cpu": ("sdpa", "eager")}
NO_DROPOUT = ("flex", "eager")


def check_include(include, device: torch.device, dropout_p: float = 0.0) -> None:
    """Raise ValueError (starting 'include:') for a name in ``include`` that is no peer, or no
    peer on ``device``, or one that cannot run here (no dropout, no FlexAttention in this torch);
    names starting with 'flashgen' are ours (always timed)."""
    here = [n for n in PEERS.get(device.type, ()) if not (dropout_p and n in NO_DROPOUT)]
    known = {n for names in PEERS.values() for n in names}
    listed = ", ".join(here) or "none"
    for name in include or ():
        if name.startswith("flashgen") or (name in here and name != "flex"):
            continue
        if name not in known:
            hint = did_you_mean(name, here) or did_you_mean(name, known)
            raise ValueError(f"include: unknown peer {name!r} (the peers on {device.type}: {listed})"
                             + (f"; {hint}" if hint else ""))
        if name not in PEERS.get(device.type, ()):
            raise ValueError(f"include: peer {name!r} runs on {'cuda' if name in PEERS['cuda'] else 'cpu'}, not "
                             f"{device.type} (the peers on {device.type}: {listed})")
        if name not in here:
            raise ValueError(f"include: peer {name!r} has no dropout (with dropout_p the peers are: {listed})")
        if name == "flex" and _flex_module() is None:
            raise ValueError(f"include: peer 'flex' is unavailable: this torch ({torch.__version__}) has no "
                             "FlexAttention")


def _flex_module():
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def peers(spec: ir.Spec, device: torch.device, dropout_p: float = 0.0) -> dict[str, Callable | None]:
    """Name → fn(q, k, v, params) for the implementations we compare against (None if
    unavailable). SDPA gets is_causal for causal masks, else a materialised mask (built once per
    shape, outside the timing: what its users do), and ``dropout_p``; FlexAttention and eager
    have no dropout and are left out when it is set."""
    kind = spec.mask_kind
    masks: dict = {}

    def sdpa(backend=None):
        def run(q, k, v, params):
            kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            if dropout_p:
                kwargs["dropout_p"] = dropout_p
            mask = None
            is_causal = False
            B, Hq, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            if spec.score is None and kind is ir.MaskKind.CAUSAL_TOP_LEFT:
                is_causal = True  # SDPA's is_causal is top-left aligned
            elif spec.score is None and kind is ir.MaskKind.CAUSAL and Nq == Nk:
                is_causal = True
            elif spec.mask is not None or spec.score is not None:
                key = (B, Hq, Nq, Nk, q.dtype, id(params))
                if key not in masks:
                    masks.clear()
                    masks[key] = sdpa_mask(spec, B, Hq, Nq, Nk, q.device, q.dtype, params)
                mask = masks[key]
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kwargs)

        return run

    def eager(q, k, v, params):
        return reference.attention(spec, q, k, v, **params)

    out: dict[str, Callable | None] = {}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        out["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        out["sdpa-efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
        if not dropout_p:
            out["flex"] = _flex(spec)
    else:
        out["sdpa"] = sdpa()
    if not dropout_p:
        out["eager"] = eager
    return out


def _flex(spec: ir.Spec):
    """FlexAttention (compiled) with the spec's mask as mask_mod (and its block mask, built once
    per shape outside the timing) and the score expression as score_mod, both evaluated from the
    same IR as the kernels."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention)
    masks: dict = {}

    def run(q, k, v, params):
        B, Hq, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        sizes = {"seqlen_q": Nq, "seqlen_k": Nk}

        def env(b, h, qi, kv):
            return {"b": b, "h": h, "q": qi, "kv": kv} | sizes

        block_mask = score_mod = None
        if spec.mask is not None:
            key = (B, Hq, Nq, Nk, id(params))
            if key not in masks:
                masks.clear()

                def mask_mod(b, h, qi, kv):
                    return reference.evaluate(spec.mask, spec, env(b, h, qi, kv), params, torch.float32,
                                              check_bounds=False)

                per_b = X.uses(spec.mask, "b") or any(
                    isinstance(n, ir.Index) for n in X.walk(spec.mask))
                per_h = X.uses(spec.mask, "h")
                masks[key] = create_block_mask(mask_mod, B if per_b else None, Hq if per_h else None, Nq, Nk,
                                               device=q.device)
            block_mask = masks[key]
        if spec.score is not None:
            def score_mod(score, b, h, qi, kv):
                return reference.evaluate(spec.score, spec, env(b, h, qi, kv) | {"score": score}, params,
                                          score.dtype, check_bounds=False)
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return run


def run(op: AttentionOp, shapes: list[tuple[int, int, int, int]], dtype: ir.DType, device: torch.device,
        *, reps: int = 10, include: set[str] | None = None, eager_max_bytes: float = 8e9,
        backward: bool = False, log: Callable[[str], None] = print, params: dict | None = None,
        dropout_p: float = 0.0, block_mask: bool = False) -> list[Row]:
    """Time ours and the peers on each (batch, heads, seqlen, head_dim): the forward, or with
    ``backward`` forward+backward (gradients of q, k, v for a random dout; FLOPs 3.5× the
    forward's, the backward counted as 2.5× as in FlashAttention's benchmarks). Spec parameters
    come from ``params`` where given, else flashgen.params.example_params (per shape). ``include``
    limits the peers timed (ours always are); ValueError for a name that is no peer here
    (``check_include``).

    Row ``flashgen`` is our op called without a block mask: the kernels skip the tiles outside
    closed-form key ranges, and on CUDA a mask without one (e.g. document ids) is classified into
    block lists inside every timed call (FLASHGEN_AUTO_BLOCK_MASK). With ``block_mask`` and a spec
    that has a mask, row ``flashgen-bm`` is the same op called with ``block_mask=`` the spec's own
    block mask (flashgen.block_mask, block size 128, the call's batch, heads and parameter
    values), built once per shape before the timing, as FlexAttention's is: the timed region is
    the call alone, not the mask's construction. Specs without a mask get no such row."""
    check_include(include, device, dropout_p)
    timing = DO_BENCH if device.type == "cuda" else {}
    rows: list[Row] = []
    tdtype = TORCH_DTYPE[dtype]
    shape_mask: dict = {}  # the current shape's block mask for flashgen-bm (built outside the timing)
    impls = {"flashgen": lambda q, k, v, p: op(q, k, v, dropout_p=dropout_p, **p)}
    if block_mask and op.spec.mask is not None:
        impls["flashgen-bm"] = lambda q, k, v, p: op(q, k, v, block_mask=shape_mask["bm"], dropout_p=dropout_p, **p)
    if dropout_p:  # dropout's overhead: the same op with p = 0
        impls["flashgen-p0"] = lambda q, k, v, p: op(q, k, v, **p)
    if backward:  # the cost of bitwise-repeatable gradients, next to the default
        impls["flashgen-det"] = lambda q, k, v, p: op(q, k, v, deterministic=True, dropout_p=dropout_p, **p)
    impls |= peers(op.spec, device, dropout_p)
    for B, H, N, d in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, N, d, device=device, dtype=tdtype, generator=gen) for _ in range(4))
        pv = example_params(op.spec, B, H, N, N, device, gen, **(params or {}))
        flops = flop_count.call_flops(op.spec, N, N, d, batch=B, heads=H, kind="fwd+bwd" if backward else "fwd",
                                      **pv)
        if backward:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        bm_failed = ""
        if "flashgen-bm" in impls:
            shape_mask.clear()
            try:
                shape_mask["bm"] = block_masks.block_mask(op, N, N, batch=B, heads=H, block_size=128, device=device, **pv)
            except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
                # its arguments refused, or its build or launch failed: reported on the row, not fatal
                bm_failed = f"failed: block_mask: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        for name, fn in impls.items():
            if include and name not in include and not name.startswith("flashgen"):
                continue
            row = Row(name, B, H, N, d, dtype.value, op.spec.name, "fwd+bwd" if backward else "fwd",
                      device.type, None, None)
            if fn is None:
                row.note = "unavailable"
            elif name == "flashgen-bm" and bm_failed:
                row.note = bm_failed
            elif name == "eager" and B * H * N * N * (36 if backward else 12) > eager_max_bytes:
                row.note = "skipped (N×N scores too large)"
            else:
                try:
                    if backward:
                        def step(fn=fn):
                            torch.autograd.grad(fn(q, k, v, pv), (q, k, v), dout)

                        ms = time_fn(step, device, reps=reps, **timing)
                    else:
                        with torch.no_grad():
                            ms = time_fn(lambda fn=fn: fn(q, k, v, pv), device, reps=reps, **timing)
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
            f"{r.mask:14s} {r.direction:8s} {perf} {r.note}")


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
