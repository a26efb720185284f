"""Kernel launches: the ABI blocks (flashgen/abi.py, args.h) filled from validated inputs and
passed to a loaded library's entry points through ctypes; on CUDA on the current stream of the
inputs' device, with no host synchronisation (so a call can be captured in a CUDA graph).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import env, families, philox
from ..abi import FgBwdArgs, FgClassifyArgs, FgFwdArgs, status_name
from ..build import cache
from ..codegen.variant import param_fields
from ..errors import KernelError
from ..lang import ir
from .checks import IR_DTYPE, Blocks, Packed, as_device, check_dropout_seed, dense_rows, dims, row_shape

# Fill outputs with NaN before each launch, so an element the kernel fails to write shows.
# A testing aid (tests switch it on); off by default because it costs a memory pass.
poison_outputs = False


def _strides(t: torch.Tensor, packed: Packed | None) -> tuple[int, int, int]:
    """(stride_b, stride_h, stride_n) of an input or output; packed [total, H, d]: (0, H's, row's)."""
    if packed is None:
        return t.stride()[:3]
    return 0, t.stride(1), t.stride(0)


def _set_varlen(args, packed: Packed | None) -> None:
    """Fill the ABI's packed-layout fields (left null / 0 for the padded layout)."""
    if packed is not None:
        args.cu_seqlens_q = packed.cu_seqlens_q.data_ptr()
        args.cu_seqlens_k = packed.cu_seqlens_k.data_ptr()
        args.total_q = packed.total_q
        args.total_k = packed.total_k


def dropout_state(dropout_seed: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The {seed, offset} pair of the dropout stream, int64 [2] on ``device``, formed exactly as
    the op forms it from its ``dropout_seed`` argument (the kernels read it on the device, so
    nothing syncs the host and a CUDA graph capture replays with fresh values).

    ``dropout_seed=None``: both drawn (non-negative) from torch's default generator for
    ``device``, advancing it. So the pair a call used is recovered by replaying the generator:
    ``torch.manual_seed(s); op(..., dropout_p=p)`` and then ``torch.manual_seed(s);
    seed, offset = flashgen.dropout_state(None, device).tolist()`` (with nothing else drawn from
    that generator in between). An int in [0, 2^64): that seed and offset 0, stored as the int64
    with the same bits. ``flashgen.reference.attention(..., dropout_p=p, dropout_seed=seed,
    dropout_offset=offset)`` then regenerates the call's exact keep mask.
    """
    device = as_device(device) if device is not None else torch.device("cpu")
    if dropout_seed is None:
        return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)
    dropout_seed = check_dropout_seed(dropout_seed)
    state = torch.zeros(2, dtype=torch.int64, device=device)
    state[0] = dropout_seed - 2**64 if dropout_seed >= 2**63 else dropout_seed  # an int64 fill: no host copy
    return state


def _set_dropout(args, dropout_p: float, state: torch.Tensor | None) -> None:
    """Fill the ABI's dropout fields (null state: no dropout); threshold as flashgen/philox.py."""
    if dropout_p and state is not None:
        args.dropout_state = state.data_ptr()
        args.dropout_threshold = philox.threshold(dropout_p)
        args.dropout_scale = 1.0 / (1.0 - dropout_p)


def check_status(lib: cache.LoadedLibrary, kind: str, status: int) -> None:
    if status:
        detail = lib.error(kind)
        # the artifact's folder name (inst.name), read from its path: no cache key is computed
        raise KernelError(f"{lib.path.parent.name}: {kind} kernel failed with {status_name(status)}"
                          + (f": {detail}" if detail else ""))


def _launch(entry, args, q: torch.Tensor) -> int:
    """Call a kernel entry point with ``args``: on CUDA, on the current stream of q's device
    (made current for the launch when another device is), with no host synchronisation."""
    if not q.is_cuda:
        return entry(ctypes.byref(args))
    index = q.get_device()
    if not args.num_sms:
        args.num_sms = _num_sms(index)
    args.stream = torch._C._cuda_getCurrentRawStream(index)
    if torch._C._cuda_getDevice() == index:
        return entry(ctypes.byref(args))
    with torch.cuda.device(index):
        return entry(ctypes.byref(args))


def call_entry(entry, args, q: torch.Tensor) -> int:
    """``_launch`` for the other runtime modules (runtime/decode.py): the entry point called with
    ``args`` on q's device and current stream, with no host synchronisation."""
    return _launch(entry, args, q)


def _misaligned(t: torch.Tensor) -> bool:
    """Whether t's pointer or strides break the 16-byte vector loads."""
    elems = 16 // t.element_size()
    return bool(t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy in fresh (aligned) memory when its pointer or strides break the
    16-byte vector loads (``contiguous()`` would hand back a contiguous view at a misaligned
    offset unchanged)."""
    return t.clone(memory_format=torch.contiguous_format) if _misaligned(t) else t


def num_sms(t: torch.Tensor) -> int:
    """The multiprocessor count of t's CUDA device (0 for a CPU tensor), cached."""
    return _num_sms(t.get_device()) if t.is_cuda else 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``_aligned`` for the other runtime modules (runtime/decode.py)."""
    return _aligned(t)


_sms: dict[int, int] = {}


def _num_sms(index: int) -> int:
    if index not in _sms:
        _sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sms[index]


def params_struct(spec: ir.Spec):
    """A ctypes Structure class mirroring the generated ``Params`` (codegen.param_fields)."""
    ctype = {"int64": ctypes.c_int64, "float": ctypes.c_float, "ptr": ctypes.c_void_p,
             "gradptr": ctypes.c_void_p}
    fields = []
    for f in param_fields(spec):
        if f.ctype.startswith("int64["):
            fields.append((f.name, ctypes.c_int64 * int(f.ctype[6:-1])))
        else:
            fields.append((f.name, ctype[f.ctype]))
    return type(f"Params_{spec.name}", (ctypes.Structure,), {"_fields_": fields})


def params_block(op, values) -> ctypes.Structure | None:
    """The variant's Params struct for ``values`` (spec order), gradient pointers null; None
    when the spec has no parameters."""
    if not op.spec.params:
        return None
    block = op.params_struct()
    for p, value in zip(op.spec.params, values, strict=True):
        if not p.is_tensor:
            setattr(block, p.name, value)
            continue
        setattr(block, p.name, value.data_ptr() if value.numel() else None)
        getattr(block, p.name + "_size")[:] = list(value.shape)
        getattr(block, p.name + "_stride")[:] = list(value.stride())
    return block


@dataclass(frozen=True)
class ForwardPlan:
    """What a forward call with given input metadata launches, learnt from a validated call: the
    library, the ABI block with everything but the pointers filled, the LSE's shape, the family's
    per-call fields and the block lists' tiles. Two caches hold them: the eager call's
    (``plan_key``: shapes, strides, dtypes, devices, scale, tensor parameters' metadata, the
    environment that selects libraries, the forced family and the tuning store's generation; a
    planned call still checks the scalar parameter values) and the registered op's
    (runtime/plans.py, whose key holds the scalar values too)."""

    lib: cache.LoadedLibrary
    args: bytes
    lse_shape: tuple[int, ...]
    fill: Callable | None = None  # the family's per-call fields (LaunchFields.fwd), None: none
    lists: tuple[int, int, int] | None = None  # (rows, cols, full_kept) of the call's block_kv; None: no lists


def scale_key(scale):
    """A scale's part of a plan key: a float by its exact bits (-0.0 and 0.0 are equal floats)."""
    return scale.hex() if isinstance(scale, float) else scale


def plan_key(op, q, k, v, scale, values) -> tuple:
    """The key of the eager call's ``ForwardPlan``s: every input property the validation and the
    library choice read, except pointers and scalar parameter values."""
    params = tuple((x.dtype, x.device, x.shape, x.stride()) if isinstance(x, torch.Tensor) else type(x)
                   for x in values) if values else ()
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, k.dtype, k.device,
            v.dtype, v.device, scale_key(scale), params, env.library_selection(), families.forced_block(),
            op.generation())


def make_forward_plan(op, fam: families.Family, q, k, v, scale: float, blocks: Blocks | None,
                      out: torch.Tensor) -> ForwardPlan | None:
    """The plan of a padded-layout forward call that just ran validated on ``fam`` with the
    validated ``scale`` and ``blocks`` (lists the call was given: their tiles go in the plan, the
    tensor comes with each call); None for inputs that needed an aligned copy or empty outputs."""
    if out.numel() == 0 or (q.is_cuda and any(_misaligned(t) for t in (q, k, v))):
        return None
    B, Hq, Hkv, Nq, Nk, d = dims(q, k, None)
    lib = op.library(fam, q.device, IR_DTYPE[q.dtype], d, False, blocks is not None, max(Nq, Nk))
    args = FgFwdArgs(0, 0, 0, 0, 0, B, Hq, Hkv, Nq, Nk, d, *_strides(q, None), *_strides(k, None),
                     *_strides(v, None), *_strides(out, None), scale, 0, None, None)
    if q.is_cuda:
        args.num_sms = _num_sms(q.get_device())
    fields = op.launch_fields(lib)
    lists = (blocks.meta[0], blocks.meta[1], blocks.meta[6]) if blocks is not None else None
    return ForwardPlan(lib, bytes(args), (B, Hq, Nq), fields.fwd if fields.fills_fwd else None, lists)


def forward_plan(op, q, k, v, scale, values, out) -> ForwardPlan | None:
    """The eager call's plan of a padded-layout forward call without block lists that just ran
    validated (None where a call cannot be planned: per-call block lists, inputs that needed an
    aligned copy, empty ones)."""
    d = q.shape[-1]
    fam = op.choose_family(q.device, IR_DTYPE[q.dtype], d, False, False, False).family
    if fam.block_classifier and op.auto_sparse and env.auto_block_mask():
        return None
    return make_forward_plan(op, fam, q, k, v, op.scale_for(scale, d), None, out)


def launch_planned(op, plan: ForwardPlan, q, k, v, values, block_kv=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out and lse of a forward launched from its plan (``values``: the checked parameters;
    ``block_kv``: the call's lists where the plan has lists); None when the call must take the
    full path (a pointer not 16-byte aligned, or outputs to be poisoned)."""
    if poison_outputs or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return None
    block = op.params_block(values) if values else None
    out = torch.empty_like(q)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    args = FgFwdArgs.from_buffer_copy(plan.args)
    args.q, args.k, args.v, args.out, args.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    if block is not None:
        args.params = ctypes.addressof(block)
    if plan.lists is not None:
        args.kv_blocks = Blocks.lists(block_kv, *plan.lists)
    if plan.fill is not None:
        plan.fill(args, values)
    check_status(plan.lib, "fwd", _launch(plan.lib.fwd, args, q))
    return out, lse


def planned_forward(op, plan: ForwardPlan, q, k, v, values) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The eager call's ``launch_planned``: the scalar parameter values checked first (its key
    holds only their types)."""
    if values:
        values = op.check_params(q, k, dict(zip((p.name for p in op.spec.params), values, strict=True)))
    return launch_planned(op, plan, q, k, v, values)


def launch_forward(op, q, k, v, scale: float, values=(), dropout_p: float = 0.0,
             dropout_state: torch.Tensor | None = None, *,
             packed: Packed | None = None, blocks: Blocks | None = None,
             lib: cache.LoadedLibrary | None = None,
             family: families.Family | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of one forward launch. ``lib``: run this loaded library instead of the
    call's own (flashgen.tune times candidate tiles this way). ``packed``: the validated varlen
    layout (None: padded); the family may take more from it per call (``fwd_packed``: the sm90
    forward's work queue, args.h FgWorkQueue -- the layout's cached work-order table, ranked
    longest first, and a fresh zeroed counter, held until the launch is enqueued; a counter
    allocated under CUDA graph capture is zeroed by a captured memset at each replay)."""
    B, Hq, Hkv, Nq, Nk, d = dims(q, k, packed)
    fill = float("nan") if poison_outputs else None
    # q's strides when q is dense (a transposed view stays one), else contiguous; as the fake.
    out = torch.empty_like(q) if fill is None else torch.full_like(q, fill)
    lse = q.new_empty(row_shape(B, Hq, Nq, packed, "q"), dtype=torch.float32)
    if fill is not None:
        lse.fill_(fill)
    if out.numel() == 0:
        return out, lse
    if q.is_cuda:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if lib is None:
        fam = family or op.choose_family(q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                     bool(dropout_p)).family
        lib = op.library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                            max(Nq, Nk))
    block = op.params_block(values)
    args = FgFwdArgs(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        B, Hq, Hkv, Nq, Nk, d,
        *_strides(q, packed), *_strides(k, packed), *_strides(v, packed), *_strides(out, packed),
        scale, 0, None, ctypes.addressof(block) if block is not None else None,
    )  # fmt: skip
    if dropout_p:
        _set_dropout(args, dropout_p, dropout_state)
    if packed is not None:
        _set_varlen(args, packed)
    if blocks is not None:
        args.kv_blocks = blocks.fwd()
    fields = op.launch_fields(lib)
    fields.fwd(args, values)
    # packed: what the family takes from the layout (the sm90 forward's work queue), held here
    # until the launch is enqueued
    keep = fields.fwd_packed(args, packed, lib.instantiation.config) if packed is not None else None
    check_status(lib, "fwd", _launch(lib.fwd, args, q))
    del keep
    return out, lse


def launch_backward(op, q, k, v, out, lse, dout, dlse, scale: float, deterministic: bool, values=(),
              need_param_grads=(), dropout_p: float = 0.0, dropout_state: torch.Tensor | None = None, *,
              packed: Packed | None = None, blocks: Blocks | None = None, lib: cache.LoadedLibrary | None = None,
              family: families.Family | None = None):
    """dq, dk, dv by recomputation (FlashAttention-2 Alg. 2) from the saved out and lse, and
    the gradients of the float tensor parameters in ``op.grad_params`` (an empty tensor
    for those not in ``need_param_grads``). With dropout, the forward's ``dropout_p`` and
    ``dropout_state``: the kernel regenerates its mask (FlashAttention, Alg. 4). ``packed``:
    the validated varlen layout (None: padded). ``lib``: run this loaded library instead of
    the call's own (flashgen.tune times candidate tiles this way)."""
    B, Hq, Hkv, Nq, Nk, d = dims(q, k, packed)
    fill = float("nan") if poison_outputs else None
    # Like the inputs' layout when dense, else contiguous (empty_like's rule; the fake's too).
    dq, dk, dv = (torch.empty_like(t) if fill is None else torch.full_like(t, fill) for t in (q, k, v))
    block = op.params_block(values)
    by_name = {p.name: val for p, val in zip(op.spec.params, values, strict=True)}
    pgrads = []
    for name, need in zip(op.grad_params, need_param_grads or [False] * len(op.grad_params), strict=True):
        if need:
            g = torch.zeros(by_name[name].shape, dtype=torch.float32, device=q.device)
            setattr(block, name + "_grad", g.data_ptr() if g.numel() else None)
        else:
            g = torch.empty(0, dtype=torch.float32, device=q.device)
        pgrads.append(g)
    if dq.numel() + dk.numel() == 0:
        return dq, dk, dv, pgrads
    # dout: a view (transpose, slice) is fine; broadcast (stride 0) or odd strides are copied.
    dout = dense_rows(dout)
    if q.device.type == "cuda":
        q, k, v, out, dout = (_aligned(t) for t in (q, k, v, out, dout))
    f32 = {"dtype": torch.float32, "device": q.device}
    rows_q, rows_k = row_shape(B, Hq, Nq, packed, "q"), row_shape(B, Hkv, Nk, packed, "k")
    # every family's backward zero-fills dq_accum itself (CUDA: in the D pre-pass; CPU: per row)
    dq_accum = torch.empty((*rows_q, d), **f32)
    softmax_d = torch.empty(rows_q, **f32)
    # dk_accum / dv_accum: only for a CUDA backward that splits the GQA group (below).
    dk_accum = dv_accum = None
    dlse = dlse.float().contiguous() if dlse is not None else None
    if lib is None:
        fam = family or op.choose_family(q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                         bool(dropout_p), backward=True, gqa=Hq != Hkv,
                                         deterministic=deterministic).family
        lib = op.library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                         max(Nq, Nk))
    if lib.bwd is None:
        raise NotImplementedError(f"{op.name}: the backward pass is not implemented in this version "
                                  "(forward only); call the op under torch.no_grad() or on inputs "
                                  "that do not require grad")
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    args = FgBwdArgs(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
        dq_accum.data_ptr(), softmax_d.data_ptr(), None, None,
        B, Hq, Hkv, Nq, Nk, d,
        *(x for t in (q, k, v, out, dout, dq, dk, dv) for x in _strides(t, packed)),
        scale, 0, int(deterministic), None, ctypes.addressof(block) if block is not None else None,
        ptr(dlse),
    )  # fmt: skip
    _set_dropout(args, dropout_p, dropout_state)
    _set_varlen(args, packed)
    if blocks is not None:
        args.q_blocks, args.kv_blocks = blocks.bwd()
    if q.is_cuda:
        args.num_sms = _num_sms(q.get_device())
    fields = op.launch_fields(lib)
    # A family whose deterministic mode orders each query tile's dQ adds (sm90) takes one
    # semaphore per query row (args.h).
    dq_semaphore = torch.zeros(rows_q, dtype=torch.int32, device=q.device) \
        if deterministic and q.is_cuda and fields.orders_dq else None
    args.dq_semaphore = ptr(dq_semaphore)
    fields.bwd(args, values, lib.instantiation.config)
    if q.is_cuda and Hq != Hkv and args.gqa_splits > 1:
        # The shares of a split group add dK, dV into fp32 workspaces (the launch zeroes them).
        dk_accum, dv_accum = (torch.empty((*rows_k, d), **f32) for _ in range(2))
        args.dk_accum, args.dv_accum = dk_accum.data_ptr(), dv_accum.data_ptr()
    check_status(lib, "bwd", _launch(lib.bwd, args, q))
    return dq, dk, dv, pgrads


def classify(lib, params_block, batch: int, heads: int, nq: int, nk: int, br: int, bc: int,
                  device: torch.device, cu_seqlens_q: torch.Tensor | None = None,
                  cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """Block classes int8 [batch, heads, ⌈nq/br⌉, ⌈nk/bc⌉] of a spec's mask by its generated
    classifier kernel (cuda/classify.cuh) on ``device``'s current stream (no host sync).
    ``lib``: the spec's loaded classifier library (its family's ``classifier``);
    ``params_block``: the op's ctypes Params (``op.params_block``), kept alive by the caller."""
    rows, cols = -(-nq // br), -(-nk // bc)
    out = torch.empty((batch, heads, rows, cols), dtype=torch.int8, device=device)
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    args = FgClassifyArgs(out.data_ptr(), batch, heads, nq, nk, br, bc, rows, cols, ptr(cu_seqlens_q),
                          ptr(cu_seqlens_k), ctypes.addressof(params_block) if params_block is not None else None)
    with torch.cuda.device(device):
        args.stream = torch.cuda.current_stream().cuda_stream
        status = lib.classify(ctypes.byref(args))
    check_status(lib, "mask", status)
    return out


def records_grad(q, k, v, values) -> bool:
    """Whether autograd records this call (grad mode on and an input that requires grad)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in values))


def direct(q, k, v, values) -> bool:
    """Whether an eager call may run the op's implementation without the dispatcher: plain
    tensors (not lazily negated views, which the dispatcher materialises), nothing tracing or
    intercepting ops (torch.compile, a dispatch or torch-function mode, functorch transforms,
    the profiler, autocast, whose rule the dispatcher applies:
    runtime/library.py). The implementation is the registered op's own, with its one
    validation, and a call that records a gradient goes through the op's own autograd
    (setup_context and backward); this only skips torch.library's dispatch, autograd wrapper
    and schema parsing (tens of microseconds a call)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    # (is_neg last: dynamo cannot trace it, and under torch.compile the answer is already False)
    return not (torch.compiler.is_compiling() or torch._C._is_any_autocast_enabled()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()
                or torch.autograd.profiler._is_profiler_enabled
                or any(isinstance(t, torch.Tensor) and (type(t) is not torch.Tensor or t.is_neg()) for t in values)
                or q.is_neg() or k.is_neg() or v.is_neg())  # a lazily negated view: the dispatcher materialises it
