"""The op surface under its public module name: ``flashgen.ops.compile``, ``AttentionOp``,
``dropout_state``, and which kernel families have dropout and packed (varlen) batches
(``DROPOUT_BACKENDS``, ``VARLEN_BACKENDS``). The code lives in flashgen/runtime (op.py: the op,
checks.py: validation, launch.py: kernel launches, library.py: torch.library registration,
masks.py: ``flashgen.block_mask``, loader.py: loading libraries).
"""

from .runtime.checks import TORCH_DTYPE, as_dtype, ranges_text, spec_dtypes
from .runtime.launch import dropout_state
from .runtime.op import DROPOUT_BACKENDS, VARLEN_BACKENDS, AttentionOp, announce, compile, invalidate_libraries

__all__ = ["DROPOUT_BACKENDS", "TORCH_DTYPE", "VARLEN_BACKENDS", "AttentionOp", "announce", "as_dtype", "compile",
           "dropout_state", "invalidate_libraries", "ranges_text", "spec_dtypes"]
