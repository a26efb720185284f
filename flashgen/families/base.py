"""What a kernel family is: the unit a kernel generation plugs into flashgen as.

A family owns its device type and architectures, the dtypes, head dims and features its
kernels serve, the build target and translation units of an instantiation, its tile config
(tables, derived defaults, legality), the block-list tile geometry, and what it decides per call
and passes in the argument blocks (``launch_fields``: the CPU family's tiles, sm80's GQA split).
The registry (flashgen/families/__init__.py) tries the families in order and runs a call on the
first one that serves it; nothing outside a family tests the device type to decide what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..build import artifact
from ..lang import ir

# What a call may need beyond the forward of the padded layout: the prefill features (a family with all
# of them is complete: it serves every prefill call its dtypes and head dims allow), and decoding with a
# KV cache (op.with_kvcache), which a complete family may lack while its decode kernels do not exist.
PREFILL_FEATURES = ("backward", "dropout", "varlen", "sparse")
FEATURES = (*PREFILL_FEATURES, "decode")


class LaunchFields:
    """What a family decides per call and passes to its kernels in the argument blocks (args.h's
    last fields), for one spec: ``fwd`` fills an FgFwdArgs, ``bwd`` an FgBwdArgs, each after every
    other field (sizes, pointers, block lists, dropout, ``num_sms``) is set; ``values`` are the
    spec's parameters in declaration order, ``config`` the library's instantiation config.
    ``fills_fwd`` False: ``fwd`` sets nothing (the runtime may skip it). This default decides
    nothing."""

    fills_fwd = False
    # The family's backward orders its deterministic dQ adds by semaphores (FgBwdArgs.dq_semaphore,
    # allocated by the runtime only then).
    orders_dq = False

    def fwd(self, args, values) -> None:
        pass

    def bwd(self, args, values, config) -> None:
        pass

    def kv_splits(self, args, inst, requested: int, keys: int | None = None) -> int:
        """A decode call's split-KV count (FgKvCache.num_splits, args.h) for the filled ``args``
        (sizes, capacity, ``num_sms``) on the decode library of instantiation ``inst``;
        ``requested`` is the call's num_splits (0 chooses, 1 disables); ``keys``, where not None,
        bounds the keys one row tile of the call can keep (below the capacity for a sliding
        window). This default does not split."""
        return 1

    def fwd_packed(self, args, packed, config):
        """A forward call on a packed batch (``packed``: its validated layout, runtime/checks.py
        Packed; ``config`` the library's instantiation config), after ``fwd``: fill what the
        kernels take from the layout (the sm90 forward's work queue, args.h FgWorkQueue) and
        return what must stay alive until the launch is enqueued (None: nothing)."""
        return None


@dataclass(frozen=True)
class Call:
    """What selects a family (and, with the tiles, a library) for one call: the device type and
    architecture (None for a CPU), the dtype, the head dim, and the features it needs (a subset
    of FEATURES: 'varlen' for the packed layout, 'sparse' for block lists, 'dropout' for
    dropout_p > 0, 'decode' for ``op.with_kvcache``). A backward call also says whether its
    query heads share kv heads (``gqa``: heads_q != heads_kv) and whether it must be bitwise
    repeatable (``deterministic``): every complete family serves both; a partial family may
    decline them (sm90's backward)."""

    device: str
    arch: str | None
    dtype: ir.DType
    head_dim: int
    features: frozenset[str] = frozenset()
    gqa: bool = False
    deterministic: bool = False


class Family:
    """A kernel family (subclassed by flashgen/families/cpu.py and sm80.py).

    Attributes:
        name: the family's name ('sm80', 'cpu'); part of every artifact's name and cache key.
        device: the torch device type its kernels run on ('cpu' or 'cuda').
        dtypes: the dtypes its kernels take.
        head_dims: the head dims its kernels take.
        features: the FEATURES its kernels have.
        runtime_head_dim: one library serves every head dim (the CPU family's kernels take it at
            run time); else one instantiation per head dim.
        split_layouts: the padded and packed layouts (and dense / block-sparse calls) are built
            as separate instantiations (CUDA: padded calls never pay for varlen code).
        dq_lists: the backward has a dq kernel of its own that walks block lists (block_dq).
        tuned: its tiles are chosen per call length (tuned winners, flashgen.tune); such a
            family has a ``tuning`` object giving the tuner its candidates and the passes it
            tunes (sm80_tuning.py, sm90_tuning.py), and ``choose_tiles``.
        block_classifier: block lists are classified on the device by a generated kernel
            (``classifier``), per call for masks without a closed-form key range.
    """

    name: str = ""
    device: str = ""
    dtypes: tuple[ir.DType, ...] = ()
    head_dims: tuple[int, ...] = ()
    features: frozenset[str] = frozenset()
    runtime_head_dim: bool = False
    split_layouts: bool = False
    dq_lists: bool = False
    block_classifier: bool = False
    tuned: bool = False
    tile_keys: tuple[str, ...] = ()  # the config keys that are tiles (tuned families)
    tuning = None  # tuned families: the candidate generator (reference_tiles, candidates, instantiation)

    def __repr__(self) -> str:
        return f"<flashgen kernel family {self.name}>"

    # ------------------------------------------------------------ what it serves

    def arch_reason(self, arch: str | None) -> str | None:
        """None when the family's kernels run on ``arch``, else what it lacks (one phrase)."""
        return None

    def declines(self, spec: ir.Spec, call: Call) -> str | None:
        """None when this family serves ``call`` of ``spec``; else what it lacks, as a phrase
        ("runs on cuda tensors, not cpu", "has no dropout", ...)."""
        if call.device != self.device:
            return f"runs on {self.device} tensors, not {call.device}"
        why = self.arch_reason(call.arch)
        if why:
            return why
        if call.dtype not in self.dtypes:
            return f"has no {call.dtype.value} kernels (it takes {', '.join(d.value for d in self.dtypes)})"
        if call.head_dim not in self.head_dims:
            return f"has no head_dim {call.head_dim} kernels"
        missing = sorted(call.features - self.features)
        if missing:
            return "has no " + ", ".join(_FEATURE_TEXT[f] for f in missing)
        return None

    def defers(self, spec: ir.Spec, call: Call) -> str | None:
        """Why the automatic choice passes over this family for ``call`` of ``spec`` although it
        serves it (a measured speed rule: a later family runs the call faster), as a phrase; None
        when it does not. A forced family still runs the call; with no later family serving it,
        the deferring one does. This default defers nothing."""
        return None

    def served(self, layouts, sparse) -> tuple[list[str], list[bool]]:
        """Of the requested ``layouts`` ('padded' / 'packed') and ``sparse`` flags, those this
        family has kernels for (packed needs 'varlen', block-sparse needs 'sparse'), in order
        and without repeats: what a build for a partial family takes of a request."""
        lays = [lay for lay in dict.fromkeys(layouts) if lay == "padded" or "varlen" in self.features]
        sps = [s for s in dict.fromkeys(sparse) if not s or "sparse" in self.features]
        return lays, sps

    # ------------------------------------------------------------ builds

    def target(self, arch: str) -> artifact.Target:
        """The build target of this family for ``arch``."""
        return artifact.Target(self.name, arch, self.device)

    def device_target(self, index: int | None) -> artifact.Target:
        """The build target for the live device ``index`` (None: the CPU)."""
        raise NotImplementedError

    def config(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int | None, *, packed: bool = False,
               sparse: bool = False, tiles: dict | None = None) -> tuple[tuple[str, int], ...]:
        """The full config of an instantiation (sorted (key, value) pairs): ``tiles`` (a config
        dict, e.g. a tuned or forced choice) completed by the family's defaults for ``arch``."""
        return ()

    def instantiation(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int | None, *,
                      packed: bool = False, sparse: bool = False, tiles: dict | None = None,
                      extra: dict | None = None) -> artifact.Instantiation:
        """The artifact of ``spec`` for (arch, dtype, head_dim, layout), its config filled in
        here (the build stage below never chooses tiles). ``extra``: further config entries
        (e.g. the tuner's fwd_only / bwd_only)."""
        hd = None if self.runtime_head_dim else head_dim
        cfg = dict(self.config(spec, arch, dtype, hd, packed=packed, sparse=sparse, tiles=tiles))
        cfg.update(extra or {})
        return artifact.Instantiation(spec, self.target(arch), dtype, hd, tuple(sorted(cfg.items())))

    def choose_tiles(self, spec: ir.Spec, arch: str, dtype: ir.DType, head_dim: int, seqlen: int | None = None, *,
                     sparse: bool = False, device_index: int | None = None, use_tuned: bool = True,
                     fingerprint: str | None = None):
        """Tuned families: the tiles a call at (arch, dtype, head_dim) and max(seqlen_q, seqlen_k)
        = ``seqlen`` uses (block-sparse with ``sparse``) on CUDA device ``device_index`` (None: no
        live device, so no tuned winners), as an object with ``config()`` (the tile keys for
        ``config(tiles=)``) and the origin of each tile (flashgen.tiles.Choice for sm80,
        sm90.Sm90Choice for sm90). ValueError for a head dim the family does not take. Other
        families: NotImplementedError."""
        raise NotImplementedError(f"family {self.name} has no tile choice (its tiles are not tuned)")

    def tiles_text(self, config: dict) -> str:
        """The tiles named by an instantiation's ``config``, as a short text for messages ('tiles
        fwd ... bwd ...'); '' when the config names none."""
        return ""

    def decode_instantiation(self, spec: ir.Spec, arch: str, dtype: ir.DType,
                             head_dim: int) -> artifact.Instantiation | None:
        """The artifact of this family's decode kernels (op.with_kvcache) for (arch, dtype,
        head_dim), when they are a library of their own (sm80: config ("decode", 1)); None when
        the forward's library serves decode calls (the CPU family)."""
        return None

    def classifier(self, spec: ir.Spec, arch: str) -> artifact.Instantiation:
        """The block classifier of ``spec`` for ``arch`` (families with ``block_classifier``)."""
        raise NotImplementedError(f"family {self.name} has no block classifier")

    def launch_fields(self, spec: ir.Spec) -> LaunchFields:
        """The per-call decisions of this family's kernels for ``spec`` (one object per spec and
        family, kept by the op: it may cache)."""
        return LaunchFields()

    def block_tiles(self, config, block_size: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
        """The tiles block lists are made for, (forward rows, cols, backward rows, cols, dq rows,
        cols) in elements, for a block mask's block size and the call's instantiation, whose
        config ``config()`` returns (called only by families whose tiles are in the config: it
        may load the library)."""
        raise NotImplementedError


_FEATURE_TEXT = {"backward": "backward kernels", "dropout": "dropout", "varlen": "packed (varlen) batches",
                 "sparse": "block-sparse kernels", "decode": "decode kernels (with_kvcache)"}
