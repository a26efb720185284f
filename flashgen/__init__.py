"""flashgen: attention-variant specs compiled into fused FlashAttention kernels for PyTorch."""

from .version import __version__

from . import reference
from .errors import BuildError, FlashgenError, KernelError, NotBuiltError, SpecError, UntrustedPathError
from .families import use_family
from .merge import merge_attention
from .runtime.launch import dropout_state
from .runtime.masks import block_mask
from .runtime.op import AttentionOp, compile
from .sparsity import BlockMask
from .tune import tuner as _tuner  # noqa: F401 - plugs the first-use tuner into the op runtime

__all__ = ["__version__", "AttentionOp", "BlockMask", "BuildError", "FlashgenError", "KernelError", "NotBuiltError", "SpecError", "UntrustedPathError", "block_mask", "compile",
           "dropout_state", "merge_attention",
           "reference", "use_family"]
