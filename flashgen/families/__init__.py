"""Kernel families behind one registry, tried in order: a call runs on the first family that
serves it (layout, head dim, dtype, features); ``FLASHGEN_FAMILY``, ``op.build(family=...)``,
the CLI's ``--family`` and ``with flashgen.use_family(...)`` force one, and a forced family
that cannot serve a call raises NotImplementedError naming what it lacks (never a fallback).

Adding a family: a module here with a ``Family`` subclass and a template/header folder, and one
entry in ``_ORDER`` (docs/architecture.md, "How to add a kernel family").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

from .. import env
from ..lang import ir
from . import cpu, sm80, sm90, sm90_tuning
from .base import FEATURES, PREFILL_FEATURES, Call, Family, LaunchFields

# The sm90 family's tuning candidates (sm90_tuning.py builds on sm90.py's tile rules, so the
# registry, which imports both, hands them to the family).
sm90.FAMILY.tuning = sm90_tuning.Sm90Tuning(sm90.FAMILY)

# The order families are tried in: the Hopper family first, then mma.sync, then the CPU.
_ORDER: tuple[Family, ...] = (sm90.FAMILY, sm80.FAMILY, cpu.FAMILY)
FAMILIES: dict[str, Family] = {f.name: f for f in _ORDER}

# The call argument that asks for each feature, and how a message names the feature.
_FEATURE_ARG = {"dropout": ("dropout_p", "dropout is"), "varlen": ("cu_seqlens_q", "packed (varlen) batches are"),
                "sparse": ("block_mask", "block-sparse kernels are"), "backward": ("backward", "the backward pass is"),
                "decode": ("with_kvcache", "decoding with a KV cache is")}

# The families forced by ``use_family`` blocks, innermost last: process-wide, like
# torch.nn.attention.sdpa_kernel's backend choice (and readable while torch.compile traces).
_forced: list[str | None] = []
_origins: list[str] = []  # what forced each of _forced (flashgen.use_family, --family)

__all__ = ["FAMILIES", "FEATURES", "PREFILL_FEATURES", "Call", "Choice", "Family", "LaunchFields", "choose", "complete",
           "decode_instantiation", "for_arch", "for_arch_all", "forced", "get", "of", "use_family", "with_feature"]


def get(name: str, what: str = "family") -> Family:
    """The family called ``name``; ValueError naming ``what`` (the argument or variable it came
    from) and listing the families for an unknown name."""
    fam = FAMILIES.get(name) if isinstance(name, str) else None
    if fam is None:
        raise ValueError(f"{what}: unknown kernel family {name!r} (expected one of {', '.join(FAMILIES)})")
    return fam


def complete(fam: Family) -> bool:
    """Whether ``fam`` has every prefill feature (PREFILL_FEATURES): it serves every kind of
    prefill call its dtypes and head dims allow, so it is what a device falls back to (sm80,
    cpu); a partial family (sm90, forward only) serves what it declares and leaves the rest to
    the next family. Decoding ('decode', ``op.with_kvcache``) is not part of it: a family
    without decode kernels (sm90 in this version) declines those calls, naming with_kvcache."""
    return fam.features >= frozenset(PREFILL_FEATURES)


def of(what: Family | str) -> Family:
    """A family from itself, its name, or a device type ('cpu', 'cuda': the first complete
    family of the registry's order for that device, whose dtypes and head dims are the device's:
    a partial family's are a subset of the family after it)."""
    if isinstance(what, Family):
        return what
    if what in FAMILIES:
        return FAMILIES[what]
    for fam in _ORDER:
        if fam.device == what and complete(fam):
            return fam
    for fam in _ORDER:
        if fam.device == what:
            return fam
    raise ValueError(f"family: unknown kernel family or device type {what!r} (expected one of "
                     f"{', '.join(FAMILIES)}, or cpu / cuda)")


def with_feature(feature: str) -> tuple[str, ...]:
    """The names of the families whose kernels have ``feature`` (one of FEATURES)."""
    return tuple(f.name for f in _ORDER if feature in f.features)


def for_arch(device: str, arch: str | None) -> Family:
    """The first complete family (``complete``) in the registry's order that runs on ``device``
    ('cpu' or 'cuda') and ``arch``: the one that serves every call there (tuning names a target
    before any call exists); the forced family when one is forced. ValueError when none does."""
    return for_arch_all(device, arch)[-1]


def for_arch_all(device: str, arch: str | None) -> tuple[Family, ...]:
    """Every family a call on ``device`` and ``arch`` may run on, in the registry's order: the
    partial families that run there, then the first complete one (ahead-of-time builds and
    ``op.build`` build for each); only the forced family when one is forced. ValueError when
    none runs there."""
    name = forced()
    if name is not None:
        fam = get(name, _origins[-1] if _forced else "FLASHGEN_FAMILY")
        if fam.device == device and fam.arch_reason(arch) is None:
            return (fam,)
        raise ValueError(f"family: the forced family {name} does not run on {device} {arch or ''}".rstrip())
    out = []
    for fam in _ORDER:
        if fam.device == device and fam.arch_reason(arch) is None:
            out.append(fam)
            if complete(fam):
                return tuple(out)
    raise ValueError(f"arch: no kernel family runs on {device} {arch or ''}".rstrip())


def forced_block() -> str | None:
    """The family the innermost ``use_family`` block forces (None outside any): with
    FLASHGEN_FAMILY (part of ``env.library_selection``) all that decides a forced family."""
    return _forced[-1] if _forced else None


def forced() -> str | None:
    """The family forced now: the innermost ``use_family``'s, else FLASHGEN_FAMILY's, else None."""
    name = _forced[-1] if _forced else None
    if name is None:
        name = env.family()
    return name


@contextlib.contextmanager
def use_family(name: str | None, *, origin: str = "flashgen.use_family") -> Iterator[Family | None]:
    """Force the kernel family ``name`` ('sm90', 'sm80', 'cpu') for calls made inside the block (in the
    whole process, as torch.nn.attention.sdpa_kernel does; blocks nest, the innermost wins);
    None forces nothing beyond FLASHGEN_FAMILY. A call the forced family
    cannot serve raises NotImplementedError naming what it lacks and ``origin`` (what forced it,
    e.g. the CLI's --family). ValueError for an unknown name."""
    fam = get(name, origin) if name is not None else None
    _forced.append(name)
    _origins.append(origin)
    try:
        yield fam
    finally:
        _forced.pop()
        _origins.pop()


@dataclass(frozen=True)
class Choice:
    """The family a call runs on, and why: ``tried`` lists (family, what it lacks) for every
    family tried before it; ``forced`` names where a force came from (None: the registry's order)."""

    family: Family
    tried: tuple[tuple[str, str], ...]
    forced: str | None

    def why(self) -> str:
        if self.forced:
            return f"{self.family.name} (forced by {self.forced})"
        skipped = "; ".join(f"{n} {why}" for n, why in self.tried)
        return f"{self.family.name} (the first family that serves the call" + (f"; {skipped})" if skipped else ")")


def choose(spec: ir.Spec, call: Call, family: str | None = None) -> Choice:
    """The family that runs ``call`` of ``spec``: ``family`` when given, else the forced one
    (``forced()``), else the first of the registry's order that serves it.

    Raises:
        ValueError: an unknown family name.
        NotImplementedError: the forced family cannot serve the call (naming what it lacks), or
            no family serves it.
    """
    origin = None
    if family is not None:
        origin = "family="
    else:
        family = _forced[-1] if _forced else None
        if family is not None:
            origin = _origins[-1]
        else:
            family = env.family()
            origin = "FLASHGEN_FAMILY" if family is not None else None
    if family is not None:
        fam = get(family, origin if origin != "family=" else "family")
        why = fam.declines(spec, call)
        if why:
            raise NotImplementedError(f"family {fam.name} ({origin}) cannot serve this call of spec "
                                      f"'{spec.name}': it {why}")
        return Choice(fam, (), origin)
    tried, deferred = [], None
    for fam in _ORDER:
        why = fam.declines(spec, call)
        if why is None:
            why = fam.defers(spec, call)
            if why is None:
                return Choice(fam, tuple(tried), None)
            deferred = deferred or (fam, len(tried))
        tried.append((fam.name, why))
    if deferred is not None:  # no later family serves the call: the one that deferred runs it
        return Choice(deferred[0], tuple(tried[:deferred[1]]), None)
    for fam in _ORDER:  # a family that would serve the call but for a feature: name its argument
        if call.features - fam.features and fam.declines(spec, replace(call, features=frozenset())) is None:
            feature = sorted(call.features - fam.features)[0]
            arg, what = _FEATURE_ARG[feature]
            raise NotImplementedError(f"{arg}: {what} not implemented for {call.device.upper()} in this version "
                                      f"(family {fam.name}; they run on: {', '.join(with_feature(feature)) or 'none'})")
    raise NotImplementedError(f"no kernel family serves this call of spec '{spec.name}' ("
                              + "; ".join(f"{n} {w}" for n, w in tried) + ")")


def decode_instantiation(spec: ir.Spec, fams: tuple[Family, ...], arch: str | None, dtype: ir.DType,
                         head_dim: int):
    """The artifact a build adds for decode calls (op.with_kvcache) of ``spec`` at (arch, dtype,
    head_dim): the decode instantiation of the first of ``fams`` (``for_arch_all``'s families of
    the target, as a call chooses among them) that serves such calls, or None when none serves
    them there (sm90 alone, a head dim sm80's decode kernels lack) or when the forward's library
    serves them (cpu: nothing more to build)."""
    for fam in fams:
        if fam.declines(spec, Call(fam.device, arch, dtype, head_dim, frozenset({"decode"}))) is None:
            return fam.decode_instantiation(spec, arch, dtype, head_dim)
    return None
