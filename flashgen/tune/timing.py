"""Timing tile candidates: the inputs of one (head dim, sequence length, pass), a runner per
candidate library, CUDA-event medians with the input sets rotated past the L2, and the check
that a candidate computes what the default tile computes."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass

import torch

from .. import flops as flop_count
from .. import reference
from ..bench import time_fn
from ..lang import ir
from ..ops import TORCH_DTYPE
from ..params import example_params, shape_of
from ..runtime import launch

TOKENS = 16384  # B·N of the timed inputs (FlashAttention's benchmark grid, as flashgen.bench)
HIDDEN = 2048  # H·d of the timed inputs


@dataclass
class Workload:
    """The timed inputs of one (head dim, seqlen, kind): ``sets`` of tensors rotated between
    repeats (together over 2× the L2), the spec's parameter values, scale and FLOPs."""

    B: int
    H: int
    N: int
    d: int
    sets: list
    values: list
    scale: float
    flops: float | None


def _example_params(spec: ir.Spec, B: int, H: int, N: int, device, gen) -> dict:
    """flashgen.params.example_params, with float tensors of ``dim|1`` dims drawn at size 1 (a
    bias of [1, 1, N, N] rather than [B, H, N, N]: the kernels broadcast it)."""
    sizes = {"batch": B, "heads": H, "seqlen_q": N, "seqlen_k": N}
    given = {}
    for p in spec.params:
        if p.kind == "int":
            sizes[p.name] = max(1, N // 8)
    for p in spec.params:
        if p.is_tensor and p.dtype == "f32" and any(dim.broadcast for dim in p.shape):
            shape = [1 if dim.broadcast else n for dim, n in zip(p.shape, shape_of(p, sizes), strict=True)]
            given[p.name] = torch.randn(shape, generator=gen, device=gen.device).to(device)
    return example_params(spec, B, H, N, N, device, gen, **given)


def workload(op, device, dtype: ir.DType, head_dim: int, seqlen: int, kind: str, tokens: int, fwd_lib,
             l2_bytes: int) -> Workload:
    """The timed inputs of ``op`` at (head dim, seqlen, kind 'fwd' / 'bwd') on ``device``: q, k,
    v (and for the backward dout, and out / lse from ``fwd_lib``) of shape [B, H, N, d], dtype
    ``dtype``, with B = max(1, tokens // N), H = max(1, HIDDEN // d), N = seqlen, d = head_dim,
    in enough sets to exceed twice ``l2_bytes`` (2 … 32); FLOPs from the visible pairs (None
    where they cannot be counted). torch.cuda.OutOfMemoryError when the inputs do not fit."""
    N, d = seqlen, head_dim
    B, H = max(1, tokens // N), max(1, HIDDEN // d)
    gen = torch.Generator(device=device).manual_seed(1234 + N + d)
    tdt = TORCH_DTYPE[dtype]
    per = (5 if kind == "bwd" else 3) * B * H * N * d * torch.tensor([], dtype=tdt).element_size()
    nsets = max(2, min(32, math.ceil(2 * l2_bytes / max(per, 1))))
    params = _example_params(op.spec, B, H, N, device, gen)
    scale = reference.default_scale(op.spec, d)
    sets = []
    for _ in range(nsets):
        q, k, v = (torch.randn(B, H, N, d, device=device, dtype=tdt, generator=gen) for _ in range(3))
        sets.append({"q": q, "k": k, "v": v})
    values = op.check_params(sets[0]["q"], sets[0]["k"], params)
    if kind == "bwd":
        for s in sets:
            s["dout"] = torch.randn(B, H, N, d, device=device, dtype=tdt, generator=gen)
            s["out"], s["lse"] = op.launch_forward(s["q"], s["k"], s["v"], scale, values, lib=fwd_lib)
    try:
        pairs = reference.visible_pairs(op.spec, N, N, batch=B, heads=H, **params)
        flops = float(flop_count.attention_flops(B * H * pairs, d, "bwd" if kind == "bwd" else "fwd"))
    except Exception:  # noqa: BLE001 - the FLOP count is a report, never a reason to fail
        flops = None
    return Workload(B, H, N, d, sets, values, scale, flops)


def runner(op, w: Workload, kind: str, lib):
    """fn(i): one call of ``lib``'s ``kind`` on input set i of ``w`` (everything the op's forward
    / backward launch), returning its outputs (a tuple of tensors)."""
    if kind == "fwd":
        def fwd(i: int):
            s = w.sets[i]
            return op.launch_forward(s["q"], s["k"], s["v"], w.scale, w.values, lib=lib)
        return fwd

    def bwd(i: int):
        s = w.sets[i]
        return op.launch_backward(s["q"], s["k"], s["v"], s["out"], s["lse"], s["dout"], None, w.scale, False, w.values,
                            lib=lib)[:3]
    return bwd


def time_calls(fn, nsets: int, device, *, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` calls with input set i rotating over
    ``nsets`` (so the L2 does not hold a call's inputs from the previous one): CUDA events around
    each call (flashgen.bench.time_fn, with the input set advancing per call)."""
    calls = itertools.count()
    return time_fn(lambda: fn(next(calls) % nsets), device, warmup=warmup, reps=reps)


def _mismatch(got, ref) -> str | None:
    """Why ``got`` (a tuple of tensors) is not ``ref`` up to tiling round-off, or None."""
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        a, b = a.float(), b.float()
        fa, fb = a.isfinite(), b.isfinite()
        if not bool((fa == fb).all()) or not bool((a[~fb] == b[~fb]).all()):
            return f"output {i}: non-finite values differ from the default tile's"
        if bool(fb.any()):
            diff = float((a[fb] - b[fb]).abs().max())
            tol = 0.02 * float(b[fb].abs().max()) + 1e-3
            if diff > tol:
                return f"output {i}: differs from the default tile's by {diff:.3g} (tolerance {tol:.3g})"
    return None


def time_kind(op, w: Workload, cands: list, device, reps: int, progress, step: list) -> list[float]:
    """Milliseconds of each candidate (flashgen.tune.tuner.Candidate) on workload ``w``, in the
    order given (inf: failed, wrong or pruned; the reason lands in the candidate's ``error``).
    The default tile runs first, and every other one must match its outputs up to round-off.
    ``step`` is [done, total] of the progress count, advanced per candidate."""
    ref = None
    default = next((c for c in cands if "default" in c.roles), None)
    order = sorted(cands, key=lambda c: c is not default)  # the default first: the others are checked against it
    ms_of: dict[int, float] = {}
    for c in order:
        ms = math.inf
        if c.lib is not None and c.error is None and c.pruned is None:
            fn = runner(op, w, c.kind, c.lib)
            try:
                got = fn(0)
                if c is default:
                    ref = got
                elif ref is not None:
                    bad = _mismatch(got, ref)
                    if bad is not None:
                        raise ValueError(bad)
                del got
                old, launch.poison_outputs = launch.poison_outputs, False  # timing: no NaN fill pass
                try:
                    ms = time_calls(fn, len(w.sets), device, warmup=max(2, len(w.sets)), reps=reps)
                finally:
                    launch.poison_outputs = old
            except torch.cuda.OutOfMemoryError:
                c.error = "out of GPU memory"
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - any failing candidate scores infinite
                c.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ms_of[id(c)] = ms
        step[0] += 1
        report(progress, "time", step[0], step[1], f"{c.kind} N={w.N} d={w.d} {c.tile}: "
                + (f"{ms:.3f} ms" if math.isfinite(ms) else (c.error or c.pruned or "failed")))
    return [ms_of[id(c)] for c in cands]


def report(progress, stage: str, done: int, total: int, detail: str) -> None:
    """Tell ``progress`` (a callable ``progress(stage, done, total, detail)``, True: a line on
    stderr when a stage finishes or a step fails, False: nothing) of a step."""
    if callable(progress):
        progress(stage, done, total, detail)
    elif progress and (done == total or detail.endswith("(failed)")):
        print(f"flashgen tune: {stage} {done}/{total} {detail}", file=sys.stderr, flush=True)
