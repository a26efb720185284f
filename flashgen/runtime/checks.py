"""The one validation of a call: q, k, v, the packed (varlen) layout, block lists, the spec's
parameters and dropout, each error naming the argument, before any launch (DESIGN: bad input
gets a clear Python exception). Called from the registered op's implementation
(runtime/library.py), which every entry point goes through; nothing here launches or loads.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from .. import families
from ..abi import FgBlockLists
from ..errors import did_you_mean
from ..lang import expr as X
from ..lang import intervals, ir
from ..lang.frontend import DTYPE_NAMES, FLOAT32_MAX

TORCH_DTYPE = {ir.DType.FP16: torch.float16, ir.DType.BF16: torch.bfloat16, ir.DType.FP32: torch.float32}


IR_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}


def spec_dtypes(spec: ir.Spec, family: families.Family | str) -> tuple[ir.DType, ...]:
    """The dtypes ``spec`` may run on ``family`` (a Family, its name or a device type): the
    family's, narrowed by the spec's ``dtype`` line."""
    return tuple(d for d in families.of(family).dtypes if spec.dtypes is None or d in spec.dtypes)


PARAM_TORCH_DTYPE = {"f32": torch.float32, "i32": torch.int32, "i64": torch.int64, "bool": torch.bool}


def as_dtype(d, what: str = "dtypes") -> ir.DType:
    """An ir.DType from a flashgen, torch or spelled ('bf16', 'float16', ...) dtype; ValueError
    naming ``what`` (the caller's argument) otherwise."""
    if isinstance(d, ir.DType):
        return d
    if isinstance(d, torch.dtype) and d in IR_DTYPE:
        return IR_DTYPE[d]
    if isinstance(d, str) and d in DTYPE_NAMES:
        return DTYPE_NAMES[d]
    raise ValueError(f"{what}: unknown dtype {d!r} (expected fp16, bf16 or fp32)")


def as_device(device, what: str = "device") -> torch.device:
    """A torch.device from a device or its spelling ('cpu', 'cuda', 'cuda:1', an index);
    ValueError naming ``what`` (the caller's argument) for anything torch does not parse as one
    (torch's own error lists every device type it knows)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, str | int):
        raise ValueError(f"{what}: expected a torch.device, a device string such as 'cpu' or 'cuda:0', or a CUDA "
                         f"device index, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{what}: unknown device {device!r} (expected e.g. 'cpu', 'cuda' or 'cuda:0')") from None


def plain_number(v):
    """A NumPy (or other numbers.Integral / numbers.Real) scalar as the Python int / float the
    ops' schemas take; anything else (None, bool, tensors, SymInts) unchanged (checked by the
    caller)."""
    if v is None or type(v) in (int, float) or isinstance(v, torch.Tensor | bool | torch.SymInt):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v) if isinstance(v, numbers.Real) else v


def check_scale_type(scale) -> None:
    """TypeError unless ``scale`` is a Python int or float (not a bool, not a tensor)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        hint = " (pass float(scale): a tensor would be read back from the device)" \
            if isinstance(scale, torch.Tensor) else ""
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}{hint}")


def check_no_bool_numbers(spec: ir.Spec, values) -> None:
    """TypeError naming an int or float parameter given a bool (which the torch op's schema, and
    so a compiled call or with_kvcache, would take as 0 or 1 without a later check seeing it)."""
    for p, value in zip(spec.params, values, strict=True):
        if p.kind != "tensor" and isinstance(value, bool):
            raise TypeError(f"{p.name}: expected {'an int' if p.kind == 'int' else 'a float'}, got bool")


def ranges_text(dims: tuple[int, ...]) -> str:
    if len(dims) > 4 and all(b - a == 8 for a, b in zip(dims, dims[1:], strict=False)):
        return f"multiples of 8 from {dims[0]} to {dims[-1]}"
    return ", ".join(map(str, dims)) or "none"


@dataclass(frozen=True)
class Packed:
    """A validated packed (varlen) batch: the contiguous int32 cu_seqlens tensors (on the inputs'
    device), the number of sequences, the resolved max_seqlen_q / max_seqlen_k and the token
    counts total_q / total_k. ``host_cu_q`` / ``host_cu_k``: the cu_seqlens values on the host
    (int64 CPU tensors, the validation's one copy); ``schedules``: what kernel families derive
    from the layout once and keep with it (the sm90 forward's work-order tables, by key)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int
    host_cu_q: torch.Tensor | None = field(default=None, compare=False, repr=False)
    host_cu_k: torch.Tensor | None = field(default=None, compare=False, repr=False)
    schedules: dict = field(default_factory=dict, compare=False, repr=False)

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
                             f"{device} (the block lists for {br} x {bc} tiles), got {describe_tensor(t)}")
    return Blocks(block_kv, block_q, block_dq, meta)


def check_varlen_given(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
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


def check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
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


# Validated packed layouts by cu_seqlens tensor: a model passes the same cu_seqlens to each of its
# attention layers, forward and backward, and each would otherwise pay a device-to-host copy and
# a synchronisation. Keyed by the tensors' identity and version counters (an in-place torch write
# bumps the version: validated again) and the call's sizes. An entry holds weak references to
# the tensors and the layout without them: the cache keeps no caller's tensor alive (one
# allocated in a CUDA graph's memory pool must not outlive its owner's wish), an entry whose
# tensor is gone is a miss and is dropped, and a hit requires the references to resolve to the
# call's own tensors, so an id reused by a new tensor never hits an old entry.
_PACKED_CACHE: OrderedDict[tuple, tuple[weakref.ref, weakref.ref, Packed]] = OrderedDict()
_PACKED_CACHE_SIZE = 32
_PACKED_LOCK = threading.Lock()


def _packed_key(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple | None:
    try:  # inference tensors have no version counter: not cached
        versions = (cu_seqlens_q._version, cu_seqlens_k._version)
    except RuntimeError:
        return None
    if not all(isinstance(m, int | None) for m in (max_seqlen_q, max_seqlen_k)):
        return None
    return (id(cu_seqlens_q), id(cu_seqlens_k), *versions, int(q.shape[0]), int(k.shape[0]), max_seqlen_q,
            max_seqlen_k)


def packed_layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None) -> Packed:
    """Validate the packed layout's metadata against q [total_q, Hq, d] and k [total_k, Hkv, d]
    and resolve max_seqlen_q / max_seqlen_k (None: the longest sequence); raises TypeError /
    ValueError naming the argument. Reads the cu_seqlens values on the host: one device-to-host
    copy when they live on a GPU, once per cu_seqlens tensor and version while the tensors live
    (later calls with the same tensors, unmodified by torch, reuse the result, sharing its
    ``schedules``: writes torch does not see, through ``.data`` or DLPack, are not noticed).
    The memo holds the tensors weakly: it never keeps a caller's cu_seqlens alive."""
    check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    key = _packed_key(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if key is not None:
        with _PACKED_LOCK:
            hit = _PACKED_CACHE.get(key)
            if hit is not None:
                ref_q, ref_k, bare = hit
                if ref_q() is cu_seqlens_q and ref_k() is cu_seqlens_k:
                    _PACKED_CACHE.move_to_end(key)
                    return replace(bare, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
                del _PACKED_CACHE[key]  # a tensor of the entry is gone (its id reused): a miss
    packed = _validate_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if key is not None and packed.cu_seqlens_q is cu_seqlens_q and packed.cu_seqlens_k is cu_seqlens_k:
        entry = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k),
                 replace(packed, cu_seqlens_q=None, cu_seqlens_k=None))
        with _PACKED_LOCK:
            for old in [x for x, (rq, rk, _) in _PACKED_CACHE.items() if rq() is None or rk() is None]:
                del _PACKED_CACHE[old]  # entries of freed tensors (their host tables with them)
            _PACKED_CACHE[key] = entry
            while len(_PACKED_CACHE) > _PACKED_CACHE_SIZE:
                _PACKED_CACHE.popitem(last=False)
    return packed


def _validate_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packed:
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
                  out["max_seqlen_k"], q.shape[0], k.shape[0], host[:n], host[n:])


def dims(q: torch.Tensor, k: torch.Tensor, packed: Packed | None) -> tuple[int, ...]:
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim) as the ABI takes them."""
    if packed is None:
        B, Hq, Nq, d = q.shape
        return B, Hq, k.shape[1], Nq, k.shape[2], d
    return packed.batch, q.shape[1], k.shape[1], packed.max_seqlen_q, packed.max_seqlen_k, q.shape[2]


def row_shape(B: int, H: int, N: int, packed: Packed | None, side: str) -> tuple[int, ...]:
    """The shape of an fp32 per-row buffer (lse, softmax_d, ...): [B, H, N], packed [H, total]."""
    if packed is None:
        return (B, H, N)
    return (H, packed.total_q if side == "q" else packed.total_k)


def check_dropout_p(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | torch.SymFloat):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {value!r}")
    return float(value) if isinstance(value, int | float) else value


def check_dropout_seed(value):
    """The seed as an int (numpy and other integral types accepted; bool and floats are not)."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"dropout_seed: expected None or an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < 2**64:
        raise ValueError(f"dropout_seed: {value} is out of range (expected 0 <= dropout_seed < 2^64)")
    return value


def describe_tensor(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t if its last dim is contiguous and no other dim is broadcast (stride 0), else a copy."""
    if t.stride(-1) == 1 and all(st != 0 or n == 1 for st, n in zip(t.stride()[:-1], t.shape[:-1], strict=True)):
        return t
    return t.contiguous()


def describe_param(p: ir.Param) -> str:
    return f"{p.name}: {p.kind}" if not p.is_tensor else f"{p.name}: {p.dtype}{shape_text(p)}"


def dim_text(e: ir.Expr) -> str:
    if isinstance(e, ir.Num):
        return str(e.value)
    if isinstance(e, ir.Name):
        return e.id
    if isinstance(e, ir.Unary):
        return f"-{dim_text(e.operand)}"
    return f"({dim_text(e.lhs)} {e.op} {dim_text(e.rhs)})"


def shape_text(p: ir.Param) -> str:
    return "[" + ", ".join(dim_text(d.size) + ("|1" if d.broadcast else "") for d in p.shape) + "]"


def shape_values(p: ir.Param, ints: dict) -> str:
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


def check_q_dtype(op, q: torch.Tensor, backend: str) -> None:
    """ValueError unless q's dtype is one the spec allows on ``backend`` ('cpu' / 'cuda')."""
    allowed = spec_dtypes(op.spec, backend)
    if q.dtype not in IR_DTYPE or IR_DTYPE[q.dtype] not in allowed:
        names = ", ".join(str(TORCH_DTYPE[d]).removeprefix("torch.") for d in allowed) or "none"
        raise ValueError(f"q: dtype {q.dtype} is not supported by spec '{op.spec.name}' on {backend} "
                         f"(expected one of: {names})")


def check_inputs(op, q, k, v, *, packed: bool = False) -> None:
    """Validate q, k, v as ``__call__`` documents; raise naming the offending argument.
    ``packed``: the varlen layout (q [total_q, Hq, d], k and v [total_k, Hkv, d]). Inputs
    whose metadata (dtype, device, shape, strides) passed once pass again without the checks."""
    try:
        key = (packed, q.dtype, q.device, q.shape, q.stride(), k.dtype, k.device, k.shape, k.stride(),
               v.dtype, v.device, v.shape, v.stride())
    except (AttributeError, TypeError):
        key = None
    if key is not None and key in op.checked_inputs:
        return
    _check_inputs(op, q, k, v, packed)
    if key is not None:
        op.checked_inputs.add(key)


def _check_inputs(op, q, k, v, packed: bool) -> None:
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
    backend = q.device.type
    if not any(f.device == backend for f in families.FAMILIES.values()):
        raise ValueError(f"q: device type '{backend}' is not supported (expected cpu or cuda)")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}; q, k, v must share a device")
    check_q_dtype(op, q, backend)  # q's own dtype first, then k's and v's
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
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
    dims = op.head_dims(backend)
    if d not in dims:
        raise ValueError(f"q: head_dim {d} is not supported by spec '{op.spec.name}' on {backend} "
                         f"(expected one of {ranges_text(dims)})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    if not packed:  # packed: the per-sequence lengths are bounded through max_seqlen_q / _k
        for name, n in (("q", q.shape[2]), ("k", k.shape[2])):
            if n > X.MAX_SEQLEN:
                raise ValueError(f"{name}: sequence length {n} exceeds the kernels' limit of 2^30 = "
                                 f"{X.MAX_SEQLEN} (positions are 32-bit)")


def check_params(op, q: torch.Tensor, k: torch.Tensor, params: dict, sizes: dict | None = None) -> list:
    """The spec's parameters from ``params`` in declaration order, validated against q and k's
    shapes; raises TypeError / ValueError naming the parameter. ``sizes``: the dims batch,
    heads, seqlen_q and seqlen_k (default: q and k's padded shapes; packed layout: the number
    of sequences, Hq, max_seqlen_q and max_seqlen_k, None where not known yet, which skips
    the checks that need it)."""
    declared = {p.name: p for p in op.spec.params}
    for name in params:
        if name not in declared:
            hint = did_you_mean(name, declared)
            what = ("declares " + ", ".join(describe_param(p) for p in op.spec.params)
                    if declared else "declares no parameters")
            raise TypeError(f"unknown parameter '{name}': spec '{op.spec.name}' {what}"
                            + (f" ({hint})" if hint else ""))
    missing = [p for p in op.spec.params if p.name not in params]
    if missing:
        raise TypeError(f"missing parameter(s) of spec '{op.spec.name}': "
                        + ", ".join(describe_param(p) for p in missing))
    ints = dict(sizes) if sizes is not None else \
        {"batch": q.shape[0], "heads": q.shape[1], "seqlen_q": q.shape[2], "seqlen_k": k.shape[2]}
    out = []
    for p in op.spec.params:
        value = params[p.name]
        if p.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
                raise TypeError(f"{p.name}: expected an int, got {type(value).__name__}")
            if not -(2**62) <= value < 2**62:
                raise ValueError(f"{p.name}: {value} is out of range (|value| < 2^62)")
            X.check_positive(op.spec, {p.name: value})
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
                raise TypeError(f"{p.name}: expected a torch.Tensor ({describe_param(p)}), "
                                f"got {type(value).__name__}")
            if value.dtype != want:
                raise ValueError(f"{p.name}: dtype {value.dtype}, expected {want} ({describe_param(p)})")
            if value.device != q.device:
                raise ValueError(f"{p.name}: on {value.device} but q is on {q.device}")
            if value.dim() != len(p.shape):
                raise ValueError(f"{p.name}: expected {len(p.shape)} dims {shape_text(p)}, "
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
                    alt = " or 1" if dim.broadcast and size != 1 else ""
                    raise ValueError(f"{p.name}: dim {d} has size {got}, expected {size}{alt} "
                                     f"({shape_text(p)} = {shape_values(p, ints)} for these inputs)")
        out.append(value)
    reach = {"b": ints["batch"], "h": ints["heads"], "q": ints["seqlen_q"], "kv": ints["seqlen_k"]}
    for name, d, pos in op.direct_reads:
        p, t = declared[name], params[name]
        if reach[pos] is None:
            continue
        if t.shape[d] < reach[pos] and not (p.shape[d].broadcast and t.shape[d] == 1):
            raise ValueError(f"{name}: dim {d} has size {t.shape[d]} but the spec reads it at {pos} up to "
                             f"{reach[pos] - 1} for these inputs")
    if op.computed_reads:
        check_computed_reads(op, params, reach, ints)
    return out


def check_computed_reads(op, params: dict, reach: dict, ints: dict) -> None:
    """ValueError naming the parameter when an index computed from positions, sizes and int
    parameters (``t[h + 1]``, ``rel[h, clamp(kv - q, -m, m) + m]``; lang/intervals.py) leaves
    the parameter's dim somewhere on the call's grid, where flashgen.reference raises IndexError
    (the kernels would clamp it). Skipped for an empty grid or a size not known yet."""
    key = (*ints.values(), *[params[r.name].shape[r.dim] for r in op.computed_reads])  # sizes, int values
    if key in op.computed_reads_ok or any(v is None or v < 1 for v in reach.values()):
        return
    env = {p: (0, n - 1) for p, n in reach.items()}
    env |= {k: (v, v) for k, v in ints.items() if isinstance(v, int) and k in ("seqlen_q", "seqlen_k")}
    env |= {p.name: (params[p.name], params[p.name]) for p in op.spec.params if p.kind == "int"}
    declared = {p.name: p for p in op.spec.params}
    for r in op.computed_reads:
        size = params[r.name].shape[r.dim]
        if size == 1 and declared[r.name].shape[r.dim].broadcast:
            continue
        rng = intervals.interval(r.index, env)
        if rng is not None and (rng[0] < 0 or rng[1] >= size):
            sp = r.index.span
            where = f" at {sp.file}:{sp.line}:{sp.column}" if sp else ""
            raise ValueError(f"{r.name}: dim {r.dim} has size {size} but the spec's index{where} reaches "
                             f"{rng[0]}..{rng[1]} for these inputs (flashgen.reference raises IndexError; "
                             f"the kernels would clamp it)")
    op.computed_reads_ok.add(key)


def check_dropout(op, q: torch.Tensor, dropout_p: float, state: torch.Tensor | None) -> None:
    """Validate the op's dropout arguments as the raw op receives them (``__call__`` forms
    them itself); raise naming the argument."""
    dropout_p = check_dropout_p(dropout_p)
    if not dropout_p:
        return
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or state.shape != (2,) \
            or state.device != q.device:
        raise ValueError(f"dropout_state: expected an int64 tensor of shape (2,) (seed, offset) on {q.device}, "
                         f"got {describe_tensor(state)}")

