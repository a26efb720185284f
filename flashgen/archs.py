"""CUDA architecture names: the one rule from a compute capability to the build target's name.
A leaf module (no flashgen imports), so that the build, the tile rules and the tuning store's
metadata all name a GPU's architecture the same way."""

from __future__ import annotations


def cuda_arch(capability: tuple[int, int]) -> str:
    """'sm_90a' for Hopper (wgmma/setmaxnreg need the 'a' target), else 'sm_<major><minor>'
    (``capability``: (major, minor), as torch.cuda.get_device_capability returns it)."""
    major, minor = capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"
