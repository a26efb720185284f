"""Launch plans of the raw ops (``torch.ops.flashgen.<spec>`` and ``<spec>_bwd``), the calls a
compiled graph makes: what a call with given input metadata launches, learnt from a call that
ran the full validation, so that a later call with the same metadata skips it.

A compiled training step calls each layer's forward and backward op once per step with the
same shapes, strides, dtypes, devices and scalar arguments; only the pointers change. The full
path validates every argument, chooses the family and library and packs the argument block
(~30-40 µs of Python a call, measured with the launch stubbed out); a planned call builds its
key (``forward_key`` / ``backward_key``: every property the validation and the choices read,
except pointers), looks the plan up, and launches (``run_forward``), or hands the validated
choices to the launcher (``run_backward``).

Calls are planned only where the validation reads nothing but that metadata: the padded layout
(a packed one's cu_seqlens are per-call tensors), no dropout (its state is per call), and
block lists given by the caller or not used (lists the op classifies per call are per-call
tensors). A call that cannot be planned, a pointer that is not 16-byte aligned, or a test's
``launch.poison_outputs`` takes the full path. The key includes the environment that selects
libraries, the forced family and the tuning generation, so a change of any of them plans anew.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import env, families
from ..build import cache
from . import launch
from .checks import Blocks, dims


def _meta(t) -> tuple | None:
    """A tensor argument's part of a plan key (None for None)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


class Unplannable(TypeError):
    """A call argument that cannot be part of a plan key (an unhashable value where the schema
    wants a scalar or a tensor, such as a list or a NumPy array): the call takes the full path,
    whose validation names the argument."""


def _param(x):
    """A spec parameter's part of a plan key: a tensor's metadata, a scalar's type and value (the
    validation checks scalar values, and a bool must not pass for the int it equals). Raises
    Unplannable for a value that is neither a tensor nor hashable."""
    if isinstance(x, torch.Tensor):
        return _meta(x)
    key = (type(x), x)
    if type(x) not in (int, float):
        try:
            hash(key)
        except TypeError:
            raise Unplannable(type(x).__name__) from None
    return key


def _scale(scale) -> tuple:
    """The scale's part of a plan key: its exact bits (-0.0 and 0.0 are equal floats)."""
    return (type(scale), launch.scale_key(scale))


def _environment(op) -> tuple:
    """What selects libraries and lists besides the inputs: the variables' raw values (parsed,
    and refused when bad, by the full path where it reads them), the forced family, the
    generation of library choices."""
    return (env.library_selection(), env.raw("FLASHGEN_AUTO_BLOCK_MASK"), families.forced_block(), op.generation())


def call_key(op, scale, values) -> tuple:
    """The scalar part of another call's plan key (the decode op's, beside its tensors' metadata):
    the scale's bits, each parameter's metadata or type and value, the environment that selects
    libraries. Raises Unplannable (a TypeError) for a parameter value that cannot be keyed."""
    return (_scale(scale), *(_param(x) for x in values), _environment(op))


def forward_key(op, q, k, v, scale, values, dropout, varlen, blocks) -> tuple | None:
    """The plan key of a raw forward call (None: not plannable: packed layout, dropout p > 0, a
    test's poisoned outputs)."""
    if launch.poison_outputs or any(x is not None for x in varlen) or (dropout and dropout[0]):
        return None
    block_kv, block_q, block_dq, meta = blocks
    try:
        params = tuple(_param(x) for x in values)
    except Unplannable:
        return None
    return (_meta(q), _meta(k), _meta(v), _scale(scale), params, tuple(type(x) for x in dropout), _meta(block_kv),
            block_q is None, block_dq is None, tuple(meta), _environment(op))


def backward_key(op, q, k, v, out, lse, dout, dlse, scale, deterministic, values, need_params, dropout, varlen,
                 blocks) -> tuple | None:
    """The plan key of a raw backward call (None: not plannable: as ``forward_key``, and
    deterministic mode with parameter gradients, which raises or warns at every call)."""
    if launch.poison_outputs or any(x is not None for x in varlen) or (dropout and dropout[0]):
        return None
    if deterministic and any(need_params):
        return None
    block_kv, block_q, block_dq, meta = blocks
    try:
        params = tuple(_param(x) for x in values)
    except Unplannable:
        return None
    return (_meta(q), _meta(k), _meta(v), _meta(out), _meta(lse), _meta(dout), _meta(dlse), _scale(scale),
            bool(deterministic), params, tuple(bool(x) for x in need_params),
            tuple(type(x) for x in dropout), block_kv is None, _meta(block_q), _meta(block_dq), tuple(meta),
            _environment(op))


def _float_values(op, values) -> list:
    """The spec's parameters as the validation returns them (float parameters as float)."""
    return [float(x) if p.kind == "float" else x for p, x in zip(op.spec.params, values, strict=True)]


def forward_plan(op, fam: families.Family, q, k, v, scale: float, blocks: Blocks | None, given_lists: bool,
                 out: torch.Tensor) -> launch.ForwardPlan | None:
    """The plan of a raw forward call that just ran validated (scale: the validated one; blocks:
    the validated lists) on family ``fam``; None where it cannot be planned (lists classified by
    the call itself, inputs that needed an aligned copy, empty outputs)."""
    if blocks is not None and not given_lists:
        return None
    return launch.make_forward_plan(op, fam, q, k, v, scale, blocks, out)


def run_forward(op, plan: launch.ForwardPlan, q, k, v, values, block_kv) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out and lse of a raw forward launched from its plan (its key holds the scalar values, so
    they passed the validation); None when the call must take the full path (a pointer not
    16-byte aligned)."""
    return launch.launch_planned(op, plan, q, k, v, _float_values(op, values) if values else values, block_kv)


@dataclass(frozen=True)
class RawBackwardPlan:
    """A planned raw backward: the validated scale, the library, and the block lists' tile
    sizes and full_kept flag (None: no lists)."""

    scale: float
    lib: cache.LoadedLibrary
    meta: tuple[int, ...] | None


def backward_plan(op, fam: families.Family, q, k, scale: float, blocks: Blocks | None,
                  given_lists: bool) -> RawBackwardPlan | None:
    """The plan of a raw backward call that just ran validated on family ``fam``; None where it
    cannot be planned (lists classified by the call itself)."""
    if blocks is not None and not given_lists:
        return None
    B, Hq, Hkv, Nq, Nk, d = dims(q, k, None)
    lib = op.library(fam, q.device, launch.IR_DTYPE[q.dtype], d, False, blocks is not None, max(Nq, Nk))
    return RawBackwardPlan(scale, lib, blocks.meta if blocks is not None else None)


def run_backward(op, plan: RawBackwardPlan, q, k, v, out, lse, dout, dlse, deterministic, values, need_params,
                 block_q, block_dq):
    """dq, dk, dv and the parameter gradients of a raw backward from its plan: the launcher with
    the validated choices (it allocates the outputs and workspaces and packs the argument block)."""
    blocks = Blocks(None, block_q, block_dq, plan.meta) if plan.meta is not None else None
    values = _float_values(op, values) if values else values
    return launch.launch_backward(op, q, k, v, out, lse.contiguous(), dout, dlse, plan.scale, deterministic, values,
                                  need_params, packed=None, blocks=blocks, lib=plan.lib)
