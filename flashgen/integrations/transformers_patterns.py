"""Reading transformers' mask functions (flashgen.integrations.transformers' mask function uses
this): which pattern a mask function computes, causal or bidirectional, windowed or not, with
packed sequence ids or not, from the functions transformers builds (by identity, from their
closure cells, or, while torch.compile traces, from the torch calls they make on probe indices),
so that the attention function can run it as a spec instead of a materialised 4-D mask.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

TF: dict[str, object] = {}  # transformers' modules the traced functions use (``transformers_modules``)


def transformers_modules() -> dict[str, object]:
    """transformers' ``masking_utils`` and ``integrations.sdpa_attention``, imported once (by
    ``register``) outside any traced code: an import statement that dynamo traces is a graph
    break ("Bad import result") with some torch and transformers versions, at every mask and
    every fallback of a compiled model."""
    if not TF:
        from transformers import masking_utils
        from transformers.integrations import sdpa_attention

        TF.update(masking_utils=masking_utils, sdpa_attention=sdpa_attention)
    return TF


def _closure(fn) -> dict:
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def pattern(fn, device="cpu"):
    """("causal" | "bidirectional", packed sequence ids or None) for the mask functions
    transformers builds for causal, sliding-window and bidirectional layers (windows come to the
    attention function as ``sliding_window``), or None for any other pattern.

    transformers' own causal and bidirectional functions are recognised by identity. The
    patterns it composes (sliding windows, packed sequences) are closures it builds at every
    call, read from their closure cells (``composed_pattern``). While torch.compile traces,
    dynamo cannot read closure cells: the pattern is read first from the torch calls the
    function makes on probe indices (``traced_pattern``, on ``device``), which dynamo traces
    without a graph break; only a function not recognised there is read from its closure, outside
    the tracing (a graph break): one with a call dynamo does not pass to a torch function mode (the
    builtin ``abs`` of a bidirectional sliding window), or a pattern that falls back anyway."""
    mu = transformers_modules()["masking_utils"]

    if fn is mu.causal_mask_function:
        return "causal", None
    if fn is mu.bidirectional_mask_function:
        return "bidirectional", None
    if torch.compiler.is_compiling():
        traced = traced_pattern(fn, device)
        if traced is not None:
            return traced
    return composed_pattern(fn)


@torch.compiler.disable  # closure cells cannot be read while dynamo traces (it would see no pattern)
def composed_pattern(fn):
    """``pattern`` of a composed mask function (one of transformers' ``and_masks`` closures),
    read from its closure cells, outside torch.compile's tracing."""
    from transformers import masking_utils as mu

    qual = getattr(fn, "__qualname__", "")
    if qual == "and_masks.<locals>.and_mask":
        parts = _closure(fn).get("mask_functions")
        if not isinstance(parts, tuple) or len(parts) != 2:
            return None
        a, b = (getattr(p, "__qualname__", "") for p in parts)
        if a == "sliding_window_overlay.<locals>.inner_mask" and parts[1] is mu.causal_mask_function:
            return "causal", None
        if (a == "sliding_window_bidirectional_overlay.<locals>.inner_mask"
                and parts[1] is mu.bidirectional_mask_function):
            return "bidirectional", None
        if b == "packed_sequence_mask_function.<locals>.inner_mask":
            # packed sequences: the pattern on positions remapped into each sequence (newer
            # transformers), or on the row's own indices (as transformers 5.17 builds it): the same
            # mask, since a sequence's tokens are consecutive and its positions go up by one
            base = parts[0]
            if a == "remap_positions_for_packed_sequence.<locals>.inner_mask":
                base = _closure(parts[0]).get("mask_function")
            inner = pattern(base) if callable(base) else None
            ids = _closure(parts[1]).get("packed_sequence_mask")
            if inner is None or inner[1] is not None or not isinstance(ids, torch.Tensor):
                return None
            return inner[0], ids
    return None


class _Recorder(TorchFunctionMode):
    """Records the torch calls made under it: (name, args, kwargs, result), dunder names without
    their underscores ("__and__" -> "and"; in-place calls keep their trailing one)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name[:2] == "__" and name[-2:] == "__":  # (slices: dynamo does not trace str.startswith)
            name = name[2:-2]
        self.calls.append((name, args, kwargs, out))
        return out


def _term(x, calls, end: int, leaves, used: list):
    """The expression that computed ``x`` by the first ``end`` of the recorded ``calls`` from the
    probe tensors ``leaves`` ((name, tensor) pairs): (call name, *argument terms), a leaf's name,
    ("tensor", t) for any other tensor (a closure's), ("const", v) for any other value, a tuple of
    terms for a tuple or list; ("unknown",) for a call with keyword arguments (but new_ones).
    Appends the indices of the calls it uses to ``used``."""
    if isinstance(x, torch.Tensor):
        for i in range(end - 1, -1, -1):  # the last call that returned x (an in-place one shows)
            name, args, kwargs, out = calls[i]
            if out is x:
                used.append(i)
                if kwargs and name != "new_ones":
                    return ("unknown",)
                return (name, *(_term(a, calls, i, leaves, used) for a in args))
        for name, leaf in leaves:
            if x is leaf:
                return name
        return ("tensor", x)
    if isinstance(x, (tuple, list)):
        return tuple(_term(a, calls, end, leaves, used) for a in x)
    return ("const", x)


def _same(a, b) -> bool:
    """Terms ``a`` and ``b`` are the same (tensors: the same object)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _call(t, name: str, n: int) -> bool:
    """Term ``t`` is a call of ``name`` with ``n`` arguments."""
    return isinstance(t, tuple) and len(t) == n + 1 and t[0] == name


def _const(t, kind) -> bool:
    return _call(t, "const", 1) and type(t[1]) is kind


def _conjuncts(t, out: list) -> list:
    """The terms ``t`` ands together (``&`` flattened, ``.to(device)`` dropped, and without the
    all-True ``new_ones`` that and_masks starts from), appended to ``out``."""
    while _call(t, "to", 2) and _call(t[2], "const", 1) and isinstance(t[2][1], torch.device):
        t = t[1]
    if _call(t, "and", 2):
        _conjuncts(t[1], out)
        _conjuncts(t[2], out)
    elif not (isinstance(t, tuple) and len(t) > 0 and t[0] == "new_ones"):
        out.append(t)
    return out


def _base_kind(conj: list, q, kv):
    """"causal" for the conjuncts [kv <= q] and [kv > q - w, kv <= q] (any order, any int w),
    "bidirectional" for [q >= 0] and [|q - kv| <= w, q >= 0], None otherwise; ``q`` and ``kv``
    are the terms of the query's and the key's positions."""
    kinds = []
    for c in conj:
        if _same(c, ("le", kv, q)):
            kinds.append("causal")
        elif _call(c, "gt", 2) and _same(c[1], kv) and _call(c[2], "sub", 2) and _same(c[2][1], q) \
                and _const(c[2][2], int):
            kinds.append("window")
        elif _same(c, ("ge", q, ("const", 0))):
            kinds.append("bidirectional")
        elif _call(c, "le", 2) and _call(c[1], "abs", 1) and _same(c[1][1], ("sub", q, kv)) and _const(c[2], int):
            kinds.append("bidirectional window")
        else:
            return None
    kinds = tuple(sorted(kinds))
    if kinds in (("causal",), ("causal", "window")):
        return "causal"
    if kinds in (("bidirectional",), ("bidirectional", "bidirectional window")):
        return "bidirectional"
    return None


def _indexed(t, pos: str):
    """The tensor of the first term ``tensor[b, pos]`` within ``t``, or None."""
    if not isinstance(t, tuple):
        return None
    if _call(t, "getitem", 2) and _call(t[1], "tensor", 1) and _same(t[2], ("b", pos)):
        return t[1][1]
    for part in t[1:]:
        hit = _indexed(part, pos)
        if hit is not None:
            return hit
    return None


def _sequence_ids(c):
    """``ids`` for the term ``ids[b, q] == ids[b, kv]`` (either side first), else None."""
    if not _call(c, "eq", 2):
        return None
    for x, y in ((c[1], c[2]), (c[2], c[1])):
        ids = _indexed(x, "q")
        if ids is not None and _same(x, ("getitem", ("tensor", ids), ("b", "q"))) \
                and _same(y, ("getitem", ("tensor", ids), ("b", "kv"))):
            return ids
    return None


def traced_pattern(fn, device):
    """``pattern`` of a mask function from the torch calls it makes on probe indices (one-element
    int64 tensors b, h, q, kv on ``device``; for torch.compile, which traces these calls, where the
    closure cells that ``composed_pattern`` reads are out of reach). Recognises the expressions of
    transformers' causal, bidirectional, sliding-window and bidirectional-window functions, and
    their packed-sequence forms (``ids[b, q] == ids[b, kv]`` and the pattern, either on the row's
    indices ``q``, ``kv``, as transformers 5.17 builds it, or on positions remapped through one
    tensor ``p[b, q]``, ``p[b, kv]``, as newer releases do; the same mask, since the tokens of a
    sequence are consecutive and its positions go up by one); None for any other (a call it does
    not know, a keyword argument, a tensor from elsewhere, an in-place call, a call other than an
    index read whose result the returned mask does not use, such as a condition that picked the
    expression)."""
    leaves = tuple((name, torch.zeros(1, dtype=torch.int64, device=device)) for name in ("b", "h", "q", "kv"))
    recorder = _Recorder()
    with recorder:
        out = fn(*(t for _, t in leaves))
    if not isinstance(out, torch.Tensor):
        return None
    used = []
    term = _term(out, recorder.calls, len(recorder.calls), leaves, used)
    for i, (name, _, _, _) in enumerate(recorder.calls):
        # unused: index reads (a bidirectional mask ignores the remapped key position) and, outside
        # torch.compile, attribute reads such as .device; any other call may have chosen the result
        if i not in used and name not in ("getitem", "get"):
            return None
    conj = _conjuncts(term, [])
    ids, rest = None, []
    for c in conj:
        same = _sequence_ids(c) if ids is None else None
        if same is not None:
            ids = same
        else:
            rest.append(c)
    kind = _base_kind(rest, "q", "kv")
    if ids is None or kind is not None:  # unpacked, or packed on the row's own indices
        return None if kind is None else (kind, ids)
    p = _indexed(rest[0], "q") if rest else None
    if p is None:
        return None
    kind = _base_kind(rest, ("getitem", ("tensor", p), ("b", "q")), ("getitem", ("tensor", p), ("b", "kv")))
    return None if kind is None else (kind, ids)
