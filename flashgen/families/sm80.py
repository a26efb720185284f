"""The ``sm80`` family: FlashAttention-2 forward and backward on mma.sync tensor cores
(templates/include/flashgen/cuda), for sm_80 and newer; Ampere and Ada's family, and the
fallback for what a newer family does not serve. Its tiles are flashgen/tiles.py's; per call it
decides the backward's GQA split (``gqa_splits``), which the launcher reads from FgBwdArgs."""

from __future__ import annotations

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
    features = frozenset(FEATURES) - {"decode"}  # no decode (with_kvcache) kernels yet
    split_layouts = True
    dq_lists = True
    block_classifier = True
    tuned = True
    tile_keys = tile_rules.TILE_KEYS

    def __init__(self) -> None:
        self.tuning = Sm80Tuning(self)  # the autotuner's candidates (flashgen/families/sm80_tuning.py)

    def arch_reason(self, arch: str | None) -> str | None:
        if arch is None:
            return "needs a CUDA architecture"
        num = arch.removeprefix("sm_").rstrip("a")
        if arch != "any" and (not num.isdigit() or int(num) < 80):
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


class GqaSplit(LaunchFields):
    """sm80's per-call decision: FgBwdArgs.gqa_splits (1 for a deterministic call), from the
    key tile of the library's backward kernel (its config) and ``args.num_sms``."""

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


TILE_KEYS = tile_rules.TILE_KEYS
FAMILY = Sm80Family()
