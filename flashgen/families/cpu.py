"""The ``cpu`` family: the same FlashAttention algorithm on the CPU (templates/include/flashgen/cpu),
tiles sized for the caches per call (flashgen/families/cpu_tiles.py, passed in the argument
blocks), so the whole pipeline runs without a GPU."""

from __future__ import annotations

from ..build import artifact
from ..lang import ir
from ..lang.frontend import HEAD_DIM_MAX
from .base import FEATURES, Family
from .cpu_tiles import CpuTiles


def divisor_tile(block: int, cap: int) -> int:
    """The largest multiple of 8 that divides ``block`` and is at most ``cap``: a CPU tile for a
    block mask's block (tiles then never straddle two blocks)."""
    return max(t for t in range(8, min(block, cap) + 1, 8) if block % t == 0)


class CpuFamily(Family):
    name = "cpu"
    device = "cpu"
    dtypes = (ir.DType.FP32, ir.DType.BF16, ir.DType.FP16)
    head_dims = tuple(range(8, HEAD_DIM_MAX + 1, 8))
    features = frozenset(FEATURES)
    runtime_head_dim = True  # one library per dtype takes every head dim and both layouts

    def device_target(self, index: int | None) -> artifact.Target:
        return self.target(artifact.cpu_arch())

    def launch_fields(self, spec: ir.Spec) -> CpuTiles:
        return CpuTiles(spec)

    def block_tiles(self, config, block_size: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
        # The kernels take a divisor of the block size as their tiles, so tiles nest in blocks.
        bq, bk = block_size
        fr, fc = divisor_tile(bq, 256), divisor_tile(bk, 512)
        return fr, fc, fc, fr, fr, fc


FAMILY = CpuFamily()
