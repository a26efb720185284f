"""flashgen: attention-variant specs compiled into fused FlashAttention kernels for PyTorch."""

__version__ = "0.1.0"

from . import reference
from .errors import BuildError, FlashgenError, KernelError, NotBuiltError, SpecError
from .families import use_family
from .ops import AttentionOp, compile, dropout_state
from .sparsity import BlockMask, block_mask
from .tune import tuner as _tuner  # noqa: F401 - plugs the first-use tuner into the op runtime

__all__ = ["AttentionOp", "BlockMask", "BuildError", "FlashgenError", "KernelError", "NotBuiltError", "SpecError", "block_mask", "compile",
           "dropout_state",
           "reference", "use_family"]
