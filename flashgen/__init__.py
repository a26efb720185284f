"""flashgen: attention-variant specs compiled into fused FlashAttention kernels for PyTorch."""

__version__ = "0.1.0"

from . import reference
from .errors import BuildError, FlashgenError, KernelError, SpecError
from .ops import AttentionOp, compile, dropout_state

__all__ = ["AttentionOp", "BuildError", "FlashgenError", "KernelError", "SpecError", "compile", "dropout_state",
           "reference"]
