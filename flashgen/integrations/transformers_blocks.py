"""Block lists of ``specs/transformers_packed.attn`` and ``specs/transformers_packed_plain.attn``
(the same mask without soft-capping or dropout) under torch.compile, one classification per
training step (flashgen.integrations.transformers).

Under torch.compile transformers hands every training call packed-sequence ids, which the
backend runs as a padded call of the packed-sequence spec: a query sees the keys of its own
sequence inside the layer's window. That mask has no closed-form key range, so without block
lists each call would classify its blocks on the device and build its lists with a dozen small
torch ops, in the forward and again in the backward, in every layer. Instead the attention
function calls ``flashgen::hf_packed_block_lists`` with the same arguments in every layer of
one mask type (the step's sequence ids, the window and the tiles, a constant of the graph), so
AOTAutograd's common-subexpression pass keeps one call per step, and each layer's op takes the
lists (``block_kv``, ``block_q``, ``block_dq``) as a block-sparse call would from a
``flashgen.block_mask``. (With a torch.compile backend that runs no AOTAutograd, dynamo's
"eager", the op runs once per layer and step, its backward reusing the forward's lists.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from .. import env
from ..runtime import blocks
from ..runtime.launch import dropout_state
from ..runtime.masks import block_mask
from ..runtime.op import AttentionOp
from ..sparsity import mask_has_float

BLOCK = 128  # the block size the sequence-id mask is classified at (fits every family's tiles)
SPEC = "transformers_packed"

# Runs of the classification (``_lists``), compiled calls included: it runs at run time only,
# as an opaque op of the graph.
block_list_calls: Counter[str] = Counter()

_op: list[Callable[[str], AttentionOp]] = []  # the backend's op(name), set by bind()


def bind(op: Callable[[str], AttentionOp]) -> None:
    """Give this module the backend's ``op(name)`` (one compiled op per spec and process)."""
    _op[:] = [op]


def _lists(seq_id: torch.Tensor, left: int, right: int, tiles: list[int]):
    """(block_kv, block_q, block_dq) for sequence ids ``seq_id`` int32 [batch, seqlen] and the
    window (left, right): the lists of ``flashgen.block_mask`` (classified at BLOCK × BLOCK) for
    ``tiles`` = (forward rows, cols, backward rows, cols, dq rows, cols, grad, dq), those not asked
    for empty."""
    fr, fc, br, bc, dr, dc, grad, use_dq = tiles
    n = seq_id.shape[1]
    block_list_calls[SPEC] += 1
    bm = block_mask(_op[0](SPEC), n, n, batch=seq_id.shape[0], block_size=BLOCK, device=seq_id.device,
                    seq_id=seq_id, left=int(left), right=int(right), softcap=0.0)
    def none():  # a fresh empty tensor per output (outputs must not alias each other)
        return torch.empty(0, dtype=torch.int32, device=seq_id.device)

    # The lists are the new mask's own tensors (cached per tile size and orientation): returned
    # without a copy, except dq lists at the forward's tiles, the same tensor as block_kv.
    block_kv = bm.tile_lists(fr, fc, n, n)
    block_q = bm.tile_lists(br, bc, n, n, transpose=True) if grad else none()
    block_dq = bm.tile_lists(dr, dc, n, n) if grad and use_dq else none()
    return block_kv, block_q, block_dq.clone() if block_dq is block_kv else block_dq


def _lists_fake(seq_id, left, right, tiles):
    fr, fc, br, bc, dr, dc, grad, use_dq = tiles
    b, n = seq_id.shape

    def lists(rows, cols):  # tile_lists: [B, 1 (no head in the mask), row tiles, 2 + column tiles]
        return seq_id.new_empty((b, 1, -(-n // rows), 2 + -(-n // cols)), dtype=torch.int32)

    none = seq_id.new_empty((0,), dtype=torch.int32)
    return lists(fr, fc), lists(br, bc) if grad else none, lists(dr, dc) if grad and use_dq else none


_LIB = torch.library.Library("flashgen", "FRAGMENT")
_LIB.define("hf_packed_block_lists(Tensor seq_id, SymInt left, SymInt right, int[] tiles) -> (Tensor, Tensor, Tensor)")
_LIB.impl("hf_packed_block_lists", _lists, "CompositeExplicitAutograd")
torch.library.register_fake("flashgen::hf_packed_block_lists", _lists_fake, lib=_LIB)


@torch._dynamo.assume_constant_result
def enabled() -> bool:
    """Whether calls take these lists: not under FLASHGEN_AUTO_BLOCK_MASK=0 (then the op visits
    every tile of the window with the element mask); read when torch.compile traces the call."""
    return env.auto_block_mask()


@torch._dynamo.assume_constant_result
def _meta(name: str, device: str, dtype: torch.dtype, head_dim: int, gqa: bool, grad: bool, dropout: bool,
          deterministic: bool) -> tuple[int, ...]:
    """The tiles of ``_lists`` and the op's ``block_meta`` for a call of spec ``name`` on
    ``device``: (fr, fc, br, bc, dr, dc, full_kept, dq lists used), the families' tiles of
    ``runtime.blocks.list_tiles``, computed once when torch.compile traces the call (it may load
    the libraries) and a constant of the graph."""
    o = _op[0](name)
    _, bfam, tl = blocks.list_tiles(o, torch.device(device), dtype, head_dim, False, (BLOCK, BLOCK), grad, dropout,
                                    gqa, deterministic)
    return (*tl, int(not mask_has_float(o.spec)), int(grad and bfam.dq_lists))


def packed_attention(o: AttentionOp, q, k, v, scale, dropout_p: float, params: dict) -> torch.Tensor:
    """A packed-sequence spec's call (q, k, v [B, H, N, d]; ``o``: the op of
    specs/transformers_packed.attn, ``params`` seq_id, left, right, softcap, or of
    specs/transformers_packed_plain.attn, ``params`` seq_id, left, right, dropout_p 0): its
    registered op with the lists of ``flashgen::hf_packed_block_lists`` (the same mask, classified
    once) at its own tiles instead of lists classified per call. Returns out [B, H, N, d]."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # A branch, not the comparison itself: under torch.compile a dropout_p that changed between
    # calls is a symbolic float, whose comparison _meta (a constant of the graph) cannot take; the
    # branch makes dynamo guard on p > 0 instead
    drops = True if dropout_p > 0 else False  # noqa: SIM210
    fr, fc, br, bc, dr, dc, full_kept, use_dq = _meta(o.spec.name, str(q.device), q.dtype, q.shape[-1],
                                                      q.shape[1] != k.shape[1], grad, drops,
                                                      torch.are_deterministic_algorithms_enabled())
    seq_id, left, right = params["seq_id"], params["left"], params["right"]
    block_kv, block_q, block_dq = torch.ops.flashgen.hf_packed_block_lists(
        seq_id, left, right, [fr, fc, br, bc, dr, dc, int(grad), use_dq])
    if o.spec.dropout:  # transformers_packed: softcap, then the dropout arguments
        rest = (params["softcap"], dropout_p, dropout_state(None, q.device) if dropout_p else None)
    elif dropout_p:
        raise ValueError(f"dropout_p: {o.spec.name} has no dropout (got {dropout_p})")
    else:
        rest = ()
    out, _ = o.torch_op(q, k, v, scale, False, seq_id, left, right, *rest,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        block_kv=block_kv, block_q=block_q if grad else None,
                        block_dq=block_dq if use_dq else None, block_meta=[fr, fc, br, bc, dr, dc, full_kept])
    return out
