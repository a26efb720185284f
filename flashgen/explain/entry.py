"""The entry point of ``flashgen explain``: resolve the target and the kernel family that
serves the call, let the family's model (explain/cpu_model.py, explain/sm80_model.py) give
tiles and peaks, count FLOPs and bytes, and optionally measure.
"""

from __future__ import annotations

import math

import torch

from .. import families
from ..bench import time_fn
from ..lang import ir
from ..ops import TORCH_DTYPE, ranges_text
from . import cpu_model, sm80_model, sm90_model
from .geometry import count_visits
from .inputs import as_dtype, as_op, check_sizes, given_params, materialize, spec_params
from .report import Report, fmt_bytes
from .target import ModelCall, Target, resolve
from .traffic import ELEMENT_BYTES, bwd_traffic, fwd_traffic, tensor_params

# The model of each kernel family, by the family's name (flashgen.families).
MODELS = {"sm90": sm90_model, "sm80": sm80_model, "cpu": cpu_model}


def family_choice(op, target: Target, dtype: ir.DType, head_dim: int, backward: bool) -> families.Choice:
    """The kernel family that serves the call's forward and why: ``op.family_for`` on a live
    device, else flashgen.families.choose for the target's architecture (the tables, no device).
    With ``backward`` the backward's family is chosen too (each pass chooses its own: on sm_90a
    the sm90 forward and the sm80 backward), so that a forced family without a backward raises.
    Raises NotImplementedError when a forced family cannot serve a pass, ValueError when no model
    exists for the family."""
    call = families.Call(target.device_type, target.arch, dtype, head_dim)
    if target.device is not None:
        choice = op.family_for(target.device, dtype, head_dim)
    else:
        choice = families.choose(op.spec, call)
    if backward:
        families.choose(op.spec, families.Call(target.device_type, target.arch, dtype, head_dim,
                                               frozenset({"backward"})))
    if choice.family.name not in MODELS:
        raise ValueError(f"family: explain has no model of kernel family {choice.family.name} "
                         f"(it models {', '.join(MODELS)})")
    return choice


def explain(op_or_spec, seqlen_q: int, seqlen_k: int | None = None, *, head_dim: int, batch: int = 1,
            heads: int = 1, kv_heads: int | None = None, dtype=None, arch: str | None = None,
            device=None, params=None, backward: bool = False, measure: bool = False, build: bool = False,
            reps: int = 10) -> Report:
    """Explain one call: q [batch, heads, seqlen_q, head_dim], k, v [batch, kv_heads, seqlen_k,
    head_dim] of ``dtype`` (see the module docstring for every count and its source).

    Args:
        op_or_spec: a compiled op, an ``ir.Spec``, a path to a ``.attn`` file or spec text.
        seqlen_q, seqlen_k: sequence lengths (seqlen_k defaults to seqlen_q); head_dim, batch,
            heads (query heads), kv_heads (default heads; must divide heads): sizes ≥ 1 (the
            sequence lengths ≤ 2^30, the kernels' limit).
        dtype: 'bf16', 'fp16' or 'fp32' (fp32: CPU family only), or the torch / flashgen dtype;
            None: bf16 when the spec allows it on the target's family, else the first dtype it
            allows there.
        arch: a CUDA architecture ('sm_90a', '90', ...): tiles and peaks from flashgen.tiles'
            tables (the live device's own figures, tuned and env tiles when it is that arch).
            None: the live GPU, else this CPU.
        device: 'cpu' or 'cuda[:N]' to pick the family / device explicitly.
        params: the spec's parameters, {name: value} or ['NAME=VALUE', ...] (--param syntax);
            missing ones get flashgen.params.example_params values (seed 0) — only those the
            mask reads: the others are counted from their shape alone.
        backward: count forward + backward (and time both with ``measure``).
        measure: run the call on random inputs on the device and time it (median of ``reps``,
            flashgen.bench.time_fn); builds the kernels if needed.
        build: compile the CUDA instantiation when it is not cached, so that registers come from
            ptxas (cuobjdump -res-usage) instead of the model.

    Returns:
        A Report (``as_dict()`` for JSON).

    Raises:
        ValueError: an argument out of range or unsupported (naming it: arch, head_dim, dtype,
            device, measure, kv_heads, params, ...), including sizes at which the mask indexes
            a parameter out of its bounds (naming seqlen_k or params).
        TypeError: a size that is not an int.
        SpecError / BuildError: the spec does not parse; a build (measure/build) failed.
    """
    op = as_op(op_or_spec)
    spec = op.spec
    nq = seqlen_q
    nk = seqlen_q if seqlen_k is None else seqlen_k
    hkv = heads if kv_heads is None else kv_heads
    check_sizes(nq, nk, head_dim, batch, heads, hkv)
    if measure and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise ValueError(f"reps: {reps!r} is out of range (expected an int ≥ 1)")
    dt = None if dtype is None else as_dtype(dtype)
    target = resolve(arch, device, measure)
    fam = target.device_type
    allowed = op.dtypes(fam)
    if not allowed:
        what = "arch" if arch is not None else "device" if device is not None else "dtype"
        declared = ", ".join(x.value for x in spec.dtypes or ())
        family = ", ".join(x.value for x in families.of(fam).dtypes)
        raise ValueError(f"{what}: spec '{spec.name}' has no {fam.upper()} dtype: it allows {declared} and the "
                         f"{fam.upper()} kernels run {family} (explain it on the CPU family: no --arch, "
                         "--device cpu)")
    if dt is None:
        dt = ir.DType.BF16 if ir.DType.BF16 in allowed else allowed[0]
    if dt not in allowed:
        raise ValueError(f"dtype: {dt.value} is not supported by spec '{spec.name}' on {fam.upper()} "
                         f"(expected one of {', '.join(x.value for x in allowed)})")
    if head_dim not in op.head_dims(fam):
        raise ValueError(f"head_dim: {head_dim} is not supported by spec '{spec.name}' on {fam.upper()} "
                         f"(expected one of {ranges_text(op.head_dims(fam))})")
    given = given_params(spec, params)
    values = spec_params(spec, given, batch, heads, nq, nk)
    e = ELEMENT_BYTES[dt]
    d = head_dim
    notes: list[str] = []

    # ---- the family that serves the call, and its model of tiles and peaks
    choice = family_choice(op, target, dt, d, backward)
    part = MODELS[choice.family.name].describe(ModelCall(op, spec, target, dt, d, batch, heads, hkv, nq, nk,
                                                         values, given, build, notes))
    geo, listed, splits, l2 = part.geo, part.listed, part.splits, part.l2_bytes
    peak, bw = part.peak_tflops, part.hbm_gbps

    # ---- counts
    # The kept pairs, as reference.visible_pairs counts them (from the geometry: the closed form
    # or the chunked evaluation of the mask alone, never an Nq × Nk tensor).
    pairs_total = geo.pairs * batch * heads // (geo.bp * geo.hp)
    visits = count_visits(geo, nq, nk, part.fwd_mn, part.bwd_mn if backward else None, listed, batch, heads,
                          hkv)
    scale = batch * heads // (geo.bp * geo.hp)
    tparams = tensor_params(spec, values)
    fwd_tr = fwd_traffic(batch, heads, hkv, nq, nk, d, e, pairs_total, visits, scale, tparams)
    bwd_tr = None
    if backward:
        bwd_tr = bwd_traffic(batch, heads, hkv, nq, nk, d, e, pairs_total, visits, scale,
                              batch * hkv * splits, geo.bp * geo.hp, splits, tparams, part.dq_adds)
        if splits > 1:
            notes.append(f"backward: GQA group split over {splits} CTAs per key tile (dK/dV by fp32 atomics)")
    flops = fwd_tr.flops + (bwd_tr.flops if bwd_tr else 0)
    hbm = fwd_tr.hbm_bytes + (bwd_tr.hbm_bytes if bwd_tr else 0)
    std = fwd_tr.standard_hbm_bytes + (bwd_tr.standard_hbm_bytes if bwd_tr else 0)
    comp = fwd_tr.compulsory_bytes + (bwd_tr.compulsory_bytes if bwd_tr else 0)
    t_compute = flops / (peak * 1e12) * 1e3
    t_memory = hbm / (bw * 1e9) * 1e3
    floor_ms = max(t_compute, t_memory)
    compulsory_floor_ms = max(t_compute, comp / (bw * 1e9) * 1e3)
    rereads = fwd_tr.terms["K, V reads"] - fwd_tr.compulsory_terms["K, V reads"]
    if bwd_tr is not None:
        rereads += bwd_tr.terms["main: K, V reads"] - bwd_tr.compulsory_terms["K, V reads"]
    if part.l2_rereads and rereads > 0:
        notes.append(f"K/V re-reads ({fmt_bytes(rereads)} over reading each K/V row once) mostly hit L2 "
                     f"({fmt_bytes(l2)}): DRAM bytes lie between compulsory_bytes and hbm_bytes")
    pair_params = [tp.name for tp in tparams if tp.per_pair]
    if pair_params:
        notes.append(f"tensor parameter(s) {', '.join(pair_params)} indexed by (q, kv): read per visited element "
                     "and work item (an upper bound where a tile's mask is partial: score() sees kept elements "
                     "only)")
    if backward and any(tp.grad_reads for tp in tparams):
        names = ", ".join(tp.name for tp in tparams if tp.grad_reads)
        notes.append(f"backward: counted with the gradient of {names} requested (fp32 atomics per visited element)")
    if listed:
        notes.append("no closed-form key range: counted from the block lists the kernels build per call "
                     "(the classifier's own traffic is not counted)")

    shown = {n: (list(x.shape) if isinstance(x, torch.Tensor) else x) for n, x in values.items()}
    rep = Report(
        spec=spec.name, family=choice.family.name, device=fam, family_why=choice.why(), arch=target.arch,
        gpu=part.gpu, target=part.where, direction="fwd+bwd" if backward else "fwd",
        batch=batch, heads=heads, kv_heads=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dt.value,
        params=shown, visible_pairs=pairs_total / (batch * heads), density=pairs_total / (batch * heads * nq * nk),
        flops=flops, hbm_bytes=hbm, standard_hbm_bytes=std, compulsory_bytes=comp, fwd=fwd_tr, bwd=bwd_tr,
        tiles=part.tiles, reference_tiles=part.reference_tiles, model=part.model, peak_tflops=peak, hbm_gbps=bw,
        peaks_source=part.peaks_source, arithmetic_intensity=flops / hbm if hbm else math.inf, floor_ms=floor_ms,
        compulsory_floor_ms=compulsory_floor_ms, bound="compute" if t_compute >= t_memory else "memory",
        l2_bytes=l2, threads=part.threads, notes=notes)
    if measure:
        values = materialize(spec, values, given, batch, heads, nq, nk)
        ms = time_call(op, target, dt, batch, heads, hkv, nq, nk, d, values, backward, reps)
        rep.measured_ms = ms
        rep.tflops = flops / ms / 1e9
        rep.fraction_of_floor = floor_ms / ms
    return rep


def time_call(op, target: Target, dt, batch, heads, hkv, nq, nk, d, values, backward: bool, reps: int) -> float:
    """Median milliseconds of the call (forward, or forward + backward) on random inputs."""
    device = target.device
    tdt = TORCH_DTYPE[dt]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, nq, d, device=device, dtype=tdt, generator=gen)
    k = torch.randn(batch, hkv, nk, d, device=device, dtype=tdt, generator=gen)
    v = torch.randn(batch, hkv, nk, d, device=device, dtype=tdt, generator=gen)
    p = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in values.items()}
    if backward:
        dout = torch.randn(batch, heads, nq, d, device=device, dtype=tdt, generator=gen)
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            torch.autograd.grad(op(q, k, v, **p), (q, k, v), dout)

        step()
        return time_fn(step, device, reps=reps)
    with torch.no_grad():
        op(q, k, v, **p)
        return time_fn(lambda: op(q, k, v, **p), device, reps=reps)
