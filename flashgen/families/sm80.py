"""The ``sm80`` family: FlashAttention-2 forward and backward on mma.sync tensor cores
(templates/include/flashgen/cuda), for sm_80 and newer; Ampere and Ada's family, and the
fallback for what a newer family does not serve. Its tiles are flashgen/tiles.py's; per call it
decides the backward's GQA split (``gqa_splits``), which the launcher reads from FgBwdArgs, and a
decode call's split-KV count (``decode_splits``, FgKvCache.num_splits). Its decode kernels
(templates/include/flashgen/cuda/decode.cuh, op.with_kvcache) are instantiations of their own
(config ("decode", 1), ``decode_instantiation``), so a prefill build never compiles them."""

from __future__ import annotations

from dataclasses import replace

from .. import env
from .. import tiles as tile_rules
from ..build import artifact
from ..lang import ir
from ..lang.frontend import HEAD_DIM_MAX
from .base import FEATURES, Family, LaunchFields
from .sm80_tuning import Sm80Tuning


class Sm80Family(Family):
    name = "sm80"
    device = "cuda"
    dtypes = (ir.DType.FP16, ir.DType.BF16)
    head_dims = tuple(range(8, HEAD_DIM_MAX + 1, 8))
    features = frozenset(FEATURES)  # decode: at DECODE_HEAD_DIMS only (``declines``)
    split_layouts = True
    dq_lists = True
    block_classifier = True
    tuned = True
    tile_keys = tile_rules.TILE_KEYS

    def __init__(self) -> None:
        self.tuning = Sm80Tuning(self)  # the autotuner's candidates (flashgen/families/sm80_tuning.py)

    def declines(self, spec: ir.Spec, call) -> str | None:
        why = super().declines(spec, replace(call, features=call.features - {"decode"}))
        if why or "decode" not in call.features:
            return why
        if call.head_dim not in DECODE_HEAD_DIMS:
            return (f"has no decode kernels (with_kvcache) at head_dim {call.head_dim} (it takes multiples of 16 "
                    "up to 256)")
        return None

    def decode_instantiation(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int) -> artifact.Instantiation:
        return artifact.Instantiation(spec, self.target(arch), dtype, head_dim,
                                      tuple(sorted(decode_tile(arch, head_dim).items())))

    def arch_reason(self, arch: str | None) -> str | None:
        if arch is None:
            return "needs a CUDA architecture"
        if arch != "any" and _arch_number(arch) < 80:
            return f"needs compute capability 8.0 or newer (mma.sync bf16), not {arch}"
        return None

    def device_target(self, index: int | None) -> artifact.Target:
        return self.target(artifact.cuda_arch_of(index))

    def choose_tiles(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, seqlen: int | None = None, *,
                     sparse: bool = False, device_index: int | None = None, use_tuned: bool = True,
                     fingerprint: str | None = None) -> tile_rules.Choice:
        # flashgen.tiles' choice (env > tuned > table > derived); block-sparse calls pass seqlen None
        return tile_rules.choose(spec, "sm_90a" if arch == "any" else arch, dtype, head_dim, seqlen,
                                 device_index=device_index, use_tuned=use_tuned, fingerprint=fingerprint)

    def tiles_text(self, config: dict) -> str:
        if not all(k in config for k in TILE_KEYS):
            return ""
        f, b, q = tile_rules.from_config(config)
        return f"tiles fwd {f} bwd {b} dq {q}"

    def config(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int | None, *, packed: bool = False,
               sparse: bool = False, tiles: dict | None = None) -> tuple[tuple[str, int], ...]:
        cfg = dict(tiles or {})
        if head_dim is not None:  # (the block classifier, config mask=1, has no tiles)
            missing = [k for k in TILE_KEYS if k not in cfg]
            if missing:  # 'any' (generated/) renders the sm_90a choice
                default = tile_rules.default_choice(spec, "sm_90a" if arch == "any" else arch, head_dim).config()
                cfg.update({k: default[k] for k in missing})
        if packed:
            cfg["varlen"] = 1
        if sparse:
            cfg["sparse"] = 1
        return tuple(sorted(cfg.items()))

    def classifier(self, spec: ir.Spec, arch: str) -> artifact.Instantiation:
        """The block classifier of ``spec`` (flashgen.block_mask and per-call block lists on
        CUDA): a small library of its own."""
        return artifact.Instantiation(spec, self.target(arch), self.dtypes[0], None, (("mask", 1),))

    def launch_fields(self, spec: ir.Spec) -> GqaSplit:
        return GqaSplit()

    def block_tiles(self, config, block_size: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
        fwd, bwd, dq = tile_rules.from_config(config())
        return fwd.block_m, fwd.block_n, bwd.block_n, bwd.block_m, dq.block_m, dq.block_n


def gqa_splits(num_n_tiles: int, heads_kv: int, batch: int, group: int, sms: int) -> int:
    """The backward's GQA split: how many CTAs share the ``group`` query heads of a kv head (each
    adds its heads' dK, dV into fp32 workspaces). When the work items (``num_n_tiles`` key tiles ×
    ``heads_kv`` × ``batch``) fill at most half of the ``sms`` multiprocessors, the largest divisor
    s of the group with items · s ≤ sms; else 1. The launcher (cuda/bwd.cuh) takes it from
    FgBwdArgs.gqa_splits on its non-deterministic path; explain reports it."""
    splits = 1
    items = num_n_tiles * heads_kv * batch
    if group > 1 and 2 * items <= sms:
        for s in range(2, group + 1):
            if group % s == 0 and items * s <= sms:
                splits = s
    return splits


# ------------------------------------------------------------------ decode (with_kvcache)

# Head dims of the decode kernels (cuda/decode.cuh: mma k-steps of 16 over d, no padding).
DECODE_HEAD_DIMS = tuple(range(16, 257, 16))
MAX_DECODE_SPLITS = 128  # what decode_splits chooses or accepts at most
# decode_splits never gives a split more than this many keys of the capacity (mixed lengths: a
# batch of 64 with lengths 1..32K in a 32K cache ran at 0.34x the bandwidth of a uniform batch
# with one split, the longest sequences' CTAs alone at the end; docs/perf-notes.md)
SPLIT_KEYS = 4096
# The decode kernel without FLASHGEN_CUDA_DECODE_KEYS: the GQA group's query rows on the tensor
# cores' M side (False, cuda/decode.cuh) or the keys (True, cuda/decode_keys.cuh)
DECODE_KEYS_DEFAULT = False
_ROWS = 16  # query rows per decode CTA (one m16 tile of the GQA group's group x Sq rows)
def _arch_number(arch: str) -> int:
    """90 for 'sm_90a', 80 for 'sm_80'; -1 for a name that is not sm_<digits>[a]."""
    num = arch.removeprefix("sm_").rstrip("a")
    return int(num) if num.isdigit() else -1


_BULK_BARRIER_BYTES = 32  # the bulk variant's mbarriers: 8 bytes per stage (up to 4), after the rest


def decode_smem(head_dim: int, block_n: int, stages: int, bulk: int = 0, keys: bool = False) -> int:
    """Dynamic shared memory of a decode CTA (bytes; cuda/decode.cuh DecodeKernel::kSmem, or
    cuda/decode_keys.cuh DecodeKeysKernel::kSmem with ``keys``, each static_asserting that it
    equals this figure, rendered into the unit): Q (16 rows; none with ``keys``, whose Q lives in
    registers) and ``stages`` K/V tiles of ``block_n`` rows at a pitch of d + 8 elements (2
    bytes), or the warps' fp32 merge buffer of 16 rows after the loop, whichever is larger; with
    ``bulk`` (the bulk-copy variant, FLASHGEN_CUDA_DECODE_BULK) 32 bytes more after that for the
    stages' mbarriers."""
    pitch = head_dim + 8
    pipe = (0 if keys else _ROWS * pitch * 2) + stages * 2 * block_n * pitch * 2
    warps = block_n // 16
    merge = warps * _ROWS * (head_dim + 4) * 4 + 3 * warps * _ROWS * 4
    return max(pipe, merge) + (_BULK_BARRIER_BYTES if bulk else 0)


def decode_tile(arch: str, head_dim: int) -> dict[str, int]:
    """The decode instantiation's config: ``decode_block_n`` keys per stage (16 per warp: 64 or
    32), ``decode_stages`` (3 or 2), ``decode_smem``. The first of 64 x 3, 64 x 2, 32 x 3,
    32 x 2 that lets two CTAs share a multiprocessor's shared memory on ``arch`` (a memory-bound
    kernel wants bytes in flight), else the first that fits one CTA. FLASHGEN_CUDA_DECODE_TILE
    (env.cuda_decode_tile) forces another: ValueError naming it when that tile is not one (32, 64
    or 128 keys, 2 to 4 stages, within the shared memory). FLASHGEN_CUDA_DECODE_BULK=1 or 2
    (env.cuda_decode_bulk) adds ``decode_bulk`` (the K/V tiles loaded by TMA bulk copies; its
    mbarriers in ``decode_smem``): ValueError naming it for an ``arch`` below sm_90, which has no
    bulk copies. ``decode_keys`` 1 (FLASHGEN_CUDA_DECODE_KEYS=1, env.cuda_decode_keys; the keys
    on the tensor cores' M side, cuda/decode_keys.cuh): ValueError when asked for together with
    the bulk variant. Without either, the config has neither key (the unit renders as without
    them)."""
    optin = tile_rules.arch_info("sm_90a" if arch == "any" else arch).smem_optin
    bulk = env.cuda_decode_bulk()
    if bulk:
        if arch != "any" and _arch_number(arch) < 90:
            raise ValueError(f"FLASHGEN_CUDA_DECODE_BULK={bulk}: the bulk-copy decode kernel needs sm_90 or newer "
                             f"(cp.async.bulk, mbarrier transaction counts), not {arch}; unset it for this device")
    keys = env.cuda_decode_keys()
    if keys and bulk:
        raise ValueError(f"FLASHGEN_CUDA_DECODE_KEYS=1 and FLASHGEN_CUDA_DECODE_BULK={bulk}: the keys-major decode "
                         "kernel loads by cp.async only; unset one of them")
    keys = bool(keys) if keys is not None else DECODE_KEYS_DEFAULT and not bulk
    extra = {"decode_bulk": bulk} if bulk else {}
    if keys:
        extra["decode_keys"] = 1
    forced = dict(env.cuda_decode_tile())
    if forced:
        n, st = forced["decode_block_n"], forced["decode_stages"]
        smem = decode_smem(head_dim, n, st, bulk, keys)
        if n not in (32, 64, 128) or not 2 <= st <= 4 or smem > optin:
            raise ValueError(f"FLASHGEN_CUDA_DECODE_TILE: {n}x{st} is not a decode tile at head_dim {head_dim} on "
                             f"{arch} (keys 32, 64 or 128, 2 to 4 stages, within {optin:,} B of shared memory: "
                             f"{smem:,} B)")
        return {"decode": 1, "decode_block_n": n, "decode_stages": st, "decode_smem": smem, **extra}
    options = [(n, st) for n in (64, 32) for st in (3, 2)]
    fits = [o for o in options if 2 * (decode_smem(head_dim, *o, bulk, keys) + 1024) <= optin + 1024] or \
        [o for o in options if decode_smem(head_dim, *o, bulk, keys) <= optin] or [options[-1]]
    n, st = fits[0]
    return {"decode": 1, "decode_block_n": n, "decode_stages": st,
            "decode_smem": decode_smem(head_dim, n, st, bulk, keys), **extra}


def decode_tile_rows(config: dict, head_dim: int, rows: int) -> int:
    """Query rows per decode CTA for ``rows`` = GQA group x Sq rows of one kv head (as
    cuda/decode_launch.cuh's launch_decode chooses them): 16, or with ``decode_keys`` 8 where the
    rows fit in 8 or the head dim is above 128, else 16."""
    if config.get("decode_keys") and (rows <= 8 or (head_dim or 0) > 128):
        return 8
    return _ROWS


def decode_ctas_per_sm(arch: str, config: dict) -> int:
    """Decode CTAs that fit one multiprocessor's shared memory (1 to 2: registers bound the rest)."""
    optin = tile_rules.arch_info("sm_90a" if arch == "any" else arch).smem_optin
    return max(1, min(2, (optin + 1024) // (config["decode_smem"] + 1024)))


def decode_splits(batch: int, heads_kv: int, m_tiles: int, capacity: int, block_n: int, sms: int, per_sm: int,
                  requested: int = 0, keys: int | None = None) -> int:
    """The split-KV count of a decode call, from host-known shapes only (never the device-side
    lengths): at most one split per ``block_n`` keys of the span and MAX_DECODE_SPLITS. The span
    is the ``capacity``, or ``keys`` where smaller: a host-known bound on the keys one row tile
    can keep (a sliding window's width plus Sq - 1; runtime/decode.py ``key_span``), which the
    kernel's cut of the tile's own key range never exceeds, so that a window in a long cache is
    split as it is in a cache of its own size.
    ``requested`` >= 1 (num_splits=n): n within those bounds (1: no split, out written
    directly). 0 chooses: with ``batch`` x ``heads_kv`` x ``m_tiles`` CTAs per split and
    ``sms`` x ``per_sm`` CTA slots per wave, the smallest count whose last wave is at least 85%
    as full as the best count's (FlashAttention's rule); 1 when the CTAs already fill the GPU;
    and never fewer than one split per SPLIT_KEYS keys of the span, so that in a batch of
    mixed lengths no CTA streams more than SPLIT_KEYS keys of one long sequence while the
    short ones have finished (the device gives a short sequence's surplus splits no work).
    The kernel then cuts each sequence's own key range into that many pieces on the device."""
    span = capacity if keys is None else max(0, min(capacity, keys))
    limit = max(1, min(MAX_DECODE_SPLITS, -(-span // block_n)))
    if requested >= 1:
        return min(requested, limit)
    ctas = batch * heads_kv * m_tiles
    slots = max(1, sms) * max(1, per_sm)
    floor = min(limit, max(1, -(-span // SPLIT_KEYS)))
    if ctas <= 0:
        return 1
    if ctas >= slots:
        return floor

    def eff(s: int) -> float:
        n = ctas * s
        return n / (-(-n // slots) * slots)

    best = max(eff(s) for s in range(1, limit + 1))
    return max(floor, next(s for s in range(1, limit + 1) if eff(s) >= 0.85 * best))


class GqaSplit(LaunchFields):
    """sm80's per-call decisions: FgBwdArgs.gqa_splits (1 for a deterministic call), from the
    key tile of the library's backward kernel (its config) and ``args.num_sms``; and a decode
    call's FgKvCache.num_splits (``kv_splits``)."""

    def __init__(self) -> None:
        self.block_n: dict[tuple, int] = {}  # config -> the backward main kernel's key tile

    def bwd(self, args, values, config) -> None:
        block_n = self.block_n.get(config)
        if block_n is None:
            block_n = self.block_n[config] = tile_rules.from_config(dict(config))[1].block_n
        hkv = args.heads_kv
        if args.deterministic or hkv <= 0:
            args.gqa_splits = 1
            return
        args.gqa_splits = gqa_splits(-(-args.seqlen_k // block_n), hkv, args.batch, args.heads_q // hkv,
                                     args.num_sms)


    def kv_splits(self, args, inst, requested: int, keys: int | None = None) -> int:
        cfg = dict(inst.config)
        hkv = args.heads_kv
        group = args.heads_q // hkv if hkv > 0 else 0
        m_tiles = -(-group * args.seqlen_q // decode_tile_rows(cfg, inst.head_dim, group * args.seqlen_q))
        return decode_splits(args.batch, hkv, m_tiles, args.kv_cache.capacity, cfg["decode_block_n"], args.num_sms,
                             decode_ctas_per_sm(inst.target.arch, cfg), requested, keys)


TILE_KEYS = tile_rules.TILE_KEYS
FAMILY = Sm80Family()
