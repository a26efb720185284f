"""The ``sm80`` family: FlashAttention-2 forward and backward on mma.sync tensor cores
(templates/include/flashgen/cuda), for sm_80 and newer; Ampere and Ada's family, and the
fallback for what a newer family does not serve. Its tiles are flashgen/tiles.py's."""

from __future__ import annotations

from .. import tiles as tile_rules
from ..build import artifact
from ..lang import ir
from ..lang.frontend import HEAD_DIM_MAX
from .base import FEATURES, Family
from .sm80_tuning import Sm80Tuning


class Sm80Family(Family):
    name = "sm80"
    device = "cuda"
    dtypes = (ir.DType.FP16, ir.DType.BF16)
    head_dims = tuple(range(8, HEAD_DIM_MAX + 1, 8))
    features = frozenset(FEATURES)
    split_layouts = True
    dq_lists = True
    block_classifier = True
    tuned = True

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

    def block_tiles(self, config, block_size: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
        fwd, bwd, dq = tile_rules.from_config(config())
        return fwd.block_m, fwd.block_n, bwd.block_n, bwd.block_m, dq.block_m, dq.block_n


TILE_KEYS = tile_rules.TILE_KEYS
FAMILY = Sm80Family()
