"""The op surface: ``flashgen.compile(spec)`` → ``AttentionOp``, called like FlashAttention.

Each spec becomes one torch op ``flashgen::<spec>_<hash12>`` (runtime/library.py: a
torch.library op with a fake implementation, so torch.compile(fullgraph=True) traces it and
dynamic sequence lengths do not recompile). ``AttentionOp.__call__`` only translates user
arguments; the registered implementation validates the call once (runtime/checks.py), picks the
kernel family (flashgen/families) and the library (looked up under every key that selects it,
loaded by runtime/loader.py) and launches it (runtime/launch.py).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from .. import env, families, tiles
from ..build import artifact, cache
from ..caches import Bounded
from ..codegen import variant
from ..errors import did_you_mean
from ..lang import expr as X
from ..lang import intervals, ir
from ..lang.frontend import parse
from ..reference import default_scale
from ..sparsity import BlockMask, mask_extents, mask_names
from ..tune import store as tune_store
from . import blocks, checks, decode, launch, loader
from .checks import (
    FLOAT32_MAX,
    Blocks,
    Packed,
    as_device,
    as_dtype,
    check_cu_seqlens_meta,
    check_no_bool_numbers,
    check_scale_type,
    check_dropout_p,
    check_dropout_seed,
    check_varlen_given,
    describe_param,
    plain_number,
    ranges_text,
    spec_dtypes,
)
from .launch import dropout_state
from .library import refuse_deterministic_param_grads, register, register_kvcache

# The kernel families (flashgen/families) whose kernels apply dropout; on the others
# dropout_p > 0 raises NotImplementedError naming dropout_p.
DROPOUT_BACKENDS = families.with_feature("dropout")

# The kernel families whose kernels take packed (varlen) batches (cu_seqlens_q, ...); on the
# others the op raises NotImplementedError naming cu_seqlens_q.
VARLEN_BACKENDS = families.with_feature("varlen")

_registry: dict[str, AttentionOp] = {}
_registry_lock = threading.Lock()

# The tuning store's generation: part of every library key, bumped by ``invalidate_libraries``
# (flashgen.tune calls it when it reads or records results), so a new winner is picked up.
_generation = [0]

# The first-use tuner (FLASHGEN_AUTOTUNE=1): flashgen.tune plugs ``ensure_tuned`` in here, called
# as first_use_tuner(op, device, dtype, head_dim, seqlen, family=fam) before a library is chosen.
first_use_tuner = None


def plug_first_use_tuner(tuner) -> None:
    """Plug in the first-use tuner (flashgen/tune/tuner.py's ``ensure_tuned``), called as
    tuner(op, device, dtype, head_dim, seqlen, family=fam) before a library of the tuned family
    ``fam`` is chosen with FLASHGEN_AUTOTUNE=1; the runtime does not import the tuner."""
    global first_use_tuner
    first_use_tuner = tuner


def invalidate_libraries() -> None:
    """Forget which family and library serve which call: families and tile choices are made
    again at the next call (after a family's declaration or the tuning store changed)."""
    _generation[0] += 1


tune_store.on_reload(invalidate_libraries)  # a new or re-read tuning result: choose libraries again


def compile(spec: str | Path | ir.Spec) -> AttentionOp:  # noqa: A001 - the public name
    """Parse and validate ``spec`` (a path to a ``.attn`` file or spec text) and return its op.

    Nothing is built here: kernels are compiled at the first call for each (device type,
    dtype, head dim), or ahead of time with ``op.build(...)`` / ``flashgen build``. A string is
    spec text when it has a newline or '{', or names no file and looks like no path (no '/',
    no ``.attn`` ending).

    Raises:
        SpecError: the spec does not parse or validate (message has file:line:col).
        FileNotFoundError: a path (a ``Path``, or a string ending in ``.attn`` or with a '/')
            that names no file.
        TypeError / ValueError: ``spec`` is neither a path nor text, or is empty.
    """
    if not isinstance(spec, str | Path | ir.Spec):
        raise TypeError(f"spec: expected a path or spec text, got {type(spec).__name__}")
    if isinstance(spec, str) and not spec.strip():
        raise ValueError("spec: empty string (expected a path or spec text)")
    ir_spec = spec if isinstance(spec, ir.Spec) else parse(spec)
    qualname = f"{ir_spec.name}_{ir_spec.fingerprint()[:12]}"
    with _registry_lock:
        if qualname not in _registry:
            _registry[qualname] = AttentionOp(ir_spec, qualname)
        return _registry[qualname]


class AttentionOp:
    """A compiled attention variant, called like FlashAttention.

    ``op(q, k, v, *, scale=None, return_lse=False, ...)`` computes
    ``out = softmax(scale · q kᵀ, masked as the spec says) · v`` (FlashAttention, Dao et al.
    2022, Alg. 1) without materialising the score matrix.
    """

    def __init__(self, spec: ir.Spec, qualname: str):
        self.spec = spec
        self.fingerprint = spec.fingerprint()  # (block masks compare it, also under torch.compile)
        self.mask_reads = mask_names(spec)  # the names its mask reads (block masks check their binding)
        self.name = f"flashgen::{qualname}"
        self._libs: dict[tuple, cache.LoadedLibrary] = {}
        self._libs_lock = threading.Lock()
        self._head_dims = {f: self.head_dims(f) for f in families.FAMILIES}
        self._dtypes = {f: self.dtypes(f) for f in families.FAMILIES}
        self._scales: dict[int, float] = {}  # head dim -> the spec's default scale
        self._libraries: dict[tuple, cache.LoadedLibrary] = Bounded()  # every key that selects a library
        self._choices: dict[tuple, families.Choice] = {}
        self.checked_inputs = Bounded()  # input metadata check_inputs accepted
        self.plans: dict[tuple, launch.ForwardPlan] = Bounded()  # launch plans of eager calls (runtime/launch.py)
        self._fields: dict[str, families.LaunchFields] = {}  # family name -> its per-call decisions
        self.implementation = None  # the registered forward implementation (set by _register)
        self.eager_autograd = None  # its autograd.Function for direct eager calls (set by _register)
        self.params_struct = launch.params_struct(spec)
        self.grad_params = tuple(p.name for p in X.grad_params(spec))
        # (parameter, dim, position name) for every read like bias[b, h, q, kv]: checked per call.
        self.direct_reads = sorted({
            (n.base.id, d, i.id) for e in (spec.mask, spec.score) if e is not None for n in X.walk(e)
            if isinstance(n, ir.Index) for d, i in enumerate(n.indices)
            if isinstance(i, ir.Name) and i.id in ("b", "h", "q", "kv")})
        self.computed_reads = intervals.reads(spec)  # indices like t[h + 1]: their range checked per call
        self.computed_reads_ok = Bounded()  # (sizes, int values, dims read) that passed
        self.torch_op = register(self, qualname)
        self.kvcache_implementation = decode.implementation_for(self)  # with_kvcache's (runtime/decode.py)
        self.torch_kvcache = register_kvcache(self, qualname, self.kvcache_implementation)

    def __repr__(self) -> str:
        params = ", ".join(describe_param(p) for p in self.spec.params)
        return (f"<flashgen op {self.name}" + (f" params: {params}" if params else "")
                + (" (dropout)" if self.spec.dropout else "") + ">")

    # ------------------------------------------------------------ call

    with_kvcache = decode.with_kvcache  # decoding with a KV cache (runtime/decode.py)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        deterministic: bool = False,
        dropout_p: float = 0.0,
        dropout_seed: int | None = None,
        block_mask=None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        **params,
    ):
        """Attention of this spec.

        Args:
            q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d] (PyTorch SDPA's layout). One device (cpu or
               cuda), one dtype (fp16, bf16; fp32 on cpu), last dim contiguous, any other
               strides (a transposed view of [B, N, H, d] works without a copy). Hq must be a
               multiple of Hkv (GQA/MQA: query head h reads kv head h // (Hq // Hkv)). d is a
               multiple of 8 up to 256, within the spec's ``head_dim`` line if it has one.
               Packed (varlen) layout, with ``cu_seqlens_q``: q [total_q, Hq, d], k, v
               [total_k, Hkv, d] (rank 3, same rules otherwise).
            scale: softmax scale; default the spec's (1/sqrt(d) unless it sets ``scale``).
            return_lse: also return the log-sum-exp.
            deterministic: make the backward bitwise repeatable (also on when
               ``torch.use_deterministic_algorithms(True)``); the forward always is.
            dropout_p: probability of dropping each attention probability, in [0, 1); only for
               specs that declare ``dropout``. Fused as in FlashAttention: kept probabilities
               are scaled by 1 / (1 - p), the LSE is that of the undropped softmax, and the
               backward regenerates the forward's mask instead of storing it. 0 (the default)
               is no dropout, at no cost. On the families in DROPOUT_BACKENDS.
            dropout_seed: None (default): seed and offset are drawn from torch's default
               generator for q's device (``flashgen.dropout_state``), so each call gets a fresh
               mask and ``torch.manual_seed`` reproduces a run; nothing syncs the host. An int
               in [0, 2^64): that seed, offset 0 (the same mask every call). The mask of element
               (b, h, q, kv) depends only on the seed, the offset and those absolute indices
               (Philox4x32-10, flashgen/philox.py): ``flashgen.reference.attention(..,
               dropout_p=, dropout_seed=, dropout_offset=)`` regenerates it exactly.
            block_mask: a ``flashgen.BlockMask`` (``flashgen.block_mask(op, ...)`` from this
               spec's mask, or ``BlockMask.from_pattern``): the kernels visit only its non-empty
               blocks (the paper's block-sparse FlashAttention); its lists are the authority on
               which blocks are visited, and a pattern combines with the spec's mask (kept iff
               both keep). Shape [batch|1, heads|1, ⌈seqlen_q/block⌉, ⌈seqlen_k/block⌉] on q's
               device (packed layout: batch = number of sequences, max_seqlen_q/k). Built once,
               reused: the kernels' own tile lists are derived on the device at the first call
               per tile size and cached on the mask, so later calls add no work and no host
               synchronisation. A mask from ``flashgen.block_mask`` must be built with the
               parameter values the call passes.
            cu_seqlens_q, cu_seqlens_k: packed (varlen) batches, as flash_attn's varlen
               interface: int32 [batch + 1] tensors on q's device, starting at 0,
               non-decreasing, ending at total_q and total_k; sequence b owns the query rows
               [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and the key rows [cu_seqlens_k[b],
               cu_seqlens_k[b + 1]) (lengths may be 0). Both or neither. Masks and score
               expressions see per-sequence values: q and kv count from the sequence's start,
               seqlen_q and seqlen_k are its lengths, b is its index (so batch-shaped
               parameters and the dropout mask index by sequence). Their values are checked
               before any launch, which reads them on the host (on CUDA, one device-to-host
               copy per forward and per backward call).
            max_seqlen_q, max_seqlen_k: ints, at least every sequence's length and at most
               2^30; None (default): derived from cu_seqlens_q / cu_seqlens_k. Parameter dims
               ``seqlen_q`` / ``seqlen_k`` take these values in the packed layout (e.g.
               ``document_id: i32[batch, seqlen_k]`` is [batch, max_seqlen_k], indexed by the
               per-sequence position). Only with cu_seqlens_q / cu_seqlens_k.
            **params: the spec's parameters by keyword, all required: ints and floats as Python
               numbers (kernel arguments: a new value never recompiles), tensors on q's device
               with the declared dtype (f32 → torch.float32, i32 → int32, i64 → int64, bool)
               and shape (batch = q.shape[0], heads = q.shape[1] (query heads), seqlen_q,
               seqlen_k; a ``dim|1`` may also be 1), any strides. A float tensor that enters
               the score gets a gradient when it requires grad (accumulated with fp32 atomics).

        Returns:
            out [B, Hq, Nq, d] in q's dtype (q's strides when q is dense), or ``(out, lse)``
            with lse fp32 [B, Hq, Nq], natural log. Packed layout: out [total_q, Hq, d], lse
            fp32 [Hq, total_q] (sequence b's rows from cu_seqlens_q[b]). A query row that sees
            no key (also every row of a sequence without keys) gets out 0 and lse -inf.

        Raises:
            TypeError / ValueError: bad arguments, naming the argument, before any launch (also
               dropout_p > 0 for a spec without ``dropout``, and cu_seqlens_q / cu_seqlens_k /
               max_seqlen_q / max_seqlen_k of the wrong type, dtype, shape, device or values).
            NotImplementedError: a feature this version does not have, naming the argument
               (also dropout_p > 0 on a family outside DROPOUT_BACKENDS, and cu_seqlens_q on a
               family outside VARLEN_BACKENDS).
            BuildError: the first-use compile failed (message has compiler output and path).
            KernelError: the kernel reported a failure (e.g. a failed CUDA launch).
        """
        if (not params and not self.spec.params and block_mask is None and cu_seqlens_q is None
                and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None and dropout_p == 0.0
                and dropout_seed is None and deterministic is False and type(return_lse) is bool
                and (scale is None or type(scale) is float) and launch.direct(q, k, v, ())
                and not launch.records_grad(q, k, v, ())):
            # the common eager call, launched from its plan when its metadata ran before
            _, res = self._from_plan(q, k, v, scale, ())
            if res is not None:
                return res if return_lse else res[0]
        # Only translation here: every check of the call runs once, in the registered op's
        # implementation (``_register``), which the torch op and the direct path below share.
        dropout_p = check_dropout_p(dropout_p)
        if dropout_p and not self.spec.dropout:
            raise ValueError(f"dropout_p={dropout_p}: spec '{self.spec.name}' declares no dropout; add a line "
                             "`dropout` to the spec to enable it")
        if dropout_seed is not None:
            dropout_seed = check_dropout_seed(dropout_seed)
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
        for name, t in (("q", q), ("k", k), ("v", v)):  # before the torch op's schema prints the value
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if scale is not None:
            scale = plain_number(scale)  # a NumPy scalar as the float the schema takes
            check_scale_type(scale)
        values = self._param_values(params)
        if self.grad_params:
            refuse_deterministic_param_grads(self, values, deterministic)
        packed = cu_seqlens_q is not None or cu_seqlens_k is not None
        varlen = {}
        if packed or max_seqlen_q is not None or max_seqlen_k is not None:
            varlen = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
                      "max_seqlen_k": max_seqlen_k}
        dropout = ()
        if self.spec.dropout:  # the op's two extra arguments: p and the {seed, offset} tensor
            dropout = (dropout_p, dropout_state(dropout_seed, q.device) if dropout_p else None)
        blocks = {}
        if block_mask is not None:
            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"block_mask: expected a flashgen.BlockMask (flashgen.block_mask or "
                                f"BlockMask.from_pattern), got {type(block_mask).__name__}")
            packed = check_varlen_given(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            self.check_inputs(q, k, v, packed=packed)  # the lists are made for these shapes
            if packed:  # the block grid counts tiles up to the mask's lengths
                max_seqlen_q = block_mask.seqlen_q if max_seqlen_q is None else max_seqlen_q
                max_seqlen_k = block_mask.seqlen_k if max_seqlen_k is None else max_seqlen_k
                check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            sizes = ({"batch": cu_seqlens_q.shape[0] - 1, "heads": q.shape[1], "seqlen_q": max_seqlen_q,
                      "seqlen_k": max_seqlen_k} if packed else None)
            checked = self.check_params(q, k, dict(zip((p.name for p in self.spec.params), values, strict=True)),
                                        sizes)
            grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                   for t in (q, k, v, *values))
            blocks = self.block_args(block_mask, q, k, packed, cu_seqlens_q, max_seqlen_q, max_seqlen_k, grad=grad,
                                     values=checked, cu_seqlens_k=cu_seqlens_k, dropout=bool(dropout_p),
                                     deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
            # the schema's packed-layout arguments come first
            varlen = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                      "max_seqlen_q": max_seqlen_q if packed else None, "max_seqlen_k": max_seqlen_k if packed else None}
        direct = launch.direct(q, k, v, values)
        grad = direct and launch.records_grad(q, k, v, values)
        if direct and not grad and not varlen and not blocks and not dropout_p:  # its metadata ran before
            key, res = self._from_plan(q, k, v, scale, values)
            if res is not None:
                return res if return_lse else res[0]
            out, lse = self.implementation(q, k, v, scale, deterministic, *values, *dropout)
            plan = launch.forward_plan(self, q, k, v, scale, values, out)
            if plan is not None:
                self.plans[key] = plan
            return (out, lse) if return_lse else out
        if direct:  # the schema's optional arguments, in order
            tail = ()
            if varlen or blocks:
                tail = tuple(varlen.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
            if blocks:
                tail += (blocks.get("block_kv"), blocks.get("block_q"), blocks.get("block_dq"), blocks["block_meta"])
            run = self.eager_autograd if grad else self.implementation  # the op's own autograd, or none
            out, lse = run(q, k, v, scale, deterministic, *values, *dropout, *tail)
        else:
            out, lse = self.torch_op(q, k, v, scale, deterministic, *values, *dropout, **varlen, **blocks)
        return (out, lse) if return_lse else out

    def _from_plan(self, q, k, v, scale, values) -> tuple[tuple, tuple | None]:
        """(plan key, (out, lse) launched from the call's plan, or None without one)."""
        key = launch.plan_key(self, q, k, v, scale, values)
        plan = self.plans.get(key)
        return key, (launch.planned_forward(self, plan, q, k, v, values) if plan is not None else None)

    def generation(self) -> int:
        """The generation of family and library choices (``invalidate_libraries`` bumps it)."""
        return _generation[0]

    def scale_for(self, scale: float | None, head_dim: int) -> float:
        """The softmax scale of a call: ``scale`` checked (a finite float within fp32 range), or
        the spec's default at ``head_dim`` (1/sqrt(d) unless the spec sets ``scale``)."""
        if scale is not None:
            check_scale_type(scale)
            if not abs(scale) < FLOAT32_MAX:
                raise ValueError(f"scale: expected a finite float within fp32 range, got {scale!r}")
            return float(scale)
        hit = self._scales.get(head_dim)
        if hit is None:
            try:
                hit = default_scale(self.spec, head_dim)
            except ValueError as e:
                raise ValueError(f"scale: the spec's scale expression fails at head_dim {head_dim}: {e}") from None
            if not (0 < hit < FLOAT32_MAX):
                raise ValueError(f"scale: the spec's scale is {hit!r} at head_dim {head_dim} "
                                 "(expected a positive float within fp32 range)")
            self._scales[head_dim] = hit
        return hit

    def _param_values(self, params: dict) -> list:
        """The spec's parameters from keyword ``params`` in declaration order; TypeError naming an
        unknown or missing one (their values are checked in the op)."""
        spec = self.spec
        if len(params) == len(spec.params):
            try:
                values = [plain_number(params[p.name]) for p in spec.params]
            except KeyError:
                pass
            else:
                check_no_bool_numbers(spec, values)  # the torch op's schema would take a bool as 0 or 1
                return values
        declared = {p.name: p for p in spec.params}
        for name in params:
            if name not in declared:
                hint = did_you_mean(name, declared)
                what = ("declares " + ", ".join(describe_param(p) for p in spec.params)
                        if declared else "declares no parameters")
                raise TypeError(f"unknown parameter '{name}': spec '{spec.name}' {what}"
                                + (f" ({hint})" if hint else ""))
        missing = [p for p in spec.params if p.name not in params]
        raise TypeError(f"missing parameter(s) of spec '{spec.name}': "
                        + ", ".join(describe_param(p) for p in missing))

    def family_for(self, device: torch.device | str = "cpu", dtype=None, head_dim: int = 128, *,
                   layout: str = "padded", sparse: bool = False, dropout: bool = False,
                   family: str | None = None, backward: bool = False, gqa: bool = False,
                   deterministic: bool = False) -> families.Choice:
        """The kernel family a call on ``device`` with ``dtype`` (default the family's first the
        spec allows) and ``head_dim`` runs on, and why (``Choice.why()``): ``family`` or a forced
        one (FLASHGEN_FAMILY, ``flashgen.use_family``), else the first family that serves the
        call (layout 'padded' or 'packed', ``sparse`` block lists, ``dropout`` p > 0); ``backward``:
        its backward pass's (each pass chooses its own), ``gqa`` heads_q != heads_kv, ``deterministic``.

        Raises ValueError for an unknown layout or family, NotImplementedError when the forced
        family, or every family, cannot serve the call (naming what it lacks)."""
        device = as_device(device)
        if layout not in ("padded", "packed"):
            raise ValueError(f"layout: unknown layout {layout!r} (expected 'padded' or 'packed')")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine (a CUDA call's family "
                             "depends on the device's architecture)")
        dt = as_dtype(dtype, "dtype") if dtype is not None else (self.dtypes(device.type) or (ir.DType.BF16,))[0]
        return self.choose_family(device, dt, head_dim, layout == "packed", sparse, dropout, family, backward, gqa=gqa,
                                  deterministic=deterministic)

    def choose_family(self, device: torch.device, dtype: ir.DType, head_dim: int, packed: bool, sparse: bool,
                dropout: bool, family: str | None = None, backward: bool = False,
                decode: bool = False, *, gqa: bool = False, deterministic: bool = False) -> families.Choice:
        """The family of one pass of a call (``backward``: the backward's, which may differ from
        the forward's: it recomputes from q, k, v, out and LSE, which every family defines alike;
        ``decode``: a ``with_kvcache`` call's). A backward's ``gqa`` (heads_q != heads_kv) and
        ``deterministic`` (bitwise-repeatable gradients) are part of its Call (families.Call)."""
        gqa, deterministic = bool(backward and gqa), bool(backward and deterministic)
        key = (device.type, device.index, dtype, head_dim, packed, sparse, dropout, family,
               families.forced_block(), env.library_selection()[0], _generation[0], backward, decode, gqa,
               deterministic, deterministic and env.auto_block_mask())  # sm90's deferral reads the latter
        hit = self._choices.get(key)
        if hit is None:
            arch = artifact.cuda_arch_of(_index(device)) if device.type == "cuda" else None
            feats = frozenset(f for f, on in (("varlen", packed), ("sparse", sparse), ("dropout", dropout),
                                              ("backward", backward), ("decode", decode)) if on)
            hit = families.choose(self.spec, families.Call(device.type, arch, dtype, head_dim, feats, gqa, deterministic),
                                  family)
            self._choices[key] = hit
        return hit

    def block_args(self, block_mask, q, k, packed: bool, *args, **kw) -> dict:
        """The op's block-sparsity arguments for ``block_mask`` (runtime/blocks.py, ``block_args``)."""
        return blocks.block_args(self, block_mask, q, k, packed, *args, **kw)

    def check_dropout(self, q: torch.Tensor, dropout_p: float, state: torch.Tensor | None) -> None:
        """Validate the raw op's dropout arguments (runtime/checks.py)."""
        checks.check_dropout(self, q, dropout_p, state)

    def check_params(self, q: torch.Tensor, k: torch.Tensor, params: dict, sizes: dict | None = None) -> list:
        """The spec's parameters from ``params`` in declaration order, validated against q and k's
        shapes (runtime/checks.py, ``check_params``)."""
        return checks.check_params(self, q, k, params, sizes)

    def params_block(self, values) -> ctypes.Structure | None:
        """The variant's Params struct for ``values`` (runtime/launch.py)."""
        return launch.params_block(self, values)

    def check_inputs(self, q, k, v, *, packed: bool = False) -> None:
        """Validate q, k, v as ``__call__`` documents (runtime/checks.py); raise naming the
        offending argument."""
        checks.check_inputs(self, q, k, v, packed=packed)

    def head_dims(self, family: families.Family | str) -> tuple[int, ...]:
        """Head dims this spec can run on ``family`` (a kernel family, its name, or a device type
        'cpu' / 'cuda' for that device's first family)."""
        fam = families.of(family)
        hit = self._head_dims.get(fam.name) if hasattr(self, "_head_dims") else None
        if hit is None:
            hit = tuple(d for d in fam.head_dims if self.spec.head_dims is None or d in self.spec.head_dims)
        return hit

    def dtypes(self, family: families.Family | str) -> tuple[ir.DType, ...]:
        """The dtypes this spec can run on ``family`` (as ``head_dims`` takes it)."""
        fam = families.of(family)
        hit = self._dtypes.get(fam.name) if hasattr(self, "_dtypes") else None
        return hit if hit is not None else spec_dtypes(self.spec, fam)

    # ------------------------------------------------------------ build

    def instantiation(self, device: torch.device | str, dtype: ir.DType, head_dim: int,
                      packed: bool = False, sparse: bool = False, seqlen: int | None = None, *,
                      family: families.Family | str | None = None) -> artifact.Instantiation:
        """The compiled artifact that serves (device, dtype, head_dim) in the padded layout, or in
        the packed (varlen) layout with ``packed``, on ``family`` (default: the family the call
        would run on). Families with ``split_layouts`` build the layouts apart, so padded calls
        never pay for varlen code; the CPU family takes both at run time. On a tuned family
        (sm80, sm90) its tiles are the family's ``choose_tiles`` for max(seqlen_q, seqlen_k) =
        ``seqlen`` (tuned winners vary with it; None: the longest tuned length): sm80's
        ``flashgen.tiles.choose``, sm90's ``sm90.choose``."""
        device = as_device(device)
        fam = (families.of(family) if family is not None
               else self.choose_family(device, dtype, head_dim, packed, sparse, False).family)
        if fam.device != device.type:
            raise ValueError(f"family: {fam.name} runs on {fam.device}, not {device.type}")
        target = fam.device_target(_index(device) if device.type == "cuda" else None)
        if fam.runtime_head_dim:
            return fam.instantiation(self.spec, target.arch, dtype, None)
        # A tuned family's choice (its defaults, tuned winners, sm80's FLASHGEN_CUDA_*_TILE); any
        # other family fills in its own defaults.
        cfg = None
        if fam.tuned:
            index = _index(device)
            cfg = fam.choose_tiles(self.spec, target.arch, dtype, head_dim, seqlen, sparse=sparse, device_index=index,
                                   fingerprint=self.fingerprint).config()
        return fam.instantiation(self.spec, target.arch, dtype, head_dim, packed=packed, sparse=sparse, tiles=cfg)

    def tiles(self, device: torch.device | str | None = "cuda", dtype=ir.DType.BF16, head_dim: int = 128,
              seqlen: int | None = None, *, arch: str | None = None):
        """The CUDA tiles this op uses, as a flashgen.tiles.Choice (forward, backward and dq tiles
        and where each came from: 'env', 'tuned', 'table', 'derived', 'family default'), each
        pass's of the family that runs it (``fwd_family`` / ``bwd_family``): where the sm90
        family runs the forward (sm_90a, unless another family is forced), ``fwd`` is its tile
        (flashgen.families.sm90.Sm90Tile, origin 'tuned' or 'family default'); the backward's
        and dq tiles are sm80's.

        Args:
            device: a CUDA device (its architecture, shared memory and tuning results); None
                with ``arch``.
            dtype: torch or flashgen dtype (or 'bf16' / 'fp16').
            head_dim: the head dim d; seqlen: max(seqlen_q, seqlen_k) of the call (tuned
                winners depend on it; None: the longest tuned length).
            arch: instead of a device, an architecture such as 'sm_90a' (no GPU needed; tables
                and derived tiles only).

        Raises ValueError naming the argument for a device that is not an available CUDA
        device, a dtype or head dim the spec does not allow on CUDA, or a malformed arch."""
        dt = as_dtype(dtype, "dtype")
        if dt not in self.dtypes("cuda"):
            raise ValueError(f"dtype: {dt.value} is not supported by spec '{self.spec.name}' on cuda (expected one "
                             f"of {', '.join(d.value for d in self.dtypes('cuda')) or 'none'})")
        if head_dim not in self.head_dims("cuda"):
            raise ValueError(f"head_dim: {head_dim} is not supported by spec '{self.spec.name}' on cuda (expected "
                             f"one of {ranges_text(self.head_dims('cuda'))})")
        if arch is not None:
            arch = tiles.normalize_arch(arch)
            choice = tiles.choose(self.spec, arch, dt, head_dim, seqlen, fingerprint=self.fingerprint)
            try:
                fwd_fam = families.choose(self.spec, families.Call("cuda", arch, dt, head_dim)).family
            except NotImplementedError:  # a forced family that has no kernels there: sm80's tiles
                fwd_fam = families.get("sm80")
            return self._with_forward(choice, fwd_fam, arch, dt, head_dim, seqlen, None)
        if device is None:
            raise ValueError("device: None needs arch= (e.g. 'sm_90a'); or pass a CUDA device")
        device = as_device(device)
        if device.type != "cuda":
            raise ValueError(f"device: the tiles are the CUDA kernels' (got '{device}'; the CPU family sizes its "
                             "tiles at run time); pass a CUDA device or arch=")
        if not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine; pass arch= "
                             "(e.g. 'sm_90a') for the tables' and derived tiles")
        index = _index(device)
        arch = artifact.cuda_arch_of(index)
        choice = tiles.choose(self.spec, arch, dt, head_dim, seqlen, device_index=index, fingerprint=self.fingerprint)
        fwd_fam = self.choose_family(torch.device("cuda", index), dt, head_dim, False, False, False).family
        return self._with_forward(choice, fwd_fam, arch, dt, head_dim, seqlen, index)

    def _with_forward(self, choice: tiles.Choice, fam: families.Family, arch: str, dtype: ir.DType, head_dim: int,
                      seqlen: int | None, index: int | None) -> tiles.Choice:
        """``choice`` (sm80's tiles) with the forward of ``fam`` when that family, not sm80, runs
        the forward: its tile, origin and tuned length in place of sm80's forward."""
        if fam.name == "sm80" or not fam.tuned:
            return choice
        own = fam.choose_tiles(self.spec, arch, dtype, head_dim, seqlen, device_index=index,
                               fingerprint=self.fingerprint)
        return replace(choice, fwd=own.tile, fwd_origin=own.origin, fwd_family=fam.name,
                       tuned_seqlen=(own.tuned_seqlen, choice.tuned_seqlen[1]))

    def build(self, device: torch.device | str = "cpu", dtypes: Iterable | None = None,
              head_dims: Iterable[int] | None = None, *, jobs: int | None = None,
              layouts: Iterable[str] = ("padded",), sparse: Iterable[bool] = (False,),
              family: str | None = None, decode: bool = True) -> list[artifact.Instantiation]:
        """Compile (or load from the cache) the instantiations for ``device`` ahead of first use.

        Args:
            device: 'cpu' or a CUDA device.
            dtypes: torch or flashgen dtypes (default: every dtype the spec allows there).
            head_dims: default every allowed head dim among (64, 128); ignored by families whose
                kernels take the head dim at run time (cpu).
            jobs: instantiations compiled at once (default: all of them).
            layouts: "padded" and/or "packed" (varlen batches: cu_seqlens_q, ...); on families
                that build them apart (sm80) each is its own instantiation, built at its first use
                unless built here. Ignored on cpu, whose kernels take both.
            sparse: False and/or True: the dense kernels and/or the block-sparse ones (calls with
                block_mask=), each its own instantiation on sm80. Ignored on cpu.
            family: the kernel family to build for (flashgen/families: 'sm90', 'sm80', 'cpu');
                default the forced one (FLASHGEN_FAMILY, flashgen.use_family), else every family
                a call on ``device`` may run on (families.for_arch_all: on sm_90a the sm90
                forward for what it serves of the request, then sm80). Calls then run on it
                while it is forced, or while it is the first family that serves them.
            decode: also the decode kernels (``with_kvcache``) where they are a library of their own
                (sm80, per dtype and head dim; cpu's decode runs in its forward library).

        Returns the instantiations, now loaded in this process.

        Raises ValueError naming the argument (an unknown family, or one that does not run on
        ``device``; dtypes or head dims the spec does not allow there).
        """
        device = as_device(device)
        if not any(f.device == device.type for f in families.FAMILIES.values()):
            raise ValueError(f"device: '{device.type}' is not supported (expected cpu or cuda)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine")
        index = _index(device) if device.type == "cuda" else None
        arch = artifact.cuda_arch_of(index) if index is not None else None
        if family is not None:
            fam = families.get(family)
            if fam.device != device.type or fam.arch_reason(arch):
                raise ValueError(f"family: {fam.name} does not run on {device}"
                                 + (f" ({fam.arch_reason(arch)})" if fam.device == device.type else
                                    f" (it runs on {fam.device} tensors)"))
        else:
            fams = families.for_arch_all(device.type, arch)
            if len(fams) > 1:  # partial families first (what they serve of the request), then the complete one
                lays = (layouts,) if isinstance(layouts, str) else tuple(layouts)
                sps = (sparse,) if isinstance(sparse, bool) else tuple(sparse)
                insts = []
                for part in fams[:-1]:
                    hd_p = [h for h in (head_dims if head_dims is not None else (64, 128)) if h in self.head_dims(part)]
                    dt_p = [d for d in (dtypes if dtypes is not None else self.dtypes(part))
                            if as_dtype(d) in self.dtypes(part)]
                    lay_p, sp_p = part.served(lays, sps)
                    if hd_p and dt_p and lay_p and sp_p:
                        insts += self.build(device, dt_p, hd_p, jobs=jobs, layouts=lay_p, sparse=sp_p,
                                            family=part.name, decode=False)
                return insts + self.build(device, dtypes, head_dims, jobs=jobs, layouts=layouts, sparse=sparse,
                                          family=fams[-1].name, decode=decode)
            fam = fams[0]
        name = fam.name
        dts = [as_dtype(d) for d in dtypes] if dtypes is not None else list(self.dtypes(fam))
        for dt in dts:
            if dt not in self.dtypes(fam):
                raise ValueError(f"dtypes: {dt.value} is not supported by spec '{self.spec.name}' on {name}")
        if head_dims is not None:
            for hd in head_dims:
                if hd not in self.head_dims(fam):
                    raise ValueError(f"head_dims: {hd} is not supported by spec '{self.spec.name}' on "
                                     f"{name} (expected one of {ranges_text(self.head_dims(fam))})")
        if fam.runtime_head_dim:
            hds: list[int] = [8]
        else:
            hds = list(head_dims) if head_dims is not None else [d for d in (64, 128) if d in self.head_dims(fam)]
        layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
        for lay in layouts:
            if lay not in ("padded", "packed"):
                raise ValueError(f"layouts: unknown layout {lay!r} (expected 'padded' and/or 'packed')")
        packs = sorted({lay == "packed" for lay in layouts}) if fam.split_layouts else [False]
        sparse = (sparse,) if isinstance(sparse, bool) else tuple(sparse)
        if not all(isinstance(x, bool) for x in sparse):
            raise TypeError(f"sparse: expected bools, got {sparse!r}")
        sps = sorted(set(sparse)) if fam.split_layouts else [False]
        if index is not None:  # the default tiles, and those tuned at each stored length
            lens = {dt: {hd: [None, *sorted({n for kind in ("fwd", "bwd")
                                             for n in tune_store.tuned_seqlens(self.fingerprint, index, dt, hd, kind)})]
                         for hd in hds} for dt in dts}
        else:
            lens = {dt: {hd: [None] for hd in hds} for dt in dts}
        todo = {}
        for dt in dts:
            for hd in hds:
                for pk in packs:
                    for sp in sps:
                        for n in lens[dt][hd] if not sp else [None]:
                            todo.setdefault(self.instantiation(device, dt, hd, pk, sp, n, family=fam), []).append(
                                (dt, hd, pk, sp, n))
        dec = {(dt, hd): families.decode_instantiation(self.spec, (fam,), arch, dt, hd)
               for dt in dts for hd in hds if decode and not fam.runtime_head_dim}
        insts = list(todo) + [i for i in dec.values() if i is not None]
        with ThreadPoolExecutor(max_workers=jobs or len(insts) or 1) as pool:
            libs = list(pool.map(lambda i: loader.load(i, announce=announce), insts))
        for inst, lib in zip(insts, libs, strict=True):
            for dt, hd, pk, sp, n in todo.get(inst, ()):
                self._remember(fam, device, dt, hd, pk, sp, n, lib)
        for dt, hd in (k for k, i in dec.items() if i is not None):  # loaded now: recorded under their key
            self.decode_library(fam, device, dt, hd)
        return insts

    def mask_library(self, fam: families.Family, device: torch.device) -> cache.LoadedLibrary:
        """The block classifier of this spec on ``fam`` (a small library of its own, built at first
        use)."""
        key = ("mask", fam.name, device.index)
        lib = self._libs.get(key)
        if lib is None:
            lib = loader.load(fam.classifier(self.spec, fam.device_target(_index(device)).arch), announce=announce)
            with self._libs_lock:
                self._libs[key] = lib
        return lib

    @functools.cached_property
    def auto_sparse(self) -> bool:
        """Whether CUDA calls without a block_mask build block lists per call: the spec's mask
        has no closed-form key range per row (e.g. document ids), so the tiles it rules out are
        found by the classifier instead of being visited."""
        return variant.mask_without_row_range(self.spec)

    def auto_blocks(self, fam: families.Family, kind: str, q, k, values, packed: Packed | None) -> Blocks | None:
        """Block lists classified per call, or None (runtime/blocks.py)."""
        return blocks.auto_blocks(self, fam, kind, q, k, values, packed)

    @functools.cached_property
    def mask_extents(self) -> tuple[bool, bool]:
        return mask_extents(self.spec)

    def _remember(self, fam: families.Family, device, dtype, head_dim, packed: bool, sparse: bool, seqlen,
                  lib: cache.LoadedLibrary) -> None:
        """Record ``lib`` as the library of a call with these keys (``op.build`` and first use)."""
        with self._libs_lock:
            self._libraries[self._library_key(fam, device, dtype, head_dim, packed, sparse, seqlen)] = lib

    def _library_key(self, fam: families.Family, device, dtype, head_dim, packed, sparse, seqlen) -> tuple:
        """Every key that selects a call's library: the family, device, dtype, head dim (None
        where the family takes it at run time), layout, sparsity, the call's max(seqlen_q,
        seqlen_k) where tuned tiles depend on it, the environment that overrides tiles or
        loading, and the tuning store's generation (bumped when results are read anew)."""
        if fam.runtime_head_dim:
            head_dim = None
        if not fam.split_layouts:
            packed = sparse = False
        if sparse or not fam.tuned:
            seqlen = None
        return (fam.name, device.index, dtype, head_dim, packed, sparse, seqlen, env.library_selection(),
                _generation[0])

    def library(self, fam: families.Family, device: torch.device, dtype: ir.DType, head_dim: int,
                 packed: bool = False, sparse: bool = False, seqlen: int | None = None) -> cache.LoadedLibrary:
        """The loaded library for a call on ``fam``, looked up under ``_library_key``; on sm80 with
        the tiles tuned nearest ``seqlen`` (block-sparse calls take the tuned winner of the
        longest length, seqlen None, so that lists made for one call's tiles serve every
        length). A miss chooses the tiles, tunes first with FLASHGEN_AUTOTUNE=1, and loads."""
        key = self._library_key(fam, device, dtype, head_dim, packed, sparse, seqlen)
        lib = self._libraries.get(key)
        if lib is not None:
            return lib
        _, _, _, hd, packed, sparse, seqlen, _, _ = key
        if fam.tuned and first_use_tuner is not None and env.autotune() and env.jit():
            first_use_tuner(self, device, dtype, head_dim, seqlen, family=fam)  # tuning compiles: never with JIT off
            key = self._library_key(fam, device, dtype, head_dim, packed, sparse, seqlen)
        inst = self.instantiation(device, dtype, head_dim, packed, sparse, seqlen, family=fam)
        lib = loader.load(inst, announce=announce)
        with self._libs_lock:
            self._libraries[key] = lib
        return lib

    def decode_library(self, fam: families.Family, device: torch.device, dtype: ir.DType, head_dim: int,
                       seqlen: int | None = None) -> cache.LoadedLibrary:
        """The loaded library of a decode call (``with_kvcache``) on ``fam``: the family's own
        decode instantiation where it has one (sm80: ``decode_instantiation``, entry ``decode``),
        else the forward's library (``library``, tiles for ``seqlen``); ``build(decode=True)`` loads it."""
        key = ("decode", fam.name, device.index, dtype, head_dim, env.library_selection(), _generation[0])
        lib = self._libraries.get(key)
        if lib is not None:
            return lib
        target = fam.device_target(_index(device) if device.type == "cuda" else None)
        inst = fam.decode_instantiation(self.spec, target.arch, dtype, head_dim)
        if inst is None:
            return self.library(fam, device, dtype, head_dim, False, False, seqlen)
        lib = loader.load(inst, announce=announce)
        with self._libs_lock:
            self._libraries[key] = lib
        return lib

    # ------------------------------------------------------------ kernel call

    def launch_fields(self, lib: cache.LoadedLibrary) -> families.LaunchFields:
        """The per-call decisions (argument-block fields) of the family that built ``lib``, for
        this op's spec: one object per family, kept (it caches its decisions)."""
        name = lib.instantiation.target.family
        fields = self._fields.get(name)
        if fields is None:
            fields = self._fields[name] = families.get(name).launch_fields(self.spec)
        return fields

    def launch_forward(self, q, k, v, scale: float, values=(), dropout_p: float = 0.0,
                       dropout_state: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """out and lse of one forward launch of validated inputs (runtime/launch.py; ``lib=``
        runs that loaded library instead of the call's own, as flashgen.tune times candidates)."""
        return launch.launch_forward(self, q, k, v, scale, values, dropout_p, dropout_state, **kw)

    def launch_backward(self, q, k, v, out, lse, dout, dlse, scale: float, deterministic: bool, values=(),
                        need_param_grads=(), dropout_p: float = 0.0, dropout_state: torch.Tensor | None = None, **kw):
        """dq, dk, dv and the parameter gradients of validated inputs by recomputation
        (runtime/launch.py, FlashAttention-2 Alg. 2)."""
        return launch.launch_backward(self, q, k, v, out, lse, dout, dlse, scale, deterministic, values,
                                      need_param_grads, dropout_p, dropout_state, **kw)


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare 'cuda')."""
    return device.index if device.index is not None else torch.cuda.current_device()


def announce(message: str) -> None:
    if not env.quiet():
        print(f"flashgen: {message}", file=sys.stderr, flush=True)

