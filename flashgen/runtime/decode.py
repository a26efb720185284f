"""Decoding with a KV cache: ``AttentionOp.with_kvcache`` (FlashAttention's
``flash_attn_with_kvcache`` in our layouts), its validation, the implementation of its torch op
``flashgen::<spec>_<hash12>_kvcache`` (registered by runtime/library.py: the cache tensors
declared mutated, a fake implementation, no autograd) and its launch (args.h, FgKvCache).

The call returns exactly the last Sq rows of the prefill call on each whole sequence, so every
spec's mask and score hooks see absolute positions. Nothing here reads a device-side value
(cache_seqlens, cache_leftpad, block_table) unless ``validate=True``: the kernels take them from
device memory and clamp, so a decode step needs no host synchronisation.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace

import torch

from .. import families
from ..abi import FgFwdArgs, FgKvCache
from ..caches import Bounded
from ..lang import expr as X
from ..lang import keyrange
from . import launch, plans
from .checks import IR_DTYPE, check_q_dtype, describe_tensor, plain_number, ranges_text

MAX_PAGE_SIZE = 256

# Keywords of the prefill call that a decode call does not take: TypeError naming them.
_PREFILL_ONLY = ("deterministic", "block_mask", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
# flash_attn_with_kvcache's keywords that with_kvcache has no counterpart for (when the spec
# declares no parameter of that name): what a user coming from FlashAttention should do instead.
_FLASH_ATTN_ONLY = {
    "cache_batch_idx": "index the caches yourself (k_cache[idx], v_cache[idx]) or use a paged cache with "
                       "block_table",
    "rotary_cos": "apply the rotary embedding to q and k before the call",
    "rotary_sin": "apply the rotary embedding to q and k before the call",
    "rotary_interleaved": "apply the rotary embedding to q and k before the call",
    "softmax_scale": "pass scale=",
    "causal": "the spec's mask says whether attention is causal (specs/causal.attn)",
    "window_size": "use a sliding-window spec (specs/sliding_window.attn)",
    "alibi_slopes": "use the ALiBi spec (specs/alibi.attn) and its slopes parameter",
}
_SCREENED = frozenset(("dropout_p", "dropout_seed", *_FLASH_ATTN_ONLY, *_PREFILL_ONLY))


@dataclass(frozen=True)
class KvCall:
    """A validated decode call's host-known layout: sizes, the cache's capacity (slots per
    sequence) and paging, the number of appended keys, and the int32 metadata tensors (made
    contiguous where needed; on q's device)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    head_dim: int
    capacity: int
    page_size: int  # 0: contiguous cache
    max_pages: int
    num_pages: int
    seqlen_new: int
    cache_seqlens: torch.Tensor
    cache_leftpad: torch.Tensor | None
    block_table: torch.Tensor | None

    def sizes(self) -> dict:
        """The parameter dims of a decode call: positions reach the capacity on both sides."""
        return {"batch": self.batch, "heads": self.heads_q, "seqlen_q": self.capacity, "seqlen_k": self.capacity}


def with_kvcache(op, q, k_cache, v_cache, *, cache_seqlens, block_table=None, k=None, v=None, cache_leftpad=None,
                 scale=None, return_lse=False, num_splits=0, validate=False, **params):
    """Attention of this spec for the last queries of sequences whose keys sit in a KV cache
    (decoding; FlashAttention's ``flash_attn_with_kvcache``, in our [B, H, S, d] layouts).

    For sequence b with n = cache_seqlens[b] cached keys, pad = cache_leftpad[b] (0 without) and
    Sn new keys in ``k`` / ``v`` (0 without), the sequence has L = n + Sn − pad keys: the cache's
    slots pad .. n − 1, then the new ones, which are written into slots n .. n + Sn − 1 first.
    The call returns exactly the last Sq rows of the prefill call ``op(q_full, k_full, v_full)``
    on the whole sequence: query row i is position L − Sq + i, and the spec's mask and score
    expressions see seqlen_q = seqlen_k = L and those absolute positions (causal, windows,
    ALiBi, relative tables, document ids indexed by position mean what they mean in training).
    A row whose position is negative (Sq > L) gets out 0 and lse −inf.

    Args:
        q: [B, Hq, Sq, d] (any Sq: 1 for plain decoding, a few for speculative decoding or
            chunked prefill), dtype and head dim as the op takes them, last dim contiguous.
        k_cache, v_cache: the cache, q's dtype and device, last dim contiguous, any other strides:
            contiguous [B, Hkv, capacity, d], or with ``block_table`` paged
            [num_pages, page_size, Hkv, d] (page_size 1 to 256; FlashAttention's
            [B, capacity, Hkv, d] cache passes as ``.transpose(1, 2)``). Hq must be a multiple
            of Hkv. Mutated when ``k`` is given (declared so in the op's schema).
        cache_seqlens: int32 [B] on q's device: the keys already in each sequence's cache (not
            modified: the caller advances it).
        block_table: None, or int32 [B, max_pages] on q's device (vLLM's and FlashAttention's
            page tables): slot s of sequence b is row s % page_size of page
            block_table[b, s // page_size]; pages anywhere in the pool, shared between sequences
            allowed. capacity = max_pages · page_size.
        k, v: None, or [B, Hkv, Sn, d] (q's dtype and device, last dim contiguous), both or
            neither, Sn ≤ capacity: written into the cache at slots n .. n + Sn − 1 of each
            sequence before attention.
        cache_leftpad: None, or int32 [B] on q's device: cache slots before it are padding
            (left-padded batches).
        scale: softmax scale; default the spec's (1/sqrt(d) unless it sets ``scale``).
        return_lse: also return the log-sum-exp, fp32 [B, Hq, Sq], natural log.
        num_splits: split-KV count, an int ≥ 0: 0 chooses (sm80: from the batch, kv heads, Sq,
            group, capacity (or a sliding window's width where int parameters bound it:
            ``key_span``) and the device's multiprocessors, never from device-side lengths),
            1 disables splitting, n > 1 asks for n (at most one split per key tile of the
            capacity, 32 or 64 keys, and 128). The cpu family does not split (any value gives the same result).
        validate: check the device-side values on the host first (cache_seqlens, cache_leftpad,
            block_table: one device-to-host copy), raising ValueError naming the argument.
            Without it nothing syncs the host, and values out of range never make the kernels
            read or write out of bounds: a sequence with n < 0, pad < 0, pad > n,
            n + Sn > capacity or a page index of one of its slots outside [0, num_pages) writes
            nothing into the cache and gets out and lse NaN.
        **params: the spec's parameters, as the op takes them, with the dims seqlen_q and
            seqlen_k both the capacity (positions are absolute: ``document_id: i32[batch,
            seqlen_k]`` is [B, capacity], ``bias[b, h, q, kv]`` [B|1, Hq|1, capacity, capacity]).

    Returns:
        out [B, Hq, Sq, d] in q's dtype, or ``(out, lse)``.

    Raises:
        TypeError / ValueError: bad arguments, naming the argument, before any launch (shapes,
            dtypes, devices, page size, block_table's dtype; with ``validate=True`` the values).
        TypeError: a keyword of FlashAttention's flash_attn_with_kvcache with no counterpart
            here (cache_batch_idx, rotary_*, softmax_scale, causal, window_size, alibi_slopes),
            saying what to do instead, unless the spec declares a parameter of that name.
        ValueError: also, in a call that writes k and v, v_cache and k_cache sharing memory (the
            same tensor, or views of one buffer with an element in common; views that share no
            element, such as ``kv[0]`` and ``kv[1]``, are fine, and so is one tensor as both
            caches in a call that only reads).
        NotImplementedError: autograd (an input requires grad with grad mode on: decoding is
            inference only), ``dropout_p`` other than 0 (no dropout), or a kernel family without decode
            kernels for the call (sm90; sm80 at head dims that are not multiples of 16),
            naming what it lacks.
        KernelError: the kernel reported a failure.
    """
    # keywords that are no parameter of with_kvcache (most calls pass none); a generator, not
    # dict_keys & frozenset, which torch 2.11's dynamo fails on inside a compiled model
    if params and any(n in _SCREENED for n in params):
        _screen_keywords(op, params)
        params = {n: x for n, x in params.items() if n != "dropout_p"}  # 0 (eval-mode code passes it)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    # NumPy (any numbers.Integral / numbers.Real) scalars as the Python numbers the schema takes, as op(...)
    scale, num_splits = plain_number(scale), plain_number(num_splits)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int | torch.SymInt):
        raise TypeError(f"num_splits: expected an int >= 0, got {type(num_splits).__name__}")
    required = ("q", "k_cache", "v_cache", "cache_seqlens")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                    ("block_table", block_table), ("k", k), ("v", v), ("cache_leftpad", cache_leftpad)):
        if t is not None and not isinstance(t, torch.Tensor):  # before the torch op's schema sees it
            raise TypeError(f"{name}: expected a torch.Tensor{'' if name in required else ' or None'}, "
                            f"got {type(t).__name__}")
    values = op._param_values(params)
    tensors = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
               *((p.name, x) for p, x in zip(op.spec.params, values, strict=True)))
    if torch.is_grad_enabled():
        for name, t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise NotImplementedError(f"{name}: with_kvcache is inference only (no backward); call it under "
                                          "torch.no_grad() or torch.inference_mode(), or pass detached tensors")
    if validate:
        call = check_kvcache(op, q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad, num_splits)
        check_values_on_host(call)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad, scale, num_splits, *values)
    if launch.direct(q, k_cache, v_cache, values) and all(
            t is None or type(t) is torch.Tensor for t in (cache_seqlens, block_table, k, v, cache_leftpad)):
        out, lse = op.kvcache_implementation(*args)
    else:
        out, lse = op.torch_kvcache(*args)
    return (out, lse) if return_lse else out


def _screen_keywords(op, params: dict) -> None:
    """Refuse the keywords with_kvcache does not take (dropout other than p = 0, FlashAttention's
    and the prefill call's), each saying what to do instead."""
    if "dropout_p" in params and not _is_zero(params["dropout_p"]) or "dropout_seed" in params:
        name = "dropout_seed" if "dropout_seed" in params else "dropout_p"
        raise NotImplementedError(f"{name}: with_kvcache is inference only and applies no dropout (a spec's "
                                  "`dropout` line is ignored here, as in eval mode)")
    declared = {p.name for p in op.spec.params}
    for name, instead in _FLASH_ATTN_ONLY.items():
        if name in params and name not in declared:
            raise TypeError(f"{name}: FlashAttention's flash_attn_with_kvcache takes it, with_kvcache does not; "
                            f"{instead}")
    for name in _PREFILL_ONLY:
        if name in params:
            raise TypeError(f"{name}: not an argument of with_kvcache (it takes q, k_cache, v_cache, cache_seqlens, "
                            "block_table, k, v, cache_leftpad, scale, return_lse, num_splits, validate and the "
                            "spec's parameters)")


def _int32_vector(name: str, t, B: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != B \
            or t.device != device:
        raise ValueError(f"{name}: expected an int32 tensor of shape [batch] = [{B}] on {device}, "
                         f"got {describe_tensor(t)}")
    return t.contiguous()


def check_kvcache(op, q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad,
                  num_splits) -> KvCall:
    """Validate a decode call's tensors as ``with_kvcache`` documents; raise TypeError /
    ValueError naming the argument. Reads no tensor value."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    paged = block_table is not None
    layout = "[num_pages, page_size, kv_heads, head_dim] (paged: block_table given)" if paged else \
        "[batch, kv_heads, capacity, head_dim]"
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [batch, heads, seqlen_q, head_dim], got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims {layout}, got shape {tuple(t.shape)}")
    device = q.device
    B = q.shape[0]
    if paged and (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                  or block_table.dim() != 2 or block_table.shape[0] != B or block_table.device != device):
        raise ValueError(f"block_table: expected an int32 tensor of shape [batch, max_pages] = [{B}, max_pages] "
                         f"on {device}, got {describe_tensor(block_table)}")
    if not any(f.device == device.type for f in families.FAMILIES.values()):
        raise ValueError(f"q: device type '{device.type}' is not supported (expected cpu or cuda)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device} but q is on {device}")
    check_q_dtype(op, q, device.type)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    B, Hq, Sq, d = q.shape
    dims = op.head_dims(device.type)
    if d not in dims:
        raise ValueError(f"q: head_dim {d} is not supported by spec '{op.spec.name}' on {device.type} "
                         f"(expected one of {ranges_text(dims)})")
    if k_cache.shape[-1] != d:
        raise ValueError(f"k_cache: head_dim {k_cache.shape[-1]} differs from q's {d}")
    Hkv = k_cache.shape[2] if paged else k_cache.shape[1]
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv):
        where = "dim 2 of a paged cache [num_pages, page_size, kv_heads, head_dim], as block_table is given" if paged \
            else "dim 1 of a contiguous cache [batch, kv_heads, capacity, head_dim]; a paged cache needs block_table"
        raise ValueError(f"k_cache: {Hkv} kv heads ({where}) do not divide {Hq} query heads (GQA/MQA need heads_q "
                         "to be a multiple of heads_kv)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    if Sq > X.MAX_SEQLEN:
        raise ValueError(f"q: seqlen_q {Sq} exceeds the kernels' limit of 2^30 = {X.MAX_SEQLEN}")
    if paged:
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"k_cache: page_size (dim 1) is {page_size}, expected 1 to {MAX_PAGE_SIZE}")
        max_pages = block_table.shape[1]
        capacity = max_pages * page_size
        if capacity and num_pages == 0:
            raise ValueError("k_cache: the page pool is empty (num_pages = 0) but block_table has pages")
        if block_table.stride(1) != 1:
            block_table = block_table.contiguous()
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache: batch {k_cache.shape[0]} differs from q's {B}")
        num_pages = page_size = max_pages = 0
        capacity = k_cache.shape[2]
    if capacity > X.MAX_SEQLEN:
        raise ValueError(f"k_cache: a capacity of {capacity} slots exceeds the kernels' limit of 2^30")
    cache_seqlens = _int32_vector("cache_seqlens", cache_seqlens, B, device)
    if cache_leftpad is not None:
        cache_leftpad = _int32_vector("cache_leftpad", cache_leftpad, B, device)
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: k and v are given together or not at all")
    Sn = 0
    if k is not None:
        want = (B, Hkv, k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0, d)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != want or t.dtype != q.dtype \
                    or t.device != device or t.stride(-1) != 1:
                shape = [B, Hkv, want[2] if want[2] else "seqlen_new", d]  # (k's own count once it is 4-D)
                raise ValueError(f"{name}: expected a {q.dtype} tensor of shape [batch, kv_heads, seqlen_new, "
                                 f"head_dim] = [{', '.join(map(str, shape))}] on {device} with a contiguous last "
                                 f"dim, got {describe_tensor(t)}"
                                 + (f" with strides {t.stride()}" if isinstance(t, torch.Tensor) else ""))
        Sn = k.shape[2]
        if Sn > capacity:
            raise ValueError(f"k: {Sn} new keys exceed the cache's capacity of {capacity} slots")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if Sn and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
                raise ValueError(f"{name}: a broadcast (stride 0) cache cannot be written; pass a real tensor")
        if Sn:
            _refuse_shared_cache(k_cache, v_cache)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int | torch.SymInt) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 chooses, 1 disables splitting), got {num_splits!r}")
    return KvCall(B, Hq, Hkv, Sq, d, capacity, page_size, max_pages, num_pages, Sn, cache_seqlens, cache_leftpad,
                  block_table)


def _refuse_shared_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError naming k_cache and v_cache when a call that appends k and v gets caches that
    share memory: the same tensor twice, or views of one buffer with an element in common, where
    writing v would overwrite k. Views of one buffer that share no element (``kv[0]`` and
    ``kv[1]``, or ``kv[:, :, 0]`` and ``kv[:, :, 1]`` of an interleaved ``[B, S, 2, H, d]``
    buffer) pass. Run on every writing call, memo hits included (pointers are no part of the
    memos' keys): disjoint byte ranges, the common case, cost a few integer comparisons; ranges
    that interleave are decided exactly from the shapes and strides (``_views_overlap``,
    memoised on integers)."""
    if k_cache.numel() == 0:  # (v_cache has k_cache's shape: checked before)
        return
    size = k_cache.element_size()
    k0, v0 = k_cache.data_ptr(), v_cache.data_ptr()
    k1 = k0 + _reach(k_cache) * size  # last bytes' starts: the ranges are [k0, k1 + size), [v0, v1 + size)
    v1 = v0 + _reach(v_cache) * size
    if k1 + size <= v0 or v1 + size <= k0:
        return
    if k0 == v0 or _views_overlap(tuple(k_cache.shape), tuple(k_cache.stride()), tuple(v_cache.stride()),
                                  v0 - k0, size):
        raise ValueError("v_cache: is k_cache's memory (the same tensor, or a view with elements in common with "
                         "k_cache), so writing the new k and v would overwrite one with the other; pass k_cache "
                         "and v_cache that share no element (or k=None, v=None to read only)")


def _reach(t: torch.Tensor) -> int:
    """The offset, in elements, of a non-empty tensor's last element from its first (strides are
    never negative in torch)."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


_SEARCH_LIMIT = 4096  # nodes of _views_overlap's search; beyond it the views count as overlapping


@functools.lru_cache(maxsize=256)
def _views_overlap(shape: tuple[int, ...], k_strides: tuple[int, ...], v_strides: tuple[int, ...], delta: int,
                   size: int) -> bool:
    """Whether two views of ``shape`` (element strides ``k_strides`` and ``v_strides``, elements
    of ``size`` bytes, the second starting ``delta`` bytes after the first) have an element in
    common: integers i, j in [0, shape) with |Σ i·ks − Σ j·vs − δ| < 1 element (δ = delta / size,
    an element that straddles the other's only partly counts as shared). Terms of equal stride
    merge into one coefficient range; a search over the strides, largest first, bounds each
    coefficient by what the smaller ones can still reach. Conservative (True) past
    ``_SEARCH_LIMIT`` nodes, which layouts made of slices of one buffer never come near."""
    ranges: dict[int, list[int]] = {}
    for n, ks, vs in zip(shape, k_strides, v_strides, strict=True):
        for stride, lo, hi in ((ks, 0, n - 1), (vs, 1 - n, 0)):
            if stride and n > 1:
                r = ranges.setdefault(stride, [0, 0])
                r[0] += lo
                r[1] += hi
    terms = sorted(((s, lo, hi) for s, (lo, hi) in ranges.items()), reverse=True)
    low = [0] * (len(terms) + 1)  # what terms i.. can reach at least / at most
    high = [0] * (len(terms) + 1)
    for i in range(len(terms) - 1, -1, -1):
        s, lo, hi = terms[i]
        low[i], high[i] = low[i + 1] + lo * s, high[i + 1] + hi * s
    target = (delta // size, -(-delta // size))  # the sum must equal one of these (one when aligned)
    budget = [_SEARCH_LIMIT]

    def reaches(i: int, lo: int, hi: int) -> bool:  # some sum of terms i.. in [lo, hi]
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if hi < low[i] or lo > high[i]:
            return False
        if i == len(terms):
            return True
        s, cmin, cmax = terms[i]
        first = max(cmin, -((high[i + 1] - lo) // s))  # c·s ≥ lo − high[i + 1]
        last = min(cmax, (hi - low[i + 1]) // s)  # c·s ≤ hi − low[i + 1]
        return any(reaches(i + 1, lo - c * s, hi - c * s) for c in range(first, last + 1))

    return reaches(0, target[0], target[1])


def _is_zero(x) -> bool:
    """A real number equal to 0 (not a bool, not a tensor)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and x == 0


@torch.compiler.disable(reason="with_kvcache(validate=True) reads cache_seqlens, cache_leftpad and block_table on "
                               "the host; inside torch.compile(fullgraph=True) pass validate=False")
def check_values_on_host(call: KvCall) -> None:
    """``check_values`` outside torch.compile's graphs (the values are read on the host)."""
    check_values(call)


def check_values(call: KvCall) -> None:
    """``validate=True``: the device-side values on the host (one copy each); ValueError naming
    the argument when a sequence's cache_seqlens, cache_leftpad or page indices are out of range."""
    n = call.cache_seqlens.to("cpu", torch.int64)
    limit = call.capacity - call.seqlen_new
    bad = torch.nonzero((n < 0) | (n > limit))
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"cache_seqlens: entry {b} is {int(n[b])}, expected 0 to capacity - seqlen_new = "
                         f"{call.capacity} - {call.seqlen_new} = {limit}")
    pad = call.cache_leftpad.to("cpu", torch.int64) if call.cache_leftpad is not None else torch.zeros_like(n)
    bad = torch.nonzero((pad < 0) | (pad > n))
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"cache_leftpad: entry {b} is {int(pad[b])}, expected 0 to cache_seqlens[{b}] = {int(n[b])}")
    if call.block_table is not None and call.capacity:
        table = call.block_table.to("cpu", torch.int64)
        page = torch.arange(call.max_pages)
        end = n + call.seqlen_new
        used = (page[None] >= (pad // call.page_size)[:, None]) & (page[None] * call.page_size < end[:, None])
        bad = torch.nonzero(used & ((table < 0) | (table >= call.num_pages)))
        if bad.numel():
            b, j = (int(x) for x in bad[0])
            raise ValueError(f"block_table: entry [{b}, {j}] is {int(table[b, j])}, outside the pool of "
                             f"{call.num_pages} pages (k_cache.shape[0])")


def key_span(spec, values, capacity: int, seqlen_q: int) -> int:
    """At most how many keys one decode row tile keeps: the ``capacity``, or less for a spec whose
    rows keep a bounded width of keys (keyrange.row_width: a sliding window's ``window``, or
    ``left + right + 1`` of window(left, right)) given its int parameters' ``values`` (declaration
    order), plus ``seqlen_q`` - 1 for the tile's rows at consecutive positions. What the split
    count is chosen for (sm80 ``decode_splits``): a window in a long cache needs the splits of a
    window, not of the cache. A symbolic int (torch.compile) leaves the capacity."""
    forms = keyrange.row_width(spec)
    if not forms:
        return capacity
    ints = {p.name: v for p, v in zip(spec.params, values, strict=True) if p.kind == "int" and type(v) is int}
    span = capacity
    for form in forms:
        if all(k is None or k in ints for k in form):
            width = sum(c * (1 if k is None else ints[k]) for k, c in form.items())
            span = min(span, max(0, width) + max(1, seqlen_q) - 1)
    return span


@dataclass(frozen=True)
class DecodePlan:
    """What a decode call with given metadata launches, learnt from a validated call: the
    library, the ABI block with every pointer null (sizes, the caches' strides and paging, the
    scale, the split count), the workspaces' shapes, the family's per-call fields."""

    lib: object
    args: bytes
    own: bool  # the family's decode kernels (16-byte copies: aligned pointers) rather than its forward
    lse_shape: tuple[int, ...]
    workspaces: tuple[tuple[int, ...], tuple[int, ...]] | None  # o_accum, lse_accum (splits > 1)
    fill: object  # the family's LaunchFields.fwd
    seqlen_new: int


def make_plan(op, call: KvCall, q, k_cache, v_cache, scale: float, values, fam, num_splits: int = 0) -> DecodePlan:
    """The plan of a validated decode call on ``fam``: a family with decode kernels of its own
    (sm80) gets its split count from its launch fields (``kv_splits``: ``num_splits`` 0
    chooses, 1 disables) and, when it splits, fp32 workspaces of the partial outputs and LSEs
    (args.h, FgKvCache), allocated per call."""
    B, Hq, Sq, d = call.batch, call.heads_q, call.seqlen_q, call.head_dim
    if B == 0 or (Hq * Sq * d == 0 and not call.seqlen_new):  # nothing to launch: no library either
        return DecodePlan(None, b"", False, (B, Hq, Sq), None, None, call.seqlen_new)
    lib = op.decode_library(fam, q.device, IR_DTYPE[q.dtype], d, call.capacity)
    paged = call.page_size > 0

    def strides(t):
        s = t.stride()
        return (s[0], s[2], s[1]) if paged else s[:3]

    args = FgFwdArgs(0, 0, 0, 0, 0, B, Hq, call.heads_kv, Sq, call.capacity, d, 0, 0, 0, *strides(k_cache),
                     *strides(v_cache), 0, 0, 0, scale, 0, None, None)  # pointers, q's and out's strides: per call
    args.kv_cache = FgKvCache(None, None, None, 0, call.num_pages, call.page_size, call.max_pages, call.capacity,
                              None, None, call.seqlen_new, 0, 0, 0, 0, 0, 0, 1)
    fields = op.launch_fields(lib)
    own = lib.decode is not None
    workspaces = None
    if own:
        args.num_sms = launch.num_sms(q)
        splits = fields.kv_splits(args, lib.instantiation, int(num_splits), key_span(op.spec, values, call.capacity, Sq))
        args.kv_cache.num_splits = splits
        if splits > 1:
            workspaces = ((splits, B, Hq, Sq, d), (splits, B, Hq, Sq))
    return DecodePlan(lib, bytes(args), own, (B, Hq, Sq), workspaces, fields.fwd, call.seqlen_new)


def run_plan(op, plan: DecodePlan, q, k_cache, v_cache, cache_seqlens, cache_leftpad, block_table, k, v,
             values) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse of one decode launch from ``plan`` (appending k / v into the cache first); no
    host synchronisation. New k / v inside a cache's own memory are copied first, so the append
    never overwrites its own source."""
    fill = float("nan") if launch.poison_outputs else None
    out = torch.empty_like(q) if fill is None else torch.full_like(q, fill)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if fill is not None:
        lse.fill_(fill)
    if plan.lse_shape[0] == 0 or (out.numel() == 0 and not plan.seqlen_new):
        return out, lse
    if k is not None:
        caches = {k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()}
        k, v = (t.clone() if t.numel() and t.untyped_storage().data_ptr() in caches else t for t in (k, v))
    if plan.own:  # the family's decode kernels take 16-byte aligned q, k, v
        q = launch.aligned(q)
        k, v = (launch.aligned(t) if t is not None else None for t in (k, v))
    block = op.params_block(values)
    args = FgFwdArgs.from_buffer_copy(plan.args)
    args.q, args.k, args.v, args.out, args.lse = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), \
        out.data_ptr(), lse.data_ptr()
    args.q_stride_b, args.q_stride_h, args.q_stride_n = q.stride()[:3]
    args.o_stride_b, args.o_stride_h, args.o_stride_n = out.stride()[:3]
    if block is not None:
        args.params = ctypes.addressof(block)
    kv = args.kv_cache
    kv.seqlens = cache_seqlens.data_ptr()
    kv.leftpad = cache_leftpad.data_ptr() if cache_leftpad is not None else None
    if block_table is not None:
        kv.block_table, kv.block_table_stride = block_table.data_ptr(), block_table.stride(0)
    if k is not None:
        kv.k_new, kv.v_new = k.data_ptr(), v.data_ptr()
        kv.kn_stride_b, kv.kn_stride_h, kv.kn_stride_n = k.stride()[:3]
        kv.vn_stride_b, kv.vn_stride_h, kv.vn_stride_n = v.stride()[:3]
    plan.fill(args, values)
    if plan.own:
        if plan.workspaces is not None:  # kept alive until the launches are enqueued (the allocator is stream-ordered)
            o_accum = q.new_empty(plan.workspaces[0], dtype=torch.float32)
            lse_accum = q.new_empty(plan.workspaces[1], dtype=torch.float32)
            if fill is not None:
                o_accum.fill_(fill)
                lse_accum.fill_(fill)
            kv.o_accum, kv.lse_accum = o_accum.data_ptr(), lse_accum.data_ptr()
        launch.check_status(plan.lib, "decode", launch.call_entry(plan.lib.decode, args, q))
    else:
        launch.check_status(plan.lib, "fwd", launch.call_entry(plan.lib.fwd, args, q))
    if plan.seqlen_new:
        torch.autograd.graph.increment_version(k_cache)
        torch.autograd.graph.increment_version(v_cache)
    return out, lse


def implementation_for(op):
    """The decode op's implementation for ``op`` (registered by runtime/library.py's
    ``register_kvcache``; ``with_kvcache`` calls it directly in eager mode): validation, the
    family (one with the 'decode' feature), the parameters, the launch. Two memos, neither
    holding a tensor (a CUDA graph's memory pool refuses live allocations that are not its
    outputs): the validated call by tensor metadata, and the launch plan by that metadata, the
    scale, the parameters (tensors' metadata, scalars' values) and the environment that selects
    libraries (runtime/plans.py ``call_key``): a call with a known key skips the validation, the
    family and split choices and the packing of the ABI block."""
    spec = op.spec
    checked: dict[tuple, KvCall] = Bounded()  # tensor metadata -> the validated call, without its tensors
    planned: dict[tuple, tuple[DecodePlan, tuple]] = Bounded()  # call_key -> (plan, validated scalar values)

    def implementation(q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad, scale, num_splits,
                       *values):
        tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad)
        try:
            key = (num_splits, *((t.dtype, t.device, t.shape, t.stride()) if t is not None else None
                                 for t in tensors))
            pkey = (key, plans.call_key(op, scale, values))
        except (AttributeError, TypeError):
            key = pkey = None
        hit = planned.get(pkey) if pkey is not None else None
        if hit is not None:
            plan, scalars = hit
            if plan.seqlen_new:  # pointers are no part of the key: checked on every call that writes
                _refuse_shared_cache(k_cache, v_cache)
            values = [x if isinstance(x, torch.Tensor) else s for x, s in zip(values, scalars, strict=True)]
            return run_plan(op, plan, q, k_cache, v_cache, cache_seqlens.contiguous(),
                            cache_leftpad.contiguous() if cache_leftpad is not None else None,
                            block_table.contiguous() if block_table is not None else None, k, v, values)
        call = checked.get(key) if key is not None else None
        if call is None:
            call = check_kvcache(op, q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_leftpad,
                                 num_splits)
            if key is not None:
                checked[key] = replace(call, cache_seqlens=None, cache_leftpad=None, block_table=None)
        else:  # the same metadata passed the checks: only the metadata tensors are this call's
            if call.seqlen_new:  # (pointers are not metadata)
                _refuse_shared_cache(k_cache, v_cache)
            call = replace(call, cache_seqlens=cache_seqlens.contiguous(),
                           cache_leftpad=cache_leftpad.contiguous() if cache_leftpad is not None else None,
                           block_table=block_table.contiguous() if block_table is not None else None)
        fam = op.choose_family(q.device, IR_DTYPE[q.dtype], call.head_dim, False, False, False, decode=True).family
        scale = op.scale_for(scale, call.head_dim)
        values = op.check_params(q, k_cache, {p.name: x for p, x in zip(spec.params, values, strict=True)},
                                 call.sizes())
        plan = make_plan(op, call, q, k_cache, v_cache, scale, values, fam, num_splits)
        if pkey is not None:
            planned[pkey] = (plan, tuple(None if isinstance(x, torch.Tensor) else x for x in values))
        return run_plan(op, plan, q, k_cache, v_cache, call.cache_seqlens, call.cache_leftpad, call.block_table, k, v,
                        values)

    return implementation
