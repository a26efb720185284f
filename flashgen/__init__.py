"""flashgen: attention-variant specs compiled into fused FlashAttention kernels for PyTorch."""

from .version import __version__

from . import reference
from .errors import BuildError, FlashgenError, KernelError, NotBuiltError, SpecError
from .families import use_family
from .runtime.launch import dropout_state
from .runtime.masks import block_mask
from .runtime.op import AttentionOp, compile
from .sparsity import BlockMask

__all__ = ["__version__", "AttentionOp", "BlockMask", "BuildError", "FlashgenError", "KernelError", "NotBuiltError", "SpecError", "block_mask", "compile",
           "dropout_state",
           "reference", "use_family"]
