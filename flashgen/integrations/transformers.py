"""Hugging Face transformers backend: ``attn_implementation="fgen"``.

``register()`` adds an attention function to ``transformers.AttentionInterface`` and a mask
function to ``transformers.AttentionMaskInterface`` under one name, so that

    import flashgen.integrations.transformers as fg_hf
    fg_hf.register()                                    # name="fgen"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fgen")
    # or: model.set_attn_implementation("fgen")

runs every attention layer through flashgen kernels (forward, backward, generation). The name
must not contain "flash": transformers takes any such name for a flash-attention package and
tries to load it (``set_attn_implementation`` then fails), so the default is "fgen".

What the two functions exchange is transformers' flash-attention contract: the mask function
returns a 2-D mask or None, never a materialised 4-D mask, and the attention function reads the
layer's ``is_causal``, ``sliding_window``, ``softcap``, ``scaling`` and ``dropout`` from its
arguments. The 2-D mask is one of

- None: every key is valid (no padding, no cache slots beyond the sequence);
- bool ``[batch, L]``: ``True`` keeps key ``j`` (left or right padding, holes too). ``L`` may be
  shorter than the layer's keys (a static cache holding ``L`` tokens so far): the keys past ``L``
  are dropped. A one-token decoding step on a static cache gets the cache's full length, its
  unwritten slots ``False`` (computed on the device from the cache's offset), so the shape stays
  the same from step to step;
- int32 ``[batch, seqlen]`` with negative values: packed sequences (``-1 - i`` for the ``i``-th
  sequence of a row), from ``position_ids`` that restart; the attention function makes a packed
  (varlen) call of them.

Queries are the last ``seqlen_q`` positions of the keys (causal masks bottom-right aligned, as in
FlashAttention ≥ 2.1 and transformers' caches). A decoding step (at most ``DECODE_MAX_QUERIES``
queries against more keys, no dropout, nothing recording a gradient) is the same call on
``op.with_kvcache`` with every key slot counted as cached: its split-KV decode kernels spread
the keys over the GPU where the prefill kernels would give each (sequence, head) one CTA. Explicit ``cu_seq_lens_q`` / ``cu_seq_lens_k``
(with ``max_length_q`` / ``max_length_k``) make a packed call as well.

Falls back, with one warning per reason naming it, to transformers' SDPA attention (or the
model's own eager attention where SDPA cannot compute the same thing: soft-capping, sinks,
``output_attentions``) for: 4-D masks (a user's float or bool mask), mask patterns transformers
builds that are not causal / sliding-window / bidirectional (e.g. chunked attention, image-token
overlays, block_sequence_ids), sinks (``s_aux``), ``position_bias``, ``output_attentions=True``,
value head dims that differ from the query's, head dims flashgen does not build and fp32 on CUDA.

Under torch.compile, transformers hands the mask function packed sequence ids for every
training call (its check for packing is data-dependent, so it is skipped while tracing); those
calls run in the padded layout with the ids as a per-token sequence mask, with no host read,
and with block lists classified once per step for every layer of one mask type
(``flashgen.integrations.transformers_blocks``).
Both functions trace without anything that changes from call to call (which would recompile
the model at every step) and without a graph break: the mask pattern is recognised from the torch
calls transformers' mask function makes on probe indices (dynamo cannot read its closure; only a
bidirectional sliding window, and patterns that fall back, are read from it at a graph break),
each attention call is its spec's registered torch op in the graph, and ``call_counts`` counts
only calls that run eagerly.

The specs it uses, ``specs/transformers_window.attn`` (no padding, no soft-capping),
``specs/transformers.attn`` (a key mask and ``softcap``), ``specs/transformers_packed.attn``
(sequence ids, under torch.compile) and ``specs/transformers_packed_plain.attn`` (its mask alone,
for layers without soft-capping and dropout: on sm90 its backward takes 128-row query tiles at
head_dim 64), are compiled once per process, at the first call that needs each, or together by
``build()``.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter

import torch
from torch._dynamo.comptime import comptime
from torch.utils.weak import WeakIdKeyDictionary

from .. import paths
from ..runtime.checks import as_device
from ..runtime.masks import classifier_library
from ..runtime.op import AttentionOp
from ..families.sm80 import DECODE_HEAD_DIMS
from ..runtime.op import compile as _compile
from . import transformers_blocks
from .transformers_patterns import TF as _tf  # (the names tests and the traced functions use)
from .transformers_patterns import composed_pattern as _composed_pattern  # noqa: F401
from .transformers_patterns import pattern as _pattern
from .transformers_patterns import traced_pattern as _traced_pattern  # noqa: F401
from .transformers_patterns import transformers_modules as _transformers

# A window wider than any sequence the kernels take (positions are below 2**30): "no bound".
UNBOUNDED = 1 << 30

SPECS = ("transformers", "transformers_window", "transformers_packed", "transformers_packed_plain")
PACKED_SPECS = ("transformers_packed", "transformers_packed_plain")  # sequence ids, with block lists

# Calls per path since the process started: spec names, and "fallback:<function>" (for tests and
# for checking which path a model's layers take). Only calls that run eagerly count: while
# torch.compile traces a call nothing is counted (see ``_count``), so the calls of a compiled
# model are not in these counters (which path they take is in the compiled graph: the flashgen
# op, or transformers' attention after a fallback warning).
call_counts: Counter[str] = Counter()
# Of those calls, the ones that ran as decoding steps through op.with_kvcache, per spec name.
kvcache_calls: Counter[str] = Counter()
# Of those calls, the ones that ran as packed (varlen) calls, from cu_seq_lens_q/k or from packed
# sequence ids (position_ids that restart), per spec name.
packed_calls: Counter[str] = Counter()
# Runs of the packed-sequence spec's block classification under torch.compile (one per training
# step and mask type, however many layers: transformers_blocks), compiled calls included.
block_list_calls = transformers_blocks.block_list_calls

# At most this many queries per row go to op.with_kvcache (split-KV decode kernels) when they
# are fewer than the keys; longer calls (a prefill, chunked prefill beyond it) take the prefill
# kernels, which parallelise over query tiles.
DECODE_MAX_QUERIES = 16

_ops: dict[str, AttentionOp] = {}
_ops_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()
_packed_cache = WeakIdKeyDictionary()  # packed sequence ids -> (version, cu_seqlens, max_seqlen)
# The 4-D masks mask_forward itself returned for a pattern without a spec (eager calls): the
# attention function falls back on them for that reason, not as for a user's 4-D mask.
_pattern_masks = WeakIdKeyDictionary()
_PATTERN_REASON = ("this mask pattern (an or/and overlay, chunked attention or block_sequence_ids) has no "
                   "flashgen spec")


def op(name: str) -> AttentionOp:
    """The compiled op of ``specs/<name>.attn`` (``name`` one of ``SPECS``), one per process."""
    if name not in SPECS:
        raise ValueError(f"name: expected one of {', '.join(SPECS)}, got {name!r}")
    hit = _ops.get(name)  # compiled already: no lock (which torch.compile cannot trace through)
    if hit is not None:
        return hit
    return _load(name)


transformers_blocks.bind(op)


@torch.compiler.disable  # parsing the spec and registering its torch op is never traced
def _load(name: str) -> AttentionOp:
    with _ops_lock:
        if name not in _ops:
            _ops[name] = _compile(paths.specs_dir() / f"{name}.attn")
        return _ops[name]


def _count(counter: Counter[str], name: str) -> None:
    """``counter[name] += 1``, except while torch.compile traces the call: dynamo would read the
    count into the compiled code as a constant, guard on it and, since every call changes it,
    compile the model afresh at every step (and, past its recompile limit, run it uncompiled)."""
    if not torch.compiler.is_compiling():
        counter[name] += 1


# Substrings transformers gives a meaning of its own in implementation names.
_RESERVED = ("flash", "sdpa", "flex_attention", "eager", "paged", "|", "/", ":", "@")


def build(device: torch.device | str = "cpu", dtypes=None, head_dims=None) -> None:
    """Compile the backend's specs for ``device`` ahead of the first model call, all at once (in
    parallel); ``dtypes`` and ``head_dims`` as in ``AttentionOp.build`` (packed layouts and the
    decode kernels of ``op.with_kvcache``, which decoding steps of up to DECODE_MAX_QUERIES
    queries run on, too, and the block-sparse kernels that the packed sequence ids of training
    under torch.compile run on, with the block classifier that makes their lists on CUDA).

    Raises ValueError as ``AttentionOp.build`` does (a device, dtype or head dim not served)."""
    from concurrent.futures import ThreadPoolExecutor

    layouts = ("padded", "packed")
    dev = as_device(device)
    with ThreadPoolExecutor(len(SPECS) + 1) as pool:
        # the packed-sequence specs run with block lists (transformers_blocks): their block-sparse kernels too
        jobs = [pool.submit(op(n).build, device, dtypes, head_dims, layouts=layouts,
                            sparse=(False, True) if n in PACKED_SPECS else (False,),
                            decode=n not in PACKED_SPECS) for n in SPECS]
        if dev.type == "cuda":  # the classifier flashgen.block_mask runs for those lists (transformers_blocks)
            jobs.append(pool.submit(classifier_library, op("transformers_packed"), dev))
        for job in jobs:
            job.result()


def register(name: str = "fgen") -> str:
    """Register flashgen's attention and mask functions with transformers under ``name``.

    After it, ``attn_implementation=name`` in ``from_pretrained`` / ``from_config``, or
    ``model.set_attn_implementation(name)``, runs the attention layers through flashgen.
    Registering again (under any name) is harmless. Also creates the backend's three ops (their
    specs parsed and torch ops registered, milliseconds; no kernel is built), so that a model under
    torch.compile never makes one while dynamo traces (a graph break). Returns ``name``.

    Raises TypeError when ``name`` is not a non-empty string, ValueError when it contains a part
    transformers interprets ("flash", "sdpa", "flex_attention", "eager", "paged", "|", "/", ":",
    "@": e.g. any name with "flash" is loaded as a flash-attention package), ImportError when
    transformers is missing or older than 4.53 (the first release with ``AttentionMaskInterface``).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty string, got {name!r}")
    bad = [part for part in _RESERVED if part in name]
    if bad:
        why = ("any name with 'flash' is loaded as a flash-attention package" if bad[0] == "flash" else
               "it names one of transformers' own implementations" if bad[0] in ("sdpa", "flex_attention", "eager")
               else "it is a prefix or separator of kernel-hub and paged implementations")
        raise ValueError(f"name: {name!r} contains {bad[0]!r}, which transformers interprets in attention "
                         f"implementation names ({why}); choose another, e.g. the default 'fgen'")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("flashgen.integrations.transformers needs transformers >= 4.53 (AttentionInterface "
                          f"and AttentionMaskInterface): {e}") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    _transformers()  # the modules the traced functions use, imported here rather than while dynamo traces
    for spec in SPECS:  # the ops (parsed specs, torch ops; no kernel yet): none is made while dynamo traces
        op(spec)
    return name




def _warn_once(reason: str, instead: str) -> None:
    """Warn once per reason and fallback (``instead``) that calls fall back. While torch.compile
    traces, the warning is given at trace time (``torch._dynamo.comptime``: no graph break, which
    ``warnings.warn`` in traced code would cost at every fallback call), so a compiled model warns
    when it is compiled."""
    if torch.compiler.is_compiling():
        comptime(_warn_at_trace)  # reads this frame's reason and instead
        return
    _warn_now(reason, instead, stacklevel=_caller_level(5))


def _warn_at_trace(ctx) -> None:
    """``_warn_once``'s warning, run by dynamo while it traces (a comptime function: no closure)."""
    _warn_now(ctx.get_local("reason").as_python_constant(), ctx.get_local("instead").as_python_constant(),
              stacklevel=2)


# Packages whose frames stand between a user's call of a model and the attention function.
_WRAPPERS = ("flashgen", "torch", "transformers", "kernels", "accelerate", "peft")


def _library_dirs() -> tuple[str, ...]:
    """The source directories of the imported _WRAPPERS (frames a warning skips)."""
    import os

    found = (sys.modules.get(name) for name in _WRAPPERS)
    return tuple(os.path.dirname(m.__file__) + os.sep for m in found if getattr(m, "__file__", None))


def _caller_level(default: int) -> int:
    """warnings.warn's stacklevel, counted from _warn_now, of the first frame outside _WRAPPERS
    (the user's code that called the model), so a fallback warning points there; ``default``
    when every frame is inside them."""
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1  # _caller_level's caller (_warn_once): level 2 from _warn_now
    while frame is not None:
        level += 1
        if not frame.f_code.co_filename.startswith(dirs):
            return level
        frame = frame.f_back
    return default


def _warn_now(reason: str, instead: str, stacklevel: int) -> None:
    if (reason, instead) in _warned:  # once per reason and the attention that runs instead
        return
    _warned.add((reason, instead))
    warnings.warn(f"flashgen.integrations.transformers: {reason}; running transformers' {instead} attention "
                  "for such calls instead (warned once)", stacklevel=stacklevel)


# --- the mask function ---------------------------------------------------------------------------

def mask_forward(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function for flashgen (``AttentionMaskInterface``).

    Args follow transformers' mask interface: ``q_offset`` (an int, or a 0-d int tensor for a
    static cache) and ``kv_offset`` are the positions of the first query and the first key slot,
    ``kv_length`` the number of key slots, ``attention_mask`` the 2-D bool padding mask
    ``[batch, seen tokens]`` or None, ``mask_function`` the pattern.

    Returns None, a 2-D bool mask ``[batch, L]`` of the key slots to keep, or int32 packed
    sequence ids ``[batch, seqlen]`` (see the module's docstring); for a pattern flashgen cannot
    express, the 4-D bool mask of transformers' ``sdpa_mask`` (the attention function then falls
    back to SDPA). Never synchronises with the device, except once for a multi-token call on a
    static cache (reading its offset: without an attention mask, or with one that may span the
    cache's every slot).
    """
    mu = _transformers()["masking_utils"]
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    device = kwargs.get("device", "cpu") if attention_mask is None else attention_mask.device
    config = kwargs.get("config")
    reason = contract_reason(getattr(config, "model_type", None),
                             getattr(config, "use_bidirectional_attention", False) is True,
                             getattr(config, "alibi", False) is True)

    def dense(maker, reason: str, **extra):  # transformers' own 4-D mask, remembered with the reason
        skips = ("allow_is_causal_skip", "allow_is_bidirectional_skip")  # (the dense masks never skip)
        out = maker(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                    kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **extra,
                    **{k: v for k, v in kwargs.items() if k not in skips})
        if isinstance(out, torch.Tensor) and not torch.compiler.is_compiling():
            _pattern_masks[out] = reason  # the attention function's fallback gives this reason
        return out

    if reason:  # the model's layers may not follow the 2-D mask contract: transformers' eager mask
        # warned here, as for a pattern without a spec: a model that rewrites the mask before its
        # attention (Falcon adds its ALiBi bias to it) hands the attention function a mask whose
        # reason it cannot name (the fallback's own warning of the same reason is not repeated)
        _warn_once(reason, "sdpa")
        return dense(mu.eager_mask, reason)
    pattern = _pattern(mask_function, device)
    if pattern is None:
        _warn_once(_PATTERN_REASON, "sdpa")
        return dense(mu.sdpa_mask, _PATTERN_REASON, allow_is_causal_skip=False)
    kind, packed = pattern
    if packed is not None:
        return (-1 - packed).to(torch.int32)
    if attention_mask is None and kind == "bidirectional":
        # every key slot holds a token: an encoder's, or cross-attention's encoder states, whose
        # kv_length has nothing to do with the queries' q_offset + q_length
        return None
    if attention_mask is None:  # batch rows of one mask (models may view it as [batch_size, -1])
        if not isinstance(q_offset, torch.Tensor):
            seen = int(q_offset) + q_length - kv_offset
            if seen >= kv_length:
                return None
            return torch.ones(1, seen, dtype=torch.bool, device=device).expand(batch_size, -1)
        if q_length == 1:  # a decoding step on a static cache: its written slots, on the device
            slots = torch.arange(kv_length, device=q_offset.device) + kv_offset
            return (slots < q_offset + q_length).unsqueeze(0).expand(batch_size, -1)
        seen = int(q_offset) + q_length - kv_offset  # one host read (a prefill on a static cache)
        return torch.ones(1, min(seen, kv_length), dtype=torch.bool, device=device).expand(batch_size, -1)
    end = None  # a causal mask's tokens so far, where it may span more (a static cache's every slot;
    # a bidirectional mask's columns are its keys: an encoder's, cross-attention's)
    if kind == "causal" and not isinstance(q_offset, torch.Tensor):
        end = int(q_offset) + q_length
    elif kind == "causal" and q_length > 1 and attention_mask.shape[-1] > q_length:
        end = int(q_offset) + q_length  # one host read (a multi-token call on a static cache)
    if end is not None and attention_mask.shape[-1] > end:
        # the columns past the last query's position are slots not written yet (the 2-D mask is
        # [batch, tokens so far]; eager reads a longer one from slot 0)
        attention_mask = attention_mask[:, :end]
    mask = attention_mask[:, -kv_length:]  # the key slots' part (sliding caches keep the last ones)
    if mask.dtype != torch.bool:
        mask = mask != 0
    if q_length == 1 and mask.shape[-1] < kv_length:  # a static cache: unwritten slots are False
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=False)
    return mask


# Models whose layers do not say what their masks do, though the model declares flash-attention
# support (transformers' own flash_attention_2 computes the same wrong result for them).
NOT_FLASH_CONTRACT = {
    "pegasus_x": "PegasusX's decoder self-attention layers declare is_causal=False and are made causal only by "
                 "a 4-D mask",
}
_contract_reasons: dict[tuple, str] = {}


@torch.compiler.assume_constant_result  # a constant of the traced graph: no graph break, no import traced
def contract_reason(model_type: str | None, bidirectional: bool = False, alibi: bool = False) -> str:
    """Why models of ``model_type`` (a config's) take transformers' eager 4-D masks and fall back
    instead of flashgen's 2-D masks, or '' when they follow flash-attention's contract (a layer's
    is_causal, sliding_window and the 2-D padding mask say everything): models whose class
    declares neither flash-attention nor SDPA support, and those of NOT_FLASH_CONTRACT. Unknown
    or composite model types: ''. Memoised per model type.

    The test is the model class's declared support: flash-attention's (the 2-D mask contract
    itself) or SDPA's (whose layers' is_causal must be right when transformers skips a causal
    mask); a class that declares neither (NLLB-MoE, BigBirdPegasus, Informer, Speech2Text, BLOOM,
    ...) may compute attention with its own code, reading the mask as a 4-D additive one.

    Two config flags also take eager masks: ``use_bidirectional_attention`` (Gemma's, PaliGemma's
    text model: the layers say is_causal=False while transformers' mask is causal on padded
    batches) and ``alibi`` (Falcon's: the model adds its ALiBi bias to the 4-D mask itself)."""
    key = (model_type, bidirectional, alibi)
    hit = _contract_reasons.get(key)
    if hit is not None:
        return hit
    reason = NOT_FLASH_CONTRACT.get(model_type, "") if model_type else ""
    if bidirectional and not reason:
        reason = (f"{model_type} with use_bidirectional_attention=True (its layers declare is_causal=False while "
                  "transformers' mask for them is causal where a batch is padded)")
    if alibi and not reason:
        reason = f"{model_type} with alibi=True (the model adds its ALiBi bias to a 4-D mask itself)"
    if model_type and not reason:
        try:
            import transformers
            from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

            name = MODEL_MAPPING_NAMES.get(model_type)
            name = name[0] if isinstance(name, tuple | list) else name
            cls = getattr(transformers, name, None) if name else None
        except Exception:  # a transformers without the auto mapping: trust the layers
            cls = None
        if cls is not None and not (getattr(cls, "_supports_flash_attn", True) or getattr(cls, "_supports_sdpa", True)):
            reason = (f"{cls.__name__} declares neither flash-attention nor SDPA support (its layers may not follow "
                      "the 2-D mask contract flashgen takes)")
    _contract_reasons[key] = reason
    return reason


# --- the attention function ----------------------------------------------------------------------

def _fallback_reason(module, query, key, value, attention_mask, s_aux, kwargs) -> str | None:
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"attention_mask of type {type(attention_mask).__name__} (expected a tensor or None)"
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
        if not torch.compiler.is_compiling() and attention_mask in _pattern_masks:
            return _pattern_masks[attention_mask]  # the mask function's own fallback, already warned for
        return f"a {attention_mask.dim()}-D attention_mask (flashgen takes 2-D padding masks)"
    if s_aux is not None:
        return "attention sinks (s_aux)"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    if kwargs.get("output_attentions"):
        return "output_attentions=True (flashgen never forms the attention weights)"
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return "value or key head dim differs from the query's"
    d = query.shape[-1]
    if d % 8 or d > 256:
        return f"head dim {d} (flashgen takes multiples of 8 up to 256)"
    if query.device.type == "cuda" and query.dtype == torch.float32:
        return "fp32 on cuda (flashgen's CUDA kernels take fp16 and bf16)"
    if query.device.type not in ("cpu", "cuda"):
        return f"{query.device.type} tensors"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    if not (query.dtype == key.dtype == value.dtype):
        return "query, key and value of different dtypes"
    if 0 in query.shape or 0 in key.shape:
        return "an empty query or key tensor"
    return None


def _dense_mask(mask, nq: int, nk: int, left: int, right: int, device) -> torch.Tensor | None:
    """The 4-D bool mask [batch | 1, 1, nq, nk] equal to what the kernels compute (fallbacks only)."""
    qi = torch.arange(nq, device=device)[:, None] + (nk - nq)
    kj = torch.arange(nk, device=device)[None, :]
    keep = (kj >= qi - left) & (kj <= qi + right)
    if mask is None:
        return keep[None, None]
    if mask.dtype == torch.bool:
        return keep[None, None] & mask[:, None, None, :]
    # packed sequence ids: positions within each sequence, same sequence only
    ids = mask
    start = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], dim=1)
    idx = torch.arange(ids.shape[1], device=device).expand_as(ids)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    pos = idx - first
    same = ids[:, :, None] == ids[:, None, :]
    rel = pos[:, None, :] - pos[:, :, None]  # kv - q within the sequence
    return (same & (rel >= -left) & (rel <= right))[:, None]


def _fallback(reason, module, query, key, value, attention_mask, *, dropout, scaling, sliding_window, softcap,
              is_causal, s_aux, kwargs):
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    need_eager = softcap is not None or s_aux is not None or kwargs.get("output_attentions")
    if need_eager and eager is None:
        raise NotImplementedError(f"flashgen.integrations.transformers: {reason}, and the model's module "
                                  f"{type(module).__module__} has no eager_attention_forward to fall back to")
    # transformers' sdpa and eager functions take 4-D masks; flashgen's 2-D ones and the causal or
    # windowed pattern of a None mask become the 4-D mask the kernels would have applied
    if attention_mask is None or attention_mask.dim() == 2:
        causal, left, right = _window(module, is_causal, sliding_window)
        nk = key.shape[2]
        if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[-1] < nk:
            nk = attention_mask.shape[-1]
            key, value = key[:, :, :nk], value[:, :, :nk]
        if attention_mask is not None or causal or left < UNBOUNDED:
            attention_mask = _dense_mask(attention_mask, query.shape[2], nk, left, right, query.device)
    if need_eager:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
        _warn_once(reason, "eager")
        _count(call_counts, "fallback:eager")
        extra = {"softcap": softcap} if softcap is not None else {}
        if s_aux is not None:
            extra["s_aux"] = s_aux
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **extra, **kwargs)
    sdpa_attention_forward = _transformers()["sdpa_attention"].sdpa_attention_forward
    _warn_once(reason, "sdpa")
    _count(call_counts, "fallback:sdpa")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=False if attention_mask is not None else is_causal, **kwargs)


def _autocast_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """query, key and value in autocast's dtype where an autocast is on for their device and one of
    them is a floating tensor of another dtype (as SDPA, which autocast runs in its lower-precision
    dtype, sees them: under bf16 autocast a rotary model's query and key come out of RoPE in fp32
    while its value is bf16); unchanged otherwise."""
    device = query.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return query, key, value
    dt = torch.get_autocast_dtype(device)
    if all(t.dtype == dt or not t.is_floating_point() for t in (query, key, value)):
        return query, key, value
    return tuple(t.to(dt) if t.is_floating_point() else t for t in (query, key, value))


def _window(module, is_causal, sliding_window) -> tuple[bool, int, int]:
    """(causal, left, right) of the kernels' window(left, right) for this layer.

    A causal window keeps the last ``sliding_window`` keys (left = sliding_window - 1). A
    bidirectional window keeps |q - kv| <= w, where w is the ``config.sliding_window`` that
    transformers' mask function (create_bidirectional_sliding_window_mask) reads: the layers'
    own argument follows two conventions (ModernBERT passes w + 1, for flash-attention's
    window_size = (sliding_window - 1, sliding_window - 1); T5Gemma's encoder passes w), so it
    only says whether the layer is windowed, except for a config without an int window."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    config = getattr(module, "config", None)
    causal = bool(causal) and getattr(config, "is_causal", True) is not False
    if causal:
        return True, (int(sliding_window) - 1 if sliding_window else UNBOUNDED), 0
    if sliding_window:
        w = getattr(config, "sliding_window", None)
        if isinstance(w, bool) or not isinstance(w, int):
            w = int(sliding_window)
        return False, w, w
    return False, UNBOUNDED, UNBOUNDED


def _decodes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout) -> bool:
    """Whether a padded call is a decoding step for ``op.with_kvcache``: at most
    DECODE_MAX_QUERIES queries and more keys than queries, no dropout, nothing that records a
    gradient (decoding is inference only), and on CUDA a head dim the decode kernels take (sm80's
    DECODE_HEAD_DIMS; the others run the prefill kernels, with the same result). Under an
    autocast the call's q, k and v are already in autocast's dtype (``_autocast_inputs``), so
    with_kvcache, which computes in the cache's dtype, computes in it as the prefill op would."""
    # the gradient and dropout tests first: a training call never compares its lengths (under
    # torch.compile with dynamic shapes, each comparison is a guard that may recompile)
    if dropout or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
        return False
    nq, nk = query.shape[2], key.shape[2]
    if nq > DECODE_MAX_QUERIES or nq >= nk:
        return False
    return query.device.type == "cpu" or query.shape[-1] in DECODE_HEAD_DIMS


def _packed_from_ids(ids: torch.Tensor):
    """(cu_seqlens int32 [n + 1], max_seqlen) of packed sequence ids [batch, seqlen], flattened
    row-major; one host read per ids tensor (cached)."""
    hit = _packed_cache.get(ids)
    if hit is not None and hit[0] == ids._version:
        return hit[1], hit[2]
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = start.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    total = torch.tensor([ids.numel()], dtype=torch.int32, device=ids.device)
    cu = torch.cat([starts, total])
    max_len = int((cu[1:] - cu[:-1]).max())
    _packed_cache[ids] = (ids._version, cu, max_len)
    return cu, max_len


def _as_cu(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D integer tensor of cumulative sequence lengths, got {t!r}")
    return t.to(torch.int32)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention function for flashgen (``AttentionInterface``).

    Args:
        module: the attention layer (``is_causal``, ``config`` are read from it).
        query: [B, Hq, Sq, d]; key, value: [B, Hkv, Sk, d] (Hq a multiple of Hkv); fp32 (cpu),
            fp16 or bf16. Queries are the last Sq positions of the keys.
        attention_mask: what ``mask_forward`` returned (None, 2-D bool, packed ids), or a 4-D
            mask (falls back to SDPA / eager).
        dropout: attention dropout probability (training).
        scaling: softmax scale (default 1/sqrt(d)).
        sliding_window: the layer's window: causal layers see the last ``sliding_window`` keys.
        softcap: ``softcap * tanh(score / softcap)`` (Gemma 2).
        is_causal: overrides ``module.is_causal``.
        s_aux: attention sinks (falls back to the model's eager attention).
        kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` make a
            packed call; others are passed to fallbacks only.

    Returns ``(out [B, Sq, Hq, d], None)`` (the attention weights only from an eager fallback).

    Raises ValueError naming the argument for a mask longer than the keys, or for a padding mask
    combined with ``cu_seq_lens_q``.
    """
    query, key, value = _autocast_inputs(query, key, value)
    reason = _fallback_reason(module, query, key, value, attention_mask, s_aux, kwargs)
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, s_aux=s_aux,
                         kwargs=kwargs)
    batch, heads, nq, d = query.shape
    nk = key.shape[2]
    mask = attention_mask
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = seq_ids = None
    if cu_q is not None or cu_k is not None:
        if mask is not None and mask.dtype == torch.bool:
            raise ValueError("cu_seq_lens_q: packed sequences with a 2-D padding attention_mask (pass one or "
                             "the other)")
        if nq != nk:
            raise ValueError(f"cu_seq_lens_q: packed sequences need as many keys as queries (got {nq} queries "
                             f"and {nk} keys)")
        cu_q = _as_cu(cu_q if cu_q is not None else cu_k, "cu_seq_lens_q")
        cu_k = _as_cu(cu_k if cu_k is not None else cu_q, "cu_seq_lens_k")
        mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        mq = int(mq) if mq is not None else int((cu_q[1:] - cu_q[:-1]).max())
        mk = int(mk) if mk is not None else int((cu_k[1:] - cu_k[:-1]).max())
        packed = (cu_q, cu_k, mq, mk)
        mask = None
    elif mask is not None and mask.dtype != torch.bool:  # packed sequence ids from the mask function
        if mask.shape != (batch, nq) or nq != nk:
            raise ValueError(f"attention_mask: packed sequence ids of shape {tuple(mask.shape)} for {batch} rows "
                             f"of {nq} queries and {nk} keys")
        if torch.compiler.is_compiling():
            # Under torch.compile transformers builds these ids for every training call (one
            # sequence per row when nothing is packed): a padded call that keeps each query to
            # its own sequence's keys (specs/transformers_packed.attn), with no host read.
            seq_ids = mask.to(torch.int32)
        else:
            cu, max_len = _packed_from_ids(mask)
            packed = (cu, cu, max_len, max_len)
        mask = None
    if mask is not None:
        if mask.shape[-1] > nk:
            raise ValueError(f"attention_mask: {mask.shape[-1]} key positions for {nk} keys")
        if mask.shape[0] not in (1, batch):
            raise ValueError(f"attention_mask: batch {mask.shape[0]} for {batch} rows")
        if mask.shape[-1] < nk:  # a static cache holding fewer tokens than its slots
            nk = mask.shape[-1]
            key, value = key[:, :, :nk], value[:, :, :nk]
    _, left, right = _window(module, is_causal, sliding_window)
    general = mask is not None or softcap is not None
    if seq_ids is not None:  # without soft-capping or dropout: the mask alone (faster backward tiles on sm90)
        name = "transformers_packed" if softcap or dropout else "transformers_packed_plain"
    else:
        name = "transformers" if general else "transformers_window"
    params = {"left": left, "right": right}
    run = {"scale": scaling}
    if dropout:
        run["dropout_p"] = float(dropout)
    if packed is None:
        q, k, v = query, key, value
    else:
        q = query.transpose(1, 2).reshape(batch * nq, heads, d)
        k = key.transpose(1, 2).reshape(batch * nk, key.shape[1], d)
        v = value.transpose(1, 2).reshape(batch * nk, value.shape[1], d)
        cu_q, cu_k, mq, mk = packed
        run.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    if seq_ids is not None:
        params["seq_id"] = seq_ids
        if name == "transformers_packed":
            params["softcap"] = float(softcap) if softcap else 0.0
    elif general:
        if mask is None:
            width = packed[3] if packed is not None else nk
            mask = torch.ones(1, width, dtype=torch.bool, device=query.device)
        params.update(key_mask=mask, softcap=float(softcap) if softcap else 0.0)
    _count(call_counts, name)
    if packed is not None:
        _count(packed_calls, name)
    if packed is None and seq_ids is None and _decodes(query, key, value, dropout):
        # The last nq positions of nk keys: exactly with_kvcache's call with nk cached keys and
        # no append (positions, the window and the key mask index the same slots as the prefill
        # call's bottom-right alignment), on the split-KV decode kernels.
        _count(kvcache_calls, name)
        lens = torch.full((batch,), nk, dtype=torch.int32, device=query.device)
        out = op(name).with_kvcache(query, key, value, cache_seqlens=lens, scale=scaling, **params)
        return out.transpose(1, 2), None
    if seq_ids is not None and transformers_blocks.enabled():
        out = transformers_blocks.packed_attention(op(name), q, k, v, scaling, float(dropout or 0.0), params)
        return out.transpose(1, 2), None
    out = op(name)(q, k, v, **run, **params)
    if packed is not None:
        return out.view(batch, nq, heads, d), None
    return out.transpose(1, 2), None
