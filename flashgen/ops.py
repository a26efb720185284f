"""The one home of op registration: ``flashgen.compile(spec)`` → ``AttentionOp``.

Each spec becomes one torch op ``flashgen::<spec>_<hash12>`` (torch.library custom op with a
fake implementation, so torch.compile(fullgraph=True) traces it and dynamic sequence lengths do
not recompile). The real implementation dispatches on the inputs' device to a compiled
instantiation (built lazily on first use, see build.py) and calls its C entry point through
ctypes with an ``FgFwdArgs`` block: on CUDA it launches on the current stream of the inputs'
device with no host synchronisation.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import build, env, families, ir, philox
from . import expr as X
from .abi import FgBlockLists, FgBwdArgs, FgFwdArgs, status_name
from .errors import KernelError, did_you_mean
from .frontend import parse
from .reference import default_scale
from .tune import store as tune_store

TORCH_DTYPE = {ir.DType.FP16: torch.float16, ir.DType.BF16: torch.bfloat16, ir.DType.FP32: torch.float32}
IR_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}

def spec_dtypes(spec: ir.Spec, family: families.Family | str) -> tuple[ir.DType, ...]:
    """The dtypes ``spec`` may run on ``family`` (a Family, its name or a device type): the
    family's, narrowed by the spec's ``dtype`` line."""
    return tuple(d for d in families.of(family).dtypes if spec.dtypes is None or d in spec.dtypes)


# The kernel families (flashgen/families) whose kernels apply dropout; on the others
# dropout_p > 0 raises NotImplementedError naming dropout_p.
DROPOUT_BACKENDS = families.with_feature("dropout")

# The kernel families whose kernels take packed (varlen) batches (cu_seqlens_q, ...); on the
# others the op raises NotImplementedError naming cu_seqlens_q.
VARLEN_BACKENDS = families.with_feature("varlen")

FLOAT32_MAX = 3.4028234663852886e38

# Fill outputs with NaN before each launch, so an element the kernel fails to write shows.
# A testing aid (tests switch it on); off by default because it costs a memory pass.
poison_outputs = False

_registry: dict[str, AttentionOp] = {}
_registry_lock = threading.Lock()

# The tuning store's generation: part of every library key, bumped by ``invalidate_libraries``
# (flashgen.tune calls it when it reads or records results), so a new winner is picked up.
_generation = [0]

# The first-use tuner (FLASHGEN_AUTOTUNE=1): flashgen.tune plugs ``ensure_tuned`` in here, called
# as first_use_tuner(op, device, dtype, head_dim, seqlen) before a library is chosen.
first_use_tuner = None


def invalidate_libraries() -> None:
    """Forget which family and library serve which call: families and tile choices are made
    again at the next call (after a family's declaration or the tuning store changed)."""
    _generation[0] += 1


tune_store.on_reload(invalidate_libraries)  # a new or re-read tuning result: choose libraries again


def compile(spec: str | Path | ir.Spec) -> AttentionOp:  # noqa: A001 - the public name
    """Parse and validate ``spec`` (a path to a ``.attn`` file or spec text) and return its op.

    Nothing is built here: kernels are compiled at the first call for each (device type,
    dtype, head dim), or ahead of time with ``op.build(...)`` / ``flashgen build``.

    Raises:
        SpecError: the spec does not parse or validate (message has file:line:col).
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
        self.name = f"flashgen::{qualname}"
        self._libs: dict[tuple, build.LoadedLibrary] = {}
        self._libs_lock = threading.Lock()
        self._head_dims = {f: self.head_dims(f) for f in families.FAMILIES}
        self._dtypes = {f: self.dtypes(f) for f in families.FAMILIES}
        self._scales: dict[int, float] = {}  # head dim -> the spec's default scale
        self._libraries: dict[tuple, build.LoadedLibrary] = {}  # every key that selects a library
        self._choices: dict[tuple, families.Choice] = {}
        self._checked: set[tuple] = set()  # input metadata check_inputs accepted
        self._impl = None  # the registered forward implementation (set by _register)
        self._params_struct = _params_struct(spec)
        self.grad_params = tuple(p.name for p in X.grad_params(spec))
        # (parameter, dim, position name) for every read like bias[b, h, q, kv]: checked per call.
        self._direct_reads = sorted({
            (n.base.id, d, i.id) for e in (spec.mask, spec.score) if e is not None for n in X.walk(e)
            if isinstance(n, ir.Index) for d, i in enumerate(n.indices)
            if isinstance(i, ir.Name) and i.id in ("b", "h", "q", "kv")})
        self.torch_op = _register(self, qualname)

    def __repr__(self) -> str:
        params = ", ".join(_describe_param(p) for p in self.spec.params)
        return (f"<flashgen op {self.name}" + (f" params: {params}" if params else "")
                + (" (dropout)" if self.spec.dropout else "") + ">")

    # ------------------------------------------------------------ call

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
        # Only translation here: every check of the call runs once, in the registered op's
        # implementation (``_register``), which the torch op and the direct path below share.
        dropout_p = _check_dropout_p(dropout_p)
        if dropout_p and not self.spec.dropout:
            raise ValueError(f"dropout_p={dropout_p}: spec '{self.spec.name}' declares no dropout; add a line "
                             "`dropout` to the spec to enable it")
        if dropout_seed is not None:
            dropout_seed = _check_dropout_seed(dropout_seed)
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
            raise ValueError(f"scale: expected a finite float within fp32 range, got {scale!r}")
        values = self._param_values(params)
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
            from .sparsity import BlockMask

            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"block_mask: expected a flashgen.BlockMask (flashgen.block_mask or "
                                f"BlockMask.from_pattern), got {type(block_mask).__name__}")
            packed = _check_varlen_given(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            self.check_inputs(q, k, v, packed=packed)  # the lists are made for these shapes
            if packed:  # the block grid counts tiles up to the mask's lengths
                max_seqlen_q = block_mask.seqlen_q if max_seqlen_q is None else max_seqlen_q
                max_seqlen_k = block_mask.seqlen_k if max_seqlen_k is None else max_seqlen_k
                _check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            sizes = ({"batch": cu_seqlens_q.shape[0] - 1, "heads": q.shape[1], "seqlen_q": max_seqlen_q,
                      "seqlen_k": max_seqlen_k} if packed else None)
            checked = self.check_params(q, k, dict(zip((p.name for p in self.spec.params), values, strict=True)),
                                        sizes)
            grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                   for t in (q, k, v, *values))
            blocks = self.block_args(block_mask, q, k, packed, cu_seqlens_q, max_seqlen_q, max_seqlen_k, grad=grad,
                                     values=checked, cu_seqlens_k=cu_seqlens_k, dropout=bool(dropout_p))
            # the schema's packed-layout arguments come first
            varlen = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                      "max_seqlen_q": max_seqlen_q if packed else None, "max_seqlen_k": max_seqlen_k if packed else None}
        if _direct(q, k, v, values):  # the schema's optional arguments, in order
            tail = ()
            if varlen or blocks:
                tail = tuple(varlen.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
            if blocks:
                tail += (blocks.get("block_kv"), blocks.get("block_q"), blocks.get("block_dq"), blocks["block_meta"])
            out, lse = self._impl(q, k, v, scale, deterministic, *values, *dropout, *tail)
        else:
            out, lse = self.torch_op(q, k, v, scale, deterministic, *values, *dropout, **varlen, **blocks)
        return (out, lse) if return_lse else out

    def scale_for(self, scale: float | None, head_dim: int) -> float:
        """The softmax scale of a call: ``scale`` checked (a finite float within fp32 range), or
        the spec's default at ``head_dim`` (1/sqrt(d) unless the spec sets ``scale``)."""
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, int | float) or not abs(scale) < FLOAT32_MAX:
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
                return [params[p.name] for p in spec.params]
            except KeyError:
                pass
        declared = {p.name: p for p in spec.params}
        for name in params:
            if name not in declared:
                hint = did_you_mean(name, declared)
                what = ("declares " + ", ".join(_describe_param(p) for p in spec.params)
                        if declared else "declares no parameters")
                raise TypeError(f"unknown parameter '{name}': spec '{spec.name}' {what}"
                                + (f" ({hint})" if hint else ""))
        missing = [p for p in spec.params if p.name not in params]
        raise TypeError(f"missing parameter(s) of spec '{spec.name}': "
                        + ", ".join(_describe_param(p) for p in missing))

    def family_for(self, device: torch.device | str = "cpu", dtype=None, head_dim: int = 128, *,
                   layout: str = "padded", sparse: bool = False, dropout: bool = False,
                   family: str | None = None) -> families.Choice:
        """The kernel family a call on ``device`` with ``dtype`` (default the family's first the
        spec allows) and ``head_dim`` runs on, and why (``Choice.why()``): ``family`` or a forced
        one (FLASHGEN_FAMILY, ``flashgen.use_family``), else the first family that serves the
        call (layout 'padded' or 'packed', ``sparse`` block lists, ``dropout`` p > 0).

        Raises ValueError for an unknown layout or family, NotImplementedError when the forced
        family, or every family, cannot serve the call (naming what it lacks)."""
        device = torch.device(device)
        if layout not in ("padded", "packed"):
            raise ValueError(f"layout: unknown layout {layout!r} (expected 'padded' or 'packed')")
        dt = as_dtype(dtype) if dtype is not None else (self.dtypes(device.type) or (ir.DType.BF16,))[0]
        return self._choose(device, dt, head_dim, layout == "packed", sparse, dropout, family)

    def _choose(self, device: torch.device, dtype: ir.DType, head_dim: int, packed: bool, sparse: bool,
                dropout: bool, family: str | None = None) -> families.Choice:
        key = (device.type, device.index, dtype, head_dim, packed, sparse, dropout, family,
               families.forced(), _generation[0])
        hit = self._choices.get(key)
        if hit is None:
            arch = build.cuda_arch_of(_index(device)) if device.type == "cuda" else None
            feats = frozenset(f for f, on in (("varlen", packed), ("sparse", sparse), ("dropout", dropout)) if on)
            hit = families.choose(self.spec, families.Call(device.type, arch, dtype, head_dim, feats), family)
            self._choices[key] = hit
        return hit

    def block_args(self, block_mask, q, k, packed: bool, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                   grad: bool, values=(), cu_seqlens_k=None, dropout: bool = False) -> dict:
        """The op's block-sparsity arguments for ``block_mask``: its lists for the forward's
        tiles (and, with ``grad``, the backward's), plus their tile sizes. Checks the mask's
        shape and device against the call first, and that a mask made from a spec's mask
        (flashgen.block_mask) was made from this spec with the call's parameters and layout
        (ValueError naming block_mask)."""
        block_mask.check_binding(self.spec, self.fingerprint, values, cu_seqlens_q if packed else None,
                                 cu_seqlens_k if packed else None)
        if packed:
            B, Hq, d = cu_seqlens_q.shape[0] - 1, q.shape[1], q.shape[2]
            Nq = max_seqlen_q if max_seqlen_q is not None else block_mask.seqlen_q
            Nk = max_seqlen_k if max_seqlen_k is not None else block_mask.seqlen_k
            if Nq is None or Nk is None:
                raise ValueError("block_mask: with cu_seqlens_q, pass max_seqlen_q and max_seqlen_k (the block "
                                 "grid counts tiles up to them)")
        else:
            B, Hq, Nq, d = q.shape
            Nk = k.shape[2]
        block_mask.check(B, Hq, Nq, Nk, q.device)
        bq, bk = block_mask.block_size
        dtype = IR_DTYPE[q.dtype]
        fam = self._choose(q.device, dtype, d, packed, True, dropout).family
        lib = self._library(fam, q.device, dtype, d, packed, sparse=True)
        fr, fc, br, bc, dr, dc = fam.block_tiles(dict(lib.instantiation.config), (bq, bk))
        if not block_mask.full_kept and any(x % t for x, t in ((bq, fr), (bk, fc), (bk, br), (bq, bc), (bq, dr),
                                                               (bk, dc))):
            # A kernel tile that straddled a kept and an empty block could not honour the
            # pattern inside it (the element mask is the spec's); tiles must nest in blocks.
            raise ValueError(f"block_mask: a pattern's block size {bq} x {bk} must be a multiple of the {fam.name} "
                             f"kernels' tiles at head_dim {d} (forward {fr} x {fc}, backward {bc} x {br} "
                             f"and {dr} x {dc}, queries x keys); block_size=128 fits every default tile")
        out = {"block_kv": block_mask.tile_lists(fr, fc, Nq, Nk),
               "block_meta": [fr, fc, br, bc, dr, dc, int(block_mask.full_kept)]}
        if grad:
            out["block_q"] = block_mask.tile_lists(br, bc, Nq, Nk, transpose=True)
            if fam.dq_lists:
                out["block_dq"] = block_mask.tile_lists(dr, dc, Nq, Nk)
        return out

    def check_dropout(self, q: torch.Tensor, dropout_p: float, state: torch.Tensor | None) -> None:
        """Validate the op's dropout arguments as the raw op receives them (``__call__`` forms
        them itself); raise naming the argument."""
        dropout_p = _check_dropout_p(dropout_p)
        if not dropout_p:
            return
        if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or state.shape != (2,) \
                or state.device != q.device:
            raise ValueError(f"dropout_state: expected an int64 tensor of shape (2,) (seed, offset) on {q.device}, "
                             f"got {_describe_tensor(state)}")

    def check_params(self, q: torch.Tensor, k: torch.Tensor, params: dict, sizes: dict | None = None) -> list:
        """The spec's parameters from ``params`` in declaration order, validated against q and k's
        shapes; raises TypeError / ValueError naming the parameter. ``sizes``: the dims batch,
        heads, seqlen_q and seqlen_k (default: q and k's padded shapes; packed layout: the number
        of sequences, Hq, max_seqlen_q and max_seqlen_k, None where not known yet, which skips
        the checks that need it)."""
        declared = {p.name: p for p in self.spec.params}
        for name in params:
            if name not in declared:
                from .errors import did_you_mean

                hint = did_you_mean(name, declared)
                what = ("declares " + ", ".join(_describe_param(p) for p in self.spec.params)
                        if declared else "declares no parameters")
                raise TypeError(f"unknown parameter '{name}': spec '{self.spec.name}' {what}"
                                + (f" ({hint})" if hint else ""))
        missing = [p for p in self.spec.params if p.name not in params]
        if missing:
            raise TypeError(f"missing parameter(s) of spec '{self.spec.name}': "
                            + ", ".join(_describe_param(p) for p in missing))
        ints = dict(sizes) if sizes is not None else \
            {"batch": q.shape[0], "heads": q.shape[1], "seqlen_q": q.shape[2], "seqlen_k": k.shape[2]}
        out = []
        for p in self.spec.params:
            value = params[p.name]
            if p.kind == "int":
                if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
                    raise TypeError(f"{p.name}: expected an int, got {type(value).__name__}")
                if not -(2**62) <= value < 2**62:
                    raise ValueError(f"{p.name}: {value} is out of range (|value| < 2^62)")
                ints[p.name] = value
            elif p.kind == "float":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"{p.name}: expected a float, got {type(value).__name__}")
                if not abs(value) < FLOAT32_MAX:
                    raise ValueError(f"{p.name}: expected a finite float within fp32 range, got {value!r}")
                value = float(value)
            else:
                want = PARAM_TORCH_DTYPE[p.dtype]
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{p.name}: expected a torch.Tensor ({_describe_param(p)}), "
                                    f"got {type(value).__name__}")
                if value.dtype != want:
                    raise ValueError(f"{p.name}: dtype {value.dtype}, expected {want} ({_describe_param(p)})")
                if value.device != q.device:
                    raise ValueError(f"{p.name}: on {value.device} but q is on {q.device}")
                if value.dim() != len(p.shape):
                    raise ValueError(f"{p.name}: expected {len(p.shape)} dims {_shape_text(p)}, "
                                     f"got shape {tuple(value.shape)}")
                for d, dim in enumerate(p.shape):
                    size = eval_dim(dim.size, ints)
                    if size is None:  # a max_seqlen still to be derived from cu_seqlens
                        continue
                    if size < 1:
                        hint = ("; in a packed batch whose sequences are all empty, pass max_seqlen_q / "
                                "max_seqlen_k >= 1" if sizes is not None else "")
                        raise ValueError(f"{p.name}: dim {d} = {dim_text(dim.size)} is {size} for these inputs "
                                         f"and parameters (must be at least 1{hint})")
                    got = value.shape[d]
                    if got != size and not (dim.broadcast and got == 1):
                        alt = " or 1" if dim.broadcast else ""
                        raise ValueError(f"{p.name}: dim {d} has size {got}, expected {size}{alt} "
                                         f"({_shape_text(p)} = {_shape_values(p, ints)} for these inputs)")
            out.append(value)
        reach = {"b": ints["batch"], "h": ints["heads"], "q": ints["seqlen_q"], "kv": ints["seqlen_k"]}
        for name, d, pos in self._direct_reads:
            p, t = declared[name], params[name]
            if reach[pos] is None:
                continue
            if t.shape[d] < reach[pos] and not (p.shape[d].broadcast and t.shape[d] == 1):
                raise ValueError(f"{name}: dim {d} has size {t.shape[d]} but the spec reads it at {pos} up to "
                                 f"{reach[pos] - 1} for these inputs")
        return out

    def params_block(self, values) -> ctypes.Structure | None:
        """The variant's Params struct for ``values`` (spec order), gradient pointers null; None
        when the spec has no parameters."""
        if not self.spec.params:
            return None
        block = self._params_struct()
        for p, value in zip(self.spec.params, values, strict=True):
            if not p.is_tensor:
                setattr(block, p.name, value)
                continue
            setattr(block, p.name, value.data_ptr() if value.numel() else None)
            getattr(block, p.name + "_size")[:] = list(value.shape)
            getattr(block, p.name + "_stride")[:] = list(value.stride())
        return block

    def check_inputs(self, q, k, v, *, packed: bool = False) -> None:
        """Validate q, k, v as ``__call__`` documents; raise naming the offending argument.
        ``packed``: the varlen layout (q [total_q, Hq, d], k and v [total_k, Hkv, d]). Inputs
        whose metadata (dtype, device, shape, strides) passed once pass again without the checks."""
        try:
            key = (packed, q.dtype, q.device, q.shape, q.stride(), k.dtype, k.device, k.shape, k.stride(),
                   v.dtype, v.device, v.shape, v.stride())
        except (AttributeError, TypeError):
            key = None
        if key is not None and key in self._checked:
            return
        self._check_inputs(q, k, v, packed)
        if key is not None:
            if len(self._checked) > 4096:
                self._checked.clear()
            self._checked.add(key)

    def _check_inputs(self, q, k, v, packed: bool) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        for name, t, what in (("q", q, "seqlen_q"), ("k", k, "seqlen_k"), ("v", v, "seqlen_k")):
            heads = "heads" if name == "q" else "kv_heads"
            if packed and t.dim() != 3:
                total = "total_q" if name == "q" else "total_k"
                raise ValueError(f"{name}: expected 3 dims [{total}, {heads}, head_dim] with cu_seqlens_q "
                                 f"(packed layout), got shape {tuple(t.shape)}")
            if not packed and t.dim() != 4:
                hint = " (or 3 dims with cu_seqlens_q and cu_seqlens_k: packed layout)" if t.dim() == 3 else ""
                raise ValueError(f"{name}: expected 4 dims [batch, {heads}, {what}, head_dim], "
                                 f"got shape {tuple(t.shape)}{hint}")
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise ValueError(f"{name}: on {t.device} but q is on {q.device}; q, k, v must share a device")
        backend = q.device.type
        if not any(f.device == backend for f in families.FAMILIES.values()):
            raise ValueError(f"q: device type '{backend}' is not supported (expected cpu or cuda)")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype:
                raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        allowed = spec_dtypes(self.spec, backend)
        if q.dtype not in IR_DTYPE or IR_DTYPE[q.dtype] not in allowed:
            names = ", ".join(str(TORCH_DTYPE[d]).removeprefix("torch.") for d in allowed) or "none"
            raise ValueError(f"q: dtype {q.dtype} is not supported by spec '{self.spec.name}' on {backend} "
                             f"(expected one of: {names})")
        Hq, d = q.shape[-3 if not packed else 1], q.shape[-1]
        Hkv = k.shape[-3 if not packed else 1]
        if not packed and k.shape[0] != q.shape[0]:
            raise ValueError(f"k: batch {k.shape[0]} differs from q's {q.shape[0]}")
        if v.shape != k.shape:
            raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
        if k.shape[-1] != d:
            raise ValueError(f"k: head_dim {k.shape[-1]} differs from q's {d}")
        if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv):
            raise ValueError(f"k: {Hkv} kv heads do not divide {Hq} query heads "
                             "(GQA/MQA need heads_q to be a multiple of heads_kv)")
        dims = self.head_dims(backend)
        if d not in dims:
            raise ValueError(f"q: head_dim {d} is not supported by spec '{self.spec.name}' on {backend} "
                             f"(expected one of {ranges_text(dims)})")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
        if not packed:  # packed: the per-sequence lengths are bounded through max_seqlen_q / _k
            for name, n in (("q", q.shape[2]), ("k", k.shape[2])):
                if n > X.MAX_SEQLEN:
                    raise ValueError(f"{name}: sequence length {n} exceeds the kernels' limit of 2^30 = "
                                     f"{X.MAX_SEQLEN} (positions are 32-bit)")

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
                      family: families.Family | str | None = None) -> build.Instantiation:
        """The compiled artifact that serves (device, dtype, head_dim) in the padded layout, or in
        the packed (varlen) layout with ``packed``, on ``family`` (default: the family the call
        would run on). Families with ``split_layouts`` build the layouts apart, so padded calls
        never pay for varlen code; the CPU family takes both at run time. On sm80 its tiles are
        ``flashgen.tiles.choose``'s for max(seqlen_q, seqlen_k) = ``seqlen`` (tuned winners vary
        with it; None: the longest tuned length)."""
        device = torch.device(device)
        fam = (families.of(family) if family is not None
               else self._choose(device, dtype, head_dim, packed, sparse, False).family)
        if fam.device != device.type:
            raise ValueError(f"family: {fam.name} runs on {fam.device}, not {device.type}")
        target = fam.device_target(_index(device) if device.type == "cuda" else None)
        if fam.runtime_head_dim:
            return fam.instantiation(self.spec, target.arch, dtype, None)
        return fam.instantiation(self.spec, target.arch, dtype, head_dim, packed=packed, sparse=sparse,
                                 tiles=self.tiles(device, dtype, head_dim, seqlen).config())

    def tiles(self, device: torch.device | str | None = "cuda", dtype=ir.DType.BF16, head_dim: int = 128,
              seqlen: int | None = None, *, arch: str | None = None):
        """The CUDA tiles this op uses, as a flashgen.tiles.Choice (forward, backward and dq tiles
        and where each came from: 'env', 'tuned', 'table', 'derived').

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
        from . import tiles

        dt = as_dtype(dtype)
        if dt not in self.dtypes("cuda"):
            raise ValueError(f"dtype: {dt.value} is not supported by spec '{self.spec.name}' on cuda (expected one "
                             f"of {', '.join(d.value for d in self.dtypes('cuda')) or 'none'})")
        if head_dim not in self.head_dims("cuda"):
            raise ValueError(f"head_dim: {head_dim} is not supported by spec '{self.spec.name}' on cuda (expected "
                             f"one of {ranges_text(self.head_dims('cuda'))})")
        if arch is not None:
            return tiles.choose(self.spec, tiles.normalize_arch(arch), dt, head_dim, seqlen,
                                fingerprint=self.fingerprint)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device: the tiles are the CUDA kernels' (got '{device}'; the CPU family sizes its "
                             "tiles at run time); pass a CUDA device or arch=")
        if not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine; pass arch= "
                             "(e.g. 'sm_90a') for the tables' and derived tiles")
        index = _index(device)
        return tiles.choose(self.spec, build.cuda_arch_of(index), dt, head_dim, seqlen, device_index=index,
                            fingerprint=self.fingerprint)

    def build(self, device: torch.device | str = "cpu", dtypes: Iterable | None = None,
              head_dims: Iterable[int] | None = None, *, jobs: int | None = None,
              layouts: Iterable[str] = ("padded",), sparse: Iterable[bool] = (False,),
              family: str | None = None) -> list[build.Instantiation]:
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
            family: the kernel family to build for (flashgen/families: 'sm80', 'cpu'); default
                the forced one (FLASHGEN_FAMILY, flashgen.use_family), else the first family
                that runs on ``device``. Calls then run on it while it is forced, or while it
                is the first family that serves them.

        Returns the instantiations, now loaded in this process.

        Raises ValueError naming the argument (an unknown family, or one that does not run on
        ``device``; dtypes or head dims the spec does not allow there).
        """
        device = torch.device(device)
        if not any(f.device == device.type for f in families.FAMILIES.values()):
            raise ValueError(f"device: '{device.type}' is not supported (expected cpu or cuda)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine")
        index = _index(device) if device.type == "cuda" else None
        arch = build.cuda_arch_of(index) if index is not None else None
        if family is not None:
            fam = families.get(family)
            if fam.device != device.type or fam.arch_reason(arch):
                raise ValueError(f"family: {fam.name} does not run on {device}"
                                 + (f" ({fam.arch_reason(arch)})" if fam.device == device.type else
                                    f" (it runs on {fam.device} tensors)"))
        else:
            fam = families.for_arch(device.type, arch)
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
                                             for n in tune_store.tuned_seqlens(self.fingerprint, index, dt, hd,
                                                                               kind)})]
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
        insts = list(todo)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs or len(insts) or 1) as pool:
            libs = list(pool.map(lambda i: build.load(i, announce=announce), insts))
        for inst, lib in zip(insts, libs, strict=True):
            for dt, hd, pk, sp, n in todo[inst]:
                self._remember(fam, device, dt, hd, pk, sp, n, lib)
        return insts

    def mask_library(self, fam: families.Family, device: torch.device) -> build.LoadedLibrary:
        """The block classifier of this spec on ``fam`` (a small library of its own, built at first
        use)."""
        key = ("mask", fam.name, device.index)
        lib = self._libs.get(key)
        if lib is None:
            lib = build.load(fam.classifier(self.spec, fam.device_target(_index(device)).arch), announce=announce)
            with self._libs_lock:
                self._libs[key] = lib
        return lib

    @functools.cached_property
    def auto_sparse(self) -> bool:
        """Whether CUDA calls without a block_mask build block lists per call: the spec's mask
        has no closed-form key range per row (e.g. document ids), so the tiles it rules out are
        found by the classifier instead of being visited."""
        from . import codegen

        return self.spec.mask is not None and not codegen.hook_bodies(self.spec)["row_exact"]

    def auto_blocks(self, fam: families.Family, kind: str, q, k, values, packed: Packed | None) -> Blocks | None:
        """Block lists for a call without a block_mask on a family with a block classifier, at
        the kernels' own tiles (``kind`` 'fwd' or 'bwd'), or None when not used (see
        ``auto_sparse``)."""
        if not fam.block_classifier or not self.auto_sparse or not env.auto_block_mask():
            return None
        from .sparsity import lists_of, classify_cuda

        B, Hq, _, Nq, Nk, d = _dims(q, k, packed)
        if Nq == 0 or Nk == 0:
            return None
        lib = self._library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, sparse=True)
        fr, fc, br, bc, dr, dc = fam.block_tiles(dict(lib.instantiation.config), (0, 0))
        per_b, per_h = self._mask_extents
        block = self.params_block(values)
        cu = {}
        if packed is not None:
            per_b = True
            cu = {"cu_seqlens_q": packed.cu_seqlens_q, "cu_seqlens_k": packed.cu_seqlens_k}
        ext = (B if per_b else 1, Hq if per_h else 1)
        from .sparsity import mask_has_float

        meta = (fr, fc, br, bc, dr, dc, 0 if mask_has_float(self.spec) else 1)  # as flashgen.block_mask
        mask_lib = self.mask_library(fam, q.device)
        if kind == "fwd":
            return Blocks(lists_of(classify_cuda(self, mask_lib, block, *ext, Nq, Nk, fr, fc, q.device, **cu)), None,
                          None, meta)
        qst = classify_cuda(self, mask_lib, block, *ext, Nq, Nk, bc, br, q.device, **cu).transpose(-1, -2)
        dq = classify_cuda(self, mask_lib, block, *ext, Nq, Nk, dr, dc, q.device, **cu)
        return Blocks(None, lists_of(qst), lists_of(dq), meta)

    @functools.cached_property
    def _mask_extents(self) -> tuple[bool, bool]:
        from .sparsity import mask_extents

        return mask_extents(self.spec)

    def _remember(self, fam: families.Family, device, dtype, head_dim, packed: bool, sparse: bool, seqlen,
                  lib: build.LoadedLibrary) -> None:
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

    def _library(self, fam: families.Family, device: torch.device, dtype: ir.DType, head_dim: int,
                 packed: bool = False, sparse: bool = False, seqlen: int | None = None) -> build.LoadedLibrary:
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
            first_use_tuner(self, device, dtype, head_dim, seqlen)  # tuning compiles: never with JIT off
            key = self._library_key(fam, device, dtype, head_dim, packed, sparse, seqlen)
        inst = self.instantiation(device, dtype, head_dim, packed, sparse, seqlen, family=fam)
        lib = build.load(inst, announce=announce)
        with self._libs_lock:
            if len(self._libraries) > 4096:
                self._libraries.clear()
            self._libraries[key] = lib
        return lib

    # ------------------------------------------------------------ kernel call

    def launch_forward(self, q, k, v, scale: float, values=(), dropout_p: float = 0.0,
                 dropout_state: torch.Tensor | None = None, *,
                 packed: Packed | None = None, blocks: Blocks | None = None,
                 lib: build.LoadedLibrary | None = None,
                 family: families.Family | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """out and lse of one forward launch. ``lib``: run this loaded library instead of the
        call's own (flashgen.tune times candidate tiles this way)."""
        B, Hq, Hkv, Nq, Nk, d = _dims(q, k, packed)
        fill = float("nan") if poison_outputs else None
        # q's strides when q is dense (a transposed view stays one), else contiguous; as the fake.
        out = torch.empty_like(q) if fill is None else torch.full_like(q, fill)
        lse = q.new_empty(_row_shape(B, Hq, Nq, packed, "q"), dtype=torch.float32)
        if fill is not None:
            lse.fill_(fill)
        if out.numel() == 0:
            return out, lse
        if q.is_cuda:
            q, k, v = _aligned(q), _aligned(k), _aligned(v)
        if lib is None:
            fam = family or self._choose(q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                         bool(dropout_p)).family
            lib = self._library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                max(Nq, Nk))
        block = self.params_block(values)
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
        check_status(lib, "fwd", _launch(lib.fwd, args, q))
        return out, lse

    def launch_backward(self, q, k, v, out, lse, dout, dlse, scale: float, deterministic: bool, values=(),
                  need_param_grads=(), dropout_p: float = 0.0, dropout_state: torch.Tensor | None = None, *,
                  packed: Packed | None = None, blocks: Blocks | None = None, lib: build.LoadedLibrary | None = None,
                  family: families.Family | None = None):
        """dq, dk, dv by recomputation (FlashAttention-2 Alg. 2) from the saved out and lse, and
        the gradients of the float tensor parameters in ``self.grad_params`` (an empty tensor
        for those not in ``need_param_grads``). With dropout, the forward's ``dropout_p`` and
        ``dropout_state``: the kernel regenerates its mask (FlashAttention, Alg. 4). ``packed``:
        the validated varlen layout (None: padded). ``lib``: run this loaded library instead of
        the call's own (flashgen.tune times candidate tiles this way)."""
        B, Hq, Hkv, Nq, Nk, d = _dims(q, k, packed)
        fill = float("nan") if poison_outputs else None
        # Like the inputs' layout when dense, else contiguous (empty_like's rule; the fake's too).
        dq, dk, dv = (torch.empty_like(t) if fill is None else torch.full_like(t, fill) for t in (q, k, v))
        block = self.params_block(values)
        by_name = {p.name: val for p, val in zip(self.spec.params, values, strict=True)}
        pgrads = []
        for name, need in zip(self.grad_params, need_param_grads or [False] * len(self.grad_params), strict=True):
            if need:
                g = torch.zeros(by_name[name].shape, dtype=torch.float32, device=q.device)
                setattr(block, name + "_grad", g.data_ptr() if g.numel() else None)
            else:
                g = torch.empty(0, dtype=torch.float32, device=q.device)
            pgrads.append(g)
        if dq.numel() + dk.numel() == 0:
            return dq, dk, dv, pgrads
        # dout: a view (transpose, slice) is fine; broadcast (stride 0) or odd strides are copied.
        dout = _dense_rows(dout)
        if q.device.type == "cuda":
            q, k, v, out, dout = (_aligned(t) for t in (q, k, v, out, dout))
        f32 = {"dtype": torch.float32, "device": q.device}
        rows_q, rows_k = _row_shape(B, Hq, Nq, packed, "q"), _row_shape(B, Hkv, Nk, packed, "k")
        dq_accum = torch.zeros((*rows_q, d), **f32)
        softmax_d = torch.empty(rows_q, **f32)
        gqa = Hq != Hkv
        dk_accum = torch.zeros((*rows_k, d), **f32) if gqa else None
        dv_accum = torch.zeros((*rows_k, d), **f32) if gqa else None
        dlse = dlse.float().contiguous() if dlse is not None else None
        if lib is None:
            fam = family or self._choose(q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                         bool(dropout_p)).family
            lib = self._library(fam, q.device, IR_DTYPE[q.dtype], d, packed is not None, blocks is not None,
                                max(Nq, Nk))
        if lib.bwd is None:
            raise NotImplementedError(f"{self.name}: the backward pass is not implemented in this version "
                                      "(forward only); call the op under torch.no_grad() or on inputs "
                                      "that do not require grad")
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        args = FgBwdArgs(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            dq_accum.data_ptr(), softmax_d.data_ptr(), ptr(dk_accum), ptr(dv_accum),
            B, Hq, Hkv, Nq, Nk, d,
            *(x for t in (q, k, v, out, dout, dq, dk, dv) for x in _strides(t, packed)),
            scale, 0, int(deterministic), None, ctypes.addressof(block) if block is not None else None,
            ptr(dlse),
        )  # fmt: skip
        _set_dropout(args, dropout_p, dropout_state)
        _set_varlen(args, packed)
        if blocks is not None:
            args.q_blocks, args.kv_blocks = blocks.bwd()
        check_status(lib, "bwd", _launch(lib.bwd, args, q))
        return dq, dk, dv, pgrads


@dataclass(frozen=True)
class Packed:
    """A validated packed (varlen) batch: the contiguous int32 cu_seqlens tensors (on the inputs'
    device), the number of sequences, the resolved max_seqlen_q / max_seqlen_k and the token
    counts total_q / total_k."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int

    def sizes(self, heads: int) -> dict:
        """The parameter dims (batch, heads, seqlen_q, seqlen_k) of this layout."""
        return {"batch": self.batch, "heads": heads, "seqlen_q": self.max_seqlen_q, "seqlen_k": self.max_seqlen_k}


@dataclass(frozen=True)
class Blocks:
    """A call's validated block lists (flashgen/sparsity.py, args.h's FgBlockLists): ``kv`` for
    the forward's tiles, ``q`` (transposed) for the backward's key-major pass, ``dq`` for CUDA's
    deterministic dq kernel; ``meta`` = [fwd rows, fwd cols, bwd rows, bwd cols, dq rows, dq
    cols (tile sizes in elements), full_kept]."""

    kv: torch.Tensor | None
    q: torch.Tensor | None
    dq: torch.Tensor | None
    meta: tuple[int, ...]

    @staticmethod
    def lists(t: torch.Tensor | None, block_r: int, block_c: int, full_kept: int) -> FgBlockLists:
        if t is None:
            return FgBlockLists()
        return FgBlockLists(t.data_ptr(), t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0,
                            t.shape[2], t.shape[3] - 2, block_r, block_c, full_kept)

    def fwd(self) -> FgBlockLists:
        return self.lists(self.kv, self.meta[0], self.meta[1], self.meta[6])

    def bwd(self) -> tuple[FgBlockLists, FgBlockLists]:
        return (self.lists(self.q, self.meta[2], self.meta[3], self.meta[6]),
                self.lists(self.dq, self.meta[4], self.meta[5], self.meta[6]))


def check_blocks(kind: str, block_kv, block_q, block_dq, block_meta, B: int, H: int, Nq: int, Nk: int,
                 device: torch.device, sparse_cuda: bool) -> Blocks | None:
    """Validate the raw op's block-sparsity arguments (None when block_meta is empty); raises
    ValueError naming the argument. ``kind``: 'fwd' or 'bwd' (which lists the pass reads)."""
    if not block_meta:
        for name, t in (("block_kv", block_kv), ("block_q", block_q), ("block_dq", block_dq)):
            if t is not None:
                raise ValueError(f"{name}: given without block_meta")
        return None
    meta = tuple(int(x) for x in block_meta)
    if len(meta) != 7 or min(meta[:6]) < 8 or meta[6] not in (0, 1):
        raise ValueError(f"block_meta: expected 6 tile sizes >= 8 and full_kept in {{0, 1}}, got {list(block_meta)}")
    need = [("block_kv", block_kv, meta[0], meta[1], Nq, Nk)] if kind == "fwd" else \
        [("block_q", block_q, meta[2], meta[3], Nk, Nq)] + \
        ([("block_dq", block_dq, meta[4], meta[5], Nq, Nk)] if sparse_cuda else [])
    for name, t, br, bc, nr, nc in need:
        want = (-(-nr // br), -(-nc // bc) + 2)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 4 or t.device != device \
                or tuple(t.shape[2:]) != want or t.shape[0] not in (1, B) or t.shape[1] not in (1, H) \
                or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous int32 tensor [{B}|1, {H}|1, {want[0]}, {want[1]}] on "
                             f"{device} (the block lists for {br} x {bc} tiles), got {_describe_tensor(t)}")
    return Blocks(block_kv, block_q, block_dq, meta)


def _direct(q, k, v, values) -> bool:
    """Whether an eager call may run the op's implementation without the dispatcher: plain
    tensors, no gradient to record, nothing tracing or intercepting ops (torch.compile, a
    dispatch or torch-function mode, functorch transforms, the profiler). The implementation is
    the registered op's own, with its one validation; this only skips torch.library's
    dispatch, autograd wrapper and schema parsing (tens of microseconds a call)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in values)):
        return False
    return not (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()
                or torch.autograd.profiler._is_profiler_enabled
                or any(isinstance(t, torch.Tensor) and type(t) is not torch.Tensor for t in values))


def _check_varlen_given(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """True for the packed layout; raises naming the argument when it comes incomplete."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name}: given without cu_seqlens_q and cu_seqlens_k (it belongs to the packed "
                                 "(varlen) layout)")
        return False
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: required with cu_seqlens_k (the packed layout takes both)")
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k: required with cu_seqlens_q (the packed layout takes both)")
    return True


def _check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Type, dtype, shape and device of the packed layout's metadata; reads no value (so it
    traces under torch.compile)."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 tensor [batch + 1], got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: dtype {t.dtype}, expected torch.int32")
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{name}: expected 1 dim [batch + 1] with at least 2 entries, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has "
                         f"{cu_seqlens_q.shape[0]} (both are [batch + 1])")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral | torch.SymInt):
            raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}")
        if not 0 <= value <= X.MAX_SEQLEN:
            raise ValueError(f"{name}: {value} is out of range (expected 0 <= {name} <= 2^30 = {X.MAX_SEQLEN}: "
                             "positions are 32-bit in the kernels)")


def packed_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None) -> Packed:
    """Validate the packed layout's metadata against q [total_q, Hq, d] and k [total_k, Hkv, d]
    and resolve max_seqlen_q / max_seqlen_k (None: the longest sequence); raises TypeError /
    ValueError naming the argument. Reads the cu_seqlens values on the host: one device-to-host
    copy when they live on a GPU."""
    _check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    n = cu_seqlens_q.shape[0]
    host = torch.cat([cu_seqlens_q, cu_seqlens_k]).to("cpu", torch.int64)  # the one copy
    out = {}
    for name, cu, total, what, mname, given in (
            ("cu_seqlens_q", host[:n], q.shape[0], "total_q = q.shape[0]", "max_seqlen_q", max_seqlen_q),
            ("cu_seqlens_k", host[n:], k.shape[0], "total_k = k.shape[0]", "max_seqlen_k", max_seqlen_k)):
        if int(cu[0]) != 0:
            raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths < 0).any()):
            i = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"{name}: must be non-decreasing, but entry {i + 1} ({int(cu[i + 1])}) < entry {i} "
                             f"({int(cu[i])})")
        if int(cu[-1]) != total:
            raise ValueError(f"{name}: last entry {int(cu[-1])} differs from {what} ({total})")
        longest = int(lengths.max())
        if given is None:
            if longest > X.MAX_SEQLEN:
                raise ValueError(f"{name}: sequence {int(lengths.argmax())} has length {longest}, beyond the "
                                 f"kernels' limit of 2^30 = {X.MAX_SEQLEN} (positions are 32-bit)")
            given = longest
        elif given < longest:
            raise ValueError(f"{mname}: {given} is less than the longest sequence in {name} "
                             f"({longest}, sequence {int(lengths.argmax())})")
        out[mname] = int(given)
    return Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), n - 1, out["max_seqlen_q"],
                  out["max_seqlen_k"], q.shape[0], k.shape[0])


def _dims(q: torch.Tensor, k: torch.Tensor, packed: Packed | None) -> tuple[int, ...]:
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim) as the ABI takes them."""
    if packed is None:
        B, Hq, Nq, d = q.shape
        return B, Hq, k.shape[1], Nq, k.shape[2], d
    return packed.batch, q.shape[1], k.shape[1], packed.max_seqlen_q, packed.max_seqlen_k, q.shape[2]


def _row_shape(B: int, H: int, N: int, packed: Packed | None, side: str) -> tuple[int, ...]:
    """The shape of an fp32 per-row buffer (lse, softmax_d, ...): [B, H, N], packed [H, total]."""
    if packed is None:
        return (B, H, N)
    return (H, packed.total_q if side == "q" else packed.total_k)


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
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dropout_seed is None:
        return torch.randint(0, 2**63 - 1, (2,), dtype=torch.int64, device=device)
    dropout_seed = _check_dropout_seed(dropout_seed)
    state = torch.zeros(2, dtype=torch.int64, device=device)
    state[0] = dropout_seed - 2**64 if dropout_seed >= 2**63 else dropout_seed  # an int64 fill: no host copy
    return state


def _check_dropout_p(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | torch.SymFloat):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {value!r}")
    return float(value) if isinstance(value, int | float) else value


def _check_dropout_seed(value):
    """The seed as an int (numpy and other integral types accepted; bool and floats are not)."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"dropout_seed: expected None or an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < 2**64:
        raise ValueError(f"dropout_seed: {value} is out of range (expected 0 <= dropout_seed < 2^64)")
    return value


def _describe_tensor(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _set_dropout(args, dropout_p: float, state: torch.Tensor | None) -> None:
    """Fill the ABI's dropout fields (null state: no dropout); threshold as flashgen/philox.py."""
    if dropout_p and state is not None:
        args.dropout_state = state.data_ptr()
        args.dropout_threshold = philox.threshold(dropout_p)
        args.dropout_scale = 1.0 / (1.0 - dropout_p)


def check_status(lib: build.LoadedLibrary, kind: str, status: int) -> None:
    if status:
        detail = lib.error(kind)
        # the artifact's folder name (inst.name), read from its path: no cache key is computed
        raise KernelError(f"{lib.path.parent.name}: {kind} kernel failed with {status_name(status)}"
                          + (f": {detail}" if detail else ""))


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t if its last dim is contiguous and no other dim is broadcast (stride 0), else a copy."""
    if t.stride(-1) == 1 and all(st != 0 or n == 1 for st, n in zip(t.stride()[:-1], t.shape[:-1], strict=True)):
        return t
    return t.contiguous()


def as_dtype(d) -> ir.DType:
    """An ir.DType from a flashgen, torch or spelled ('bf16', 'float16', ...) dtype."""
    from .frontend import DTYPE_NAMES

    if isinstance(d, ir.DType):
        return d
    if isinstance(d, torch.dtype) and d in IR_DTYPE:
        return IR_DTYPE[d]
    if isinstance(d, str) and d in DTYPE_NAMES:
        return DTYPE_NAMES[d]
    raise ValueError(f"dtypes: unknown dtype {d!r} (expected fp16, bf16 or fp32)")


def _launch(entry, args, q: torch.Tensor) -> int:
    """Call a kernel entry point with ``args``: on CUDA, on the current stream of q's device
    (made current for the launch when another device is), with no host synchronisation."""
    if not q.is_cuda:
        return entry(ctypes.byref(args))
    index = q.get_device()
    args.num_sms = _num_sms(index)
    args.stream = torch._C._cuda_getCurrentRawStream(index)
    if torch._C._cuda_getDevice() == index:
        return entry(ctypes.byref(args))
    with torch.cuda.device(index):
        return entry(ctypes.byref(args))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its pointer or strides break the 16-byte vector loads."""
    elems = 16 // t.element_size()
    if t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]):
        return t.contiguous()
    return t


_sms: dict[int, int] = {}


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare 'cuda')."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(index: int) -> int:
    if index not in _sms:
        _sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sms[index]


def announce(message: str) -> None:
    if not env.quiet():
        print(f"flashgen: {message}", file=sys.stderr, flush=True)


def ranges_text(dims: tuple[int, ...]) -> str:
    if len(dims) > 4 and all(b - a == 8 for a, b in zip(dims, dims[1:], strict=False)):
        return f"multiples of 8 from {dims[0]} to {dims[-1]}"
    return ", ".join(map(str, dims)) or "none"


# Every spec's op lives in the "flashgen" namespace; the Library object must outlive the ops.
_LIBRARY = torch.library.Library("flashgen", "FRAGMENT")


def _register(op: AttentionOp, qualname: str):
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
        is_packed = _check_varlen_given(*varlen)
        op.check_inputs(q, k, v, packed=is_packed)  # the raw op (torch.ops.flashgen.*) is callable directly too
        if not is_packed:
            return None
        return packed_layout(q, k, *varlen)

    def checked(kind, q, k, v, scale, values, dropout, varlen, block_lists):
        """The one validation of a call (the forward's or the backward's): inputs, packed
        layout, block lists, scale, parameters and dropout, then the family that serves it.
        Raises naming the argument, before any launch."""
        packed = packed_of(q, k, v, varlen)
        B, Hq, _, Nq, Nk, d = _dims(q, k, packed)
        dtype = IR_DTYPE[q.dtype]
        p = bool(dropout and dropout[0])
        fam = op._choose(q.device, dtype, d, packed is not None, bool(block_lists[3]), p).family
        blocks = check_blocks(kind, *block_lists, B, Hq, Nq, Nk, q.device, fam.dq_lists)
        scale = op.scale_for(scale, d)
        values = op.check_params(q, k, {p.name: x for p, x in zip(spec.params, values, strict=True)},
                                 packed.sizes(q.shape[1]) if packed is not None else None)
        if dropout:
            op.check_dropout(q, *dropout)
        if blocks is None:
            blocks = op.auto_blocks(fam, kind, q, k, values, packed)
        return fam, packed, blocks, scale, values

    def forward(q, k, v, scale, deterministic, *rest):
        values, dropout = rest[:npar], rest[npar:npar + ndrop]
        fam, packed, blocks, scale, values = checked("fwd", q, k, v, scale, values, dropout, varlen_of(rest),
                                                     blocks_of(rest))
        return op.launch_forward(q, k, v, scale, values, *dropout, packed=packed, blocks=blocks, family=fam)

    op._impl = forward

    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(qualname, forward, key)

    def fake(q, k, v, scale, deterministic, *rest):
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
            names = ", ".join(p for p, n in zip(op.grad_params, need_params, strict=True) if n)
            msg = (f"{op.name}: gradients of parameter(s) {names} are summed with fp32 atomics and are "
                   "not bitwise repeatable; deterministic mode was requested (deterministic=True or "
                   "torch.use_deterministic_algorithms(True))")
            if torch.is_deterministic_algorithms_warn_only_enabled():
                import warnings

                warnings.warn(msg, stacklevel=2)
            else:
                raise RuntimeError(msg + "; detach those parameters or turn deterministic mode off")
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
        fam, packed, blocks, scale, values = checked("bwd", q, k, v, scale, values, dropout,
                                                     varlen_of(rest, npar + 1 + ndrop),
                                                     blocks_of(rest, npar + 1 + ndrop))
        # The raw op is callable directly: out/dout like q, lse/dlse fp32 of the forward's LSE shape.
        for name, t in (("out", out), ("dout", dout)):
            if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name}: expected shape {tuple(q.shape)}, dtype {q.dtype} on {q.device} (like q), "
                                 f"got {_describe_tensor(t)}")
        want, what = ((q.shape[1], q.shape[0]), "[heads, total_q]") if packed is not None else \
            (tuple(q.shape[:3]), "[batch, heads, seqlen_q]")
        for name, t in (("lse", lse), ("dlse", dlse)):
            if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32 or t.device != q.device):
                raise ValueError(f"{name}: expected a float32 tensor of shape {what} = {want} on {q.device}, "
                                 f"got {_describe_tensor(t)}")
        lse = lse.contiguous()
        return op.launch_backward(q, k, v, out, lse, dout, dlse, scale, deterministic, values, need_params, *dropout,
                            packed=packed, blocks=blocks, family=fam)

    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(qualname + "_bwd", backward_impl, key)

    def backward_fake(q, k, v, out, lse, dout, dlse, scale, deterministic, *rest):
        values, need_params = rest[:npar], rest[npar]
        by_name = {p.name: x for p, x in zip(spec.params, values, strict=True)}
        pgrads = [by_name[n].new_empty(by_name[n].shape, dtype=torch.float32) if need
                  else q.new_empty(0, dtype=torch.float32) for n, need in zip(op.grad_params, need_params,
                                                                                strict=True)]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), pgrads

    torch.library.register_fake(name + "_bwd", backward_fake, lib=_LIBRARY)
    torch.library.register_autograd(name, backward, setup_context=setup_context, lib=_LIBRARY)
    return getattr(torch.ops.flashgen, qualname).default


PARAM_TORCH_DTYPE = {"f32": torch.float32, "i32": torch.int32, "i64": torch.int64, "bool": torch.bool}


def _describe_param(p: ir.Param) -> str:
    return f"{p.name}: {p.kind}" if not p.is_tensor else f"{p.name}: {p.dtype}{_shape_text(p)}"


def dim_text(e: ir.Expr) -> str:
    if isinstance(e, ir.Num):
        return str(e.value)
    if isinstance(e, ir.Name):
        return e.id
    if isinstance(e, ir.Unary):
        return f"-{dim_text(e.operand)}"
    return f"({dim_text(e.lhs)} {e.op} {dim_text(e.rhs)})"


def _shape_text(p: ir.Param) -> str:
    return "[" + ", ".join(dim_text(d.size) + ("|1" if d.broadcast else "") for d in p.shape) + "]"


def _shape_values(p: ir.Param, ints: dict) -> str:
    sizes = (eval_dim(d.size, ints) for d in p.shape)
    # None: a packed batch's max_seqlen, derived from cu_seqlens later (named, not a number)
    return "[" + ", ".join(f"max_{dim_text(d.size)}" if x is None else str(x)
                           for d, x in zip(p.shape, sizes, strict=True)) + "]"


def eval_dim(e: ir.Expr, ints: dict) -> int | None:
    """The size of a parameter dim; None when it uses a size not known yet (ints[name] None)."""
    if isinstance(e, ir.Num):
        return int(e.value)
    if isinstance(e, ir.Name):
        return None if ints[e.id] is None else int(ints[e.id])
    if isinstance(e, ir.Unary):
        x = eval_dim(e.operand, ints)
        return None if x is None else -x
    a, b = eval_dim(e.lhs, ints), eval_dim(e.rhs, ints)
    if a is None or b is None:
        return None
    return {"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else 0}[e.op]


def _params_struct(spec: ir.Spec):
    """A ctypes Structure class mirroring the generated ``Params`` (codegen.param_fields)."""
    from .codegen import param_fields

    ctype = {"int64": ctypes.c_int64, "float": ctypes.c_float, "ptr": ctypes.c_void_p,
             "gradptr": ctypes.c_void_p}
    fields = []
    for f in param_fields(spec):
        if f.ctype.startswith("int64["):
            fields.append((f.name, ctypes.c_int64 * int(f.ctype[6:-1])))
        else:
            fields.append((f.name, ctype[f.ctype]))
    return type(f"Params_{spec.name}", (ctypes.Structure,), {"_fields_": fields})
