"""The ctypes mirrors of templates/include/flashgen/args.h (FgFwdArgs with FgKvCache and FgWorkQueue,
FgBwdArgs), its status codes."""

from __future__ import annotations

import ctypes
import re
from functools import cache

from .paths import include_dir

_i64, _f32 = ctypes.c_int64, ctypes.c_float

# Last in both blocks: {seed, offset} pointer (null: no dropout), the 16-bit keep threshold, 1/(1-p).
_DROPOUT = [("dropout_state", ctypes.c_void_p), ("dropout_threshold", ctypes.c_uint32), ("dropout_scale", _f32)]
# After them, in both blocks: packed (varlen) batches. cu_seqlens_q null: the padded layout.
_VARLEN = [("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p), ("total_q", _i64), ("total_k", _i64)]
# At the end of both blocks: what the kernel family decides per call (the CPU tiles); FgBwdArgs adds the
# CUDA backward's GQA split after them.
_DECIDED = [("tile_q", ctypes.c_int32), ("tile_kv", ctypes.c_int32)]


class FgBlockLists(ctypes.Structure):
    """Block sparsity's per-tile-row lists (args.h, "Block sparsity"); data null: none."""

    _fields_ = [("data", ctypes.c_void_p), ("stride_b", _i64), ("stride_h", _i64),
                ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("block_r", ctypes.c_int32), ("block_c", ctypes.c_int32), ("full_kept", ctypes.c_int32)]


class FgClassifyArgs(ctypes.Structure):
    """The block classifier's arguments (args.h, FgClassifyArgs)."""

    _fields_ = [("out", ctypes.c_void_p), ("batch", _i64), ("heads", _i64), ("seqlen_q", _i64), ("seqlen_k", _i64),
                ("block_r", ctypes.c_int32), ("block_c", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("cols", ctypes.c_int32), ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
                ("params", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


class FgKvCache(ctypes.Structure):
    """Decoding with a KV cache (args.h, FgKvCache; op.with_kvcache); seqlens null: none."""

    _fields_ = [("seqlens", ctypes.c_void_p), ("leftpad", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("block_table_stride", _i64), ("num_pages", _i64), ("page_size", ctypes.c_int32),
                ("max_pages", ctypes.c_int32), ("capacity", _i64), ("k_new", ctypes.c_void_p),
                ("v_new", ctypes.c_void_p), ("seqlen_new", _i64),
                *[(f"{n}_stride_{d}", _i64) for n in ("kn", "vn") for d in "bhn"],
                ("num_splits", ctypes.c_int32), ("reserved", ctypes.c_int32), ("o_accum", ctypes.c_void_p),
                ("lse_accum", ctypes.c_void_p)]


class FgWorkQueue(ctypes.Structure):
    """Dynamic tile scheduling (args.h, FgWorkQueue; the sm90 forward on packed batches): a zeroed
    int32 counter and the ranked work-order table; counter null: the kernel's static schedule."""

    _fields_ = [("counter", ctypes.c_void_p), ("order", ctypes.c_void_p)]


class FgFwdArgs(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("batch", _i64), ("heads_q", _i64), ("heads_kv", _i64),
        ("seqlen_q", _i64), ("seqlen_k", _i64), ("head_dim", _i64),
        ("q_stride_b", _i64), ("q_stride_h", _i64), ("q_stride_n", _i64),
        ("k_stride_b", _i64), ("k_stride_h", _i64), ("k_stride_n", _i64),
        ("v_stride_b", _i64), ("v_stride_h", _i64), ("v_stride_n", _i64),
        ("o_stride_b", _i64), ("o_stride_h", _i64), ("o_stride_n", _i64),
        ("scale", _f32), ("num_sms", ctypes.c_int32),
        ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p),
        *_DROPOUT,
        *_VARLEN,
        ("kv_blocks", FgBlockLists),
        *_DECIDED,
        ("kv_cache", FgKvCache),
        ("work", FgWorkQueue),
    ]  # fmt: skip


def _strides(*names: str) -> list[tuple[str, type]]:
    return [(f"{n}_stride_{d}", _i64) for n in names for d in "bhn"]


class FgBwdArgs(ctypes.Structure):
    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv",
                                         "dq_accum", "softmax_d", "dk_accum", "dv_accum")],
        *[(n, _i64) for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim")],
        *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
        ("scale", _f32), ("num_sms", ctypes.c_int32), ("deterministic", ctypes.c_int32),
        ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p), ("dlse", ctypes.c_void_p),
        *_DROPOUT,
        *_VARLEN,
        ("q_blocks", FgBlockLists), ("kv_blocks", FgBlockLists),
        *_DECIDED, ("gqa_splits", ctypes.c_int32),
        ("dq_semaphore", ctypes.c_void_p),
    ]


@cache
def header_constants() -> dict[str, int]:
    """args.h's integer constants, name → value: its ``#define FG_X n`` lines and ``FG_X = n``
    enumerators (FG_ABI_VERSION, the FG_OK ... status codes). OSError when the header is missing."""
    text = (include_dir() / "flashgen" / "args.h").read_text()
    consts = {m[0]: int(m[1]) for m in re.findall(r"#define (FG_\w+) (\d+)", text)}
    consts.update({m[0]: int(m[1]) for m in re.findall(r"\b(FG_\w+) = (\d+)", text)})
    return consts


# The ABI the generated entry points are built against: args.h's FG_ABI_VERSION (its one source;
# bumped in the header whenever a field of the argument blocks changes).
ABI_VERSION: int = header_constants()["FG_ABI_VERSION"]


def status_name(code: int) -> str:
    """The args.h name of a status code (FG_OK, ...), else 'status <code>'."""
    for name, value in header_constants().items():
        if value == code and not name.startswith("FG_ABI"):
            return name
    return f"status {code}"
