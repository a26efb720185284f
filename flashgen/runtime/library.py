"""torch.library registration of one spec's op: schema, the real implementation (the call's
one validation, then the launch), the fake implementation for torch.compile, and autograd
through a backward op of its own.
"""

from __future__ import annotations

import torch

from ..caches import Bounded
from . import plans
from .checks import (
    IR_DTYPE,
    Packed,
    check_blocks,
    check_varlen_given,
    describe_tensor,
    dims,
    packed_layout,
)

# Every spec's op lives in the "flashgen" namespace; the Library object must outlive the ops.
_LIBRARY = torch.library.Library("flashgen", "FRAGMENT")


def _same_device(q: torch.Tensor, named) -> None:
    """For the fake (meta) kernels: ValueError naming the first tensor of ``named`` ((name, value)
    pairs) that is not on q's device. The dispatcher sends a call whose tensors include one on
    the meta device to the fake kernel even when q is a real tensor, which would return empty
    (uninitialised) outputs; the real kernels reject a tensor on another device alike."""
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")


def deterministic_param_grads(op, names) -> None:
    """Deterministic mode asked for gradients of the parameters ``names``, which the kernels sum
    with fp32 atomics (not bitwise repeatable): RuntimeError, as torch raises for an operation
    without a deterministic implementation, or a warning under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``."""
    msg = (f"{op.name}: gradients of parameter(s) {', '.join(names)} are summed with fp32 atomics and are "
           "not bitwise repeatable; deterministic mode was requested (deterministic=True or "
           "torch.use_deterministic_algorithms(True))")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg + "; detach those parameters or turn deterministic mode off")


def refuse_deterministic_param_grads(op, values, deterministic: bool) -> None:
    """At a forward call (``op(...)``, before any launch): ``deterministic_param_grads`` when
    deterministic mode (the argument or torch's) would be asked for the gradient of a parameter
    that requires grad; nothing under ``warn_only`` (the backward warns) or without grad mode."""
    if not torch.is_grad_enabled() or not (deterministic or torch.are_deterministic_algorithms_enabled()) \
            or torch.is_deterministic_algorithms_warn_only_enabled():
        return
    needs = [p.name for p, x in zip(op.spec.params, values, strict=True)
             if p.name in op.grad_params and isinstance(x, torch.Tensor) and x.requires_grad]
    if needs:
        deterministic_param_grads(op, needs)


def _autocast(qualname: str, device_type: str):
    """The op's autocast rule for ``device_type``, as SDPA's: inside ``torch.autocast`` q, k and
    v (floating point, not float64, on that device type) are cast to the autocast dtype and the
    op runs in it, returning out in that dtype (lse stays fp32). Tensor parameters keep their
    declared dtype (an f32 bias stays f32), unlike ``torch.library.register_autocast``, which
    would cast every floating-point tensor to one fixed dtype."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, "Autocast" + device_type.upper()))

    def cast(t, dtype):
        if t.is_floating_point() and t.device.type == device_type and t.dtype not in (dtype, torch.float64):
            return t.to(dtype)
        return t

    def kernel(q, k, v, *rest, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return getattr(torch.ops.flashgen, qualname).default(cast(q, dtype), cast(k, dtype), cast(v, dtype),
                                                                  *rest, **kwargs)

    return kernel


def register(op, qualname: str):
    """Define ``flashgen::<qualname>`` with CPU/CUDA kernels, a fake implementation and autograd.

    Schema: ``(q, k, v, scale, deterministic, *params)`` → ``(out, lse)``, the spec's parameters
    in declaration order (int, float or Tensor), then, for a spec that declares ``dropout``,
    ``float dropout_p, Tensor? dropout_state`` (int64 [2] {seed, offset}; None when p is 0), then
    the packed layout's ``Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt?
    max_seqlen_q=None, SymInt? max_seqlen_k=None`` (None: padded; a None max_seqlen is derived).
    The backward is an op of its own, ``<qualname>_bwd``, returning dq, dk, dv and a list with
    one gradient per float tensor parameter that enters the score (empty where not requested);
    it takes the forward's dropout and packed-layout arguments last and regenerates the same
    mask.

    Under ``torch.autocast`` (CPU and CUDA) the op computes in the autocast dtype, as SDPA does
    (``_autocast``).

    Registered through torch.library's Library API rather than ``custom_op``, whose wrapper
    imports torch._dynamo at the first call (seconds), which would dominate a cached load.
    """
    name = f"flashgen::{qualname}"
    spec = op.spec
    # SymInt: under torch.compile a new int value (a window) does not recompile once dynamic.
    schema_type = {"int": "SymInt", "float": "float", "tensor": "Tensor"}
    pdecl = "".join(f", {schema_type[p.kind]} {p.name}" for p in spec.params)
    npar = len(spec.params)
    ddecl = ", float dropout_p, Tensor? dropout_state" if spec.dropout else ""
    ndrop = 2 if spec.dropout else 0
    vdecl = (", Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, "
             "SymInt? max_seqlen_k=None, Tensor? block_kv=None, Tensor? block_q=None, Tensor? block_dq=None, "
             "int[] block_meta=[]")
    _LIBRARY.define(f"{qualname}(Tensor q, Tensor k, Tensor v, float? scale, bool deterministic{pdecl}{ddecl}"
                    f"{vdecl}) -> (Tensor, Tensor)")
    # the names of the arguments after deterministic, in schema order (for errors)
    tensor_names = [p.name for p in spec.params] + (["dropout_p", "dropout_state"] if spec.dropout else []) + [
        "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_kv", "block_q", "block_dq"]

    def varlen_of(rest, start=None) -> tuple:
        """The four packed-layout arguments after the spec's (None when left out)."""
        start = npar + ndrop if start is None else start
        tail = tuple(rest[start:start + 4])
        return tail + (None,) * (4 - len(tail))

    def blocks_of(rest, start=None) -> tuple:
        """The block-sparsity arguments after the packed layout's: block_kv, block_q, block_dq,
        block_meta (None / [] when left out)."""
        start = (npar + ndrop if start is None else start) + 4
        tail = tuple(rest[start:start + 4])
        tail = tail + (None,) * (3 - len(tail[:3]))
        return tail[:3] + (tail[3] if len(tail) > 3 and tail[3] is not None else [],)

    def packed_of(q, k, v, varlen) -> Packed | None:
        """The validated packed layout of a raw call (None: padded); checks q, k, v too."""
        is_packed = check_varlen_given(*varlen)
        op.check_inputs(q, k, v, packed=is_packed)  # the raw op (torch.ops.flashgen.*) is callable directly too
        if not is_packed:
            return None
        return packed_layout(q, k, *varlen)

    def checked(kind, q, k, v, scale, values, dropout, varlen, block_lists, deterministic=False):
        """The one validation of a call (the forward's or the backward's): inputs, packed
        layout, block lists, scale, parameters and dropout, then the family that serves it.
        Raises naming the argument, before any launch."""
        packed = packed_of(q, k, v, varlen)
        B, Hq, Hkv, Nq, Nk, d = dims(q, k, packed)
        dtype = IR_DTYPE[q.dtype]
        p = bool(dropout and dropout[0])
        fam = op.choose_family(q.device, dtype, d, packed is not None, bool(block_lists[3]), p,
                               backward=kind == "bwd", gqa=Hq != Hkv, deterministic=deterministic).family
        blocks = check_blocks(kind, *block_lists, B, Hq, Nq, Nk, q.device, fam.dq_lists)
        scale = op.scale_for(scale, d)
        values = op.check_params(q, k, {p.name: x for p, x in zip(spec.params, values, strict=True)},
                                 packed.sizes(q.shape[1]) if packed is not None else None)
        if dropout:
            op.check_dropout(q, *dropout)
        # A deterministic backward that orders dQ by semaphores walks every query tile (its
        # kernels take no block lists): the element mask alone, no automatic lists.
        if blocks is None and not (kind == "bwd" and deterministic and fam.launch_fields(spec).orders_dq):
            blocks = op.auto_blocks(fam, kind, q, k, values, packed)
        return fam, packed, blocks, scale, values

    # Launch plans of calls whose metadata was validated before (runtime/plans.py).
    fwd_plans, bwd_plans = Bounded(), Bounded()
    op.raw_plans = (fwd_plans, bwd_plans)

    def forward(q, k, v, scale, deterministic, *rest):
        values, dropout = rest[:npar], rest[npar:npar + ndrop]
        varlen, lists = varlen_of(rest), blocks_of(rest)
        key = plans.forward_key(op, q, k, v, scale, values, dropout, varlen, lists)
        if key is not None:
            plan = fwd_plans.get(key)
            if plan is not None:
                res = plans.run_forward(op, plan, q, k, v, values, lists[0])
                if res is not None:
                    return res
        fam, packed, blocks, scale, values = checked("fwd", q, k, v, scale, values, dropout, varlen, lists)
        out, lse = op.launch_forward(q, k, v, scale, values, *dropout, packed=packed, blocks=blocks, family=fam)
        if key is not None:
            plan = plans.forward_plan(op, fam, q, k, v, scale, blocks, bool(lists[3]), out)
            if plan is not None:
                fwd_plans[key] = plan
        return out, lse

    op.implementation = forward

    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(qualname, forward, key)
        _LIBRARY.impl(qualname, _autocast(qualname, key.lower()), "Autocast" + key)

    def fake(q, k, v, scale, deterministic, *rest):
        _same_device(q, [("k", k), ("v", v), *zip(tensor_names, rest)])
        if varlen_of(rest)[0] is not None:  # packed: out [total_q, Hq, d], lse [Hq, total_q]
            return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        B, Hq, Nq, _d = q.shape
        return torch.empty_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)

    torch.library.register_fake(name, fake, lib=_LIBRARY)
    grad_index = [i for i, p in enumerate(spec.params) if p.name in op.grad_params]

    def setup_context(ctx, inputs, output):
        q, k, v, scale, deterministic, *rest = inputs
        values, dropout = rest[:npar], rest[npar:npar + ndrop]
        cu_q, cu_k, max_q, max_k = varlen_of(rest)
        _, block_q, block_dq, block_meta = blocks_of(rest)
        ctx.block_meta = list(block_meta)
        if block_meta and block_q is None:
            raise ValueError("block_q: the backward of a block-sparse call needs its lists (pass block_q, and "
                             "block_dq on CUDA, or call through the op with block_mask=)")
        out, lse = output
        tensors = [x for x in values if isinstance(x, torch.Tensor)]
        # The dropout state (not its mask) is all the backward needs to regenerate the mask.
        ctx.dropout_p = dropout[0] if dropout else 0.0
        ctx.max_seqlens = (max_q, max_k)
        ctx.ninputs = len(inputs)
        ctx.save_for_backward(q, k, v, out, lse, dropout[1] if dropout else None, cu_q, cu_k, block_q, block_dq,
                              *tensors)
        ctx.scalars = [None if isinstance(x, torch.Tensor) else x for x in values]
        ctx.scale = scale
        ctx.deterministic = deterministic or torch.are_deterministic_algorithms_enabled()

    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():  # create_graph=True: the backward kernels are not differentiable
            raise NotImplementedError(f"{op.name}: double backward (create_graph=True) is not supported: the "
                                      "backward kernels have no derivative of their own")
        q, k, v, out, lse, dropout_state, cu_q, cu_k, block_q, block_dq, *tensors = ctx.saved_tensors
        dropout = (ctx.dropout_p, dropout_state) if ndrop else ()
        varlen = {} if cu_q is None and cu_k is None else {
            "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": ctx.max_seqlens[0],
            "max_seqlen_k": ctx.max_seqlens[1]}
        if ctx.block_meta:
            varlen.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=ctx.max_seqlens[0],
                          max_seqlen_k=ctx.max_seqlens[1], block_kv=None, block_q=block_q, block_dq=block_dq,
                          block_meta=ctx.block_meta)
        it = iter(tensors)
        values = [next(it) if x is None else x for x in ctx.scalars]
        need = ctx.needs_input_grad
        need_params = [bool(need[5 + i]) for i in grad_index]
        if any(need_params) and ctx.deterministic:
            deterministic_param_grads(op, [p for p, n in zip(op.grad_params, need_params, strict=True) if n])
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, pgrads = getattr(torch.ops.flashgen, qualname + "_bwd")(
            q, k, v, out, lse, grad_out, grad_lse, ctx.scale, ctx.deterministic, *values, need_params, *dropout,
            **varlen)
        result = [dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None]
        result += [None] * (ctx.ninputs - 5)
        for i, g, n in zip(grad_index, pgrads, need_params, strict=True):
            if n:
                result[5 + i] = g
        return tuple(result)

    _LIBRARY.define(f"{qualname}_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
                    f"Tensor? dlse, float? scale, bool deterministic{pdecl}, bool[] need_param_grads{ddecl}{vdecl}) "
                    "-> (Tensor, Tensor, Tensor, Tensor[])")

    def backward_impl(q, k, v, out, lse, dout, dlse, scale, deterministic, *rest):
        values, need_params, dropout = rest[:npar], rest[npar], rest[npar + 1:npar + 1 + ndrop]
        varlen, lists = varlen_of(rest, npar + 1 + ndrop), blocks_of(rest, npar + 1 + ndrop)
        key = plans.backward_key(op, q, k, v, out, lse, dout, dlse, scale, deterministic, values, need_params, dropout,
                                 varlen, lists)
        if key is not None:
            plan = bwd_plans.get(key)
            if plan is not None:
                return plans.run_backward(op, plan, q, k, v, out, lse, dout, dlse, deterministic, values, need_params,
                                          lists[1], lists[2])
        fam, packed, blocks, scale, values = checked("bwd", q, k, v, scale, values, dropout, varlen, lists,
                                                     deterministic)
        # The raw op is callable directly: out/dout like q, lse/dlse fp32 of the forward's LSE shape,
        # one need_param_grads flag per parameter that has a gradient.
        if len(need_params) != len(op.grad_params):
            what = ", ".join(op.grad_params) if op.grad_params else "none"
            raise ValueError(f"need_param_grads: expected {len(op.grad_params)} bools, one per parameter with a "
                             f"gradient ({what}), got {len(need_params)}")
        if deterministic and any(need_params):  # as the op's autograd backward refuses it
            deterministic_param_grads(op, [n for n, need in zip(op.grad_params, need_params, strict=True) if need])
        for name, t in (("out", out), ("dout", dout)):
            if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name}: expected shape {tuple(q.shape)}, dtype {q.dtype} on {q.device} (like q), "
                                 f"got {describe_tensor(t)}")
        want, what = ((q.shape[1], q.shape[0]), "[heads, total_q]") if packed is not None else \
            (tuple(q.shape[:3]), "[batch, heads, seqlen_q]")
        for name, t in (("lse", lse), ("dlse", dlse)):
            if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32 or t.device != q.device):
                raise ValueError(f"{name}: expected a float32 tensor of shape {what} = {want} on {q.device}, "
                                 f"got {describe_tensor(t)}")
        lse = lse.contiguous()
        res = op.launch_backward(q, k, v, out, lse, dout, dlse, scale, deterministic, values, need_params, *dropout,
                                 packed=packed, blocks=blocks, family=fam)
        if key is not None:
            plan = plans.backward_plan(op, fam, q, k, scale, blocks, bool(lists[3]))
            if plan is not None:
                bwd_plans[key] = plan
        return res

    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(qualname + "_bwd", backward_impl, key)

    def backward_fake(q, k, v, out, lse, dout, dlse, scale, deterministic, *rest):
        values, need_params = rest[:npar], rest[npar]
        after = tensor_names[npar:]  # need_param_grads sits between the parameters and the rest
        _same_device(q, [("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", dout), ("dlse", dlse),
                         *zip(tensor_names[:npar], values), *zip(after, rest[npar + 1:])])
        by_name = {p.name: x for p, x in zip(spec.params, values, strict=True)}
        pgrads = [by_name[n].new_empty(by_name[n].shape, dtype=torch.float32) if need
                  else q.new_empty(0, dtype=torch.float32) for n, need in zip(op.grad_params, need_params,
                                                                                strict=True)]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), pgrads

    torch.library.register_fake(name + "_bwd", backward_fake, lib=_LIBRARY)
    torch.library.register_autograd(name, backward, setup_context=setup_context, lib=_LIBRARY)

    class EagerAttention(torch.autograd.Function):
        """The registered op's autograd for an eager call that records a gradient: the same
        implementation, setup_context and backward, without the dispatcher's autograd wrapper
        (its schema re-parsing costs tens of microseconds a call). ``AttentionOp.__call__`` uses it
        only where it may skip the dispatcher (see ``runtime.launch.direct``)."""

        @staticmethod
        def forward(ctx, *inputs):
            ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None, as in the op's
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            return backward(ctx, grad_out, grad_lse)

    op.eager_autograd = EagerAttention.apply
    return getattr(torch.ops.flashgen, qualname).default



def register_kvcache(op, qualname: str, implementation):
    """Define ``flashgen::<qualname>_kvcache``, the decode call (``op.with_kvcache``,
    runtime/decode.py): schema ``(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor
    cache_seqlens, Tensor? block_table, Tensor? k, Tensor? v, Tensor? cache_leftpad, float? scale,
    SymInt num_splits, *params) -> (Tensor out, Tensor lse)`` (the caches are written when k / v
    are given), with ``implementation`` as its CPU/CUDA kernel, a fake implementation, and an
    Autograd kernel that refuses inputs requiring grad (decoding is inference only). Returns the
    op's overload."""
    spec = op.spec
    schema_type = {"int": "SymInt", "float": "float", "tensor": "Tensor"}
    pdecl = "".join(f", {schema_type[p.kind]} {p.name}" for p in spec.params)
    name = qualname + "_kvcache"
    _LIBRARY.define(f"{name}(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
                    f"Tensor? block_table, Tensor? k, Tensor? v, Tensor? cache_leftpad, float? scale, "
                    f"SymInt num_splits{pdecl}) -> (Tensor, Tensor)")
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, implementation, key)
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k", "v", "cache_leftpad")

    def refuse_grad(*args):
        if torch.is_grad_enabled():
            for n, t in zip(names + tuple(p.name for p in spec.params), args[:8] + args[10:], strict=True):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    raise NotImplementedError(f"{n}: {op.name}_kvcache is inference only (no backward); call it "
                                              "under torch.no_grad() or pass detached tensors")
        with torch._C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.flashgen, name).default(*args)

    _LIBRARY.impl(name, refuse_grad, "Autograd")

    def fake(q, k_cache, v_cache, *rest):
        _same_device(q, zip(names[1:] + ("scale", "num_splits") + tuple(p.name for p in spec.params),
                            (k_cache, v_cache, *rest)))
        return torch.empty_like(q), q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)

    torch.library.register_fake(f"flashgen::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.flashgen, name).default
