"""The per-GPU store of tuned winners.

One JSON file per GPU in ``<cache dir>/tuning/`` (``FLASHGEN_CACHE_DIR``), holding the metadata
it was measured under (``meta``: GPU name, arch, CUDA runtime, torch and flashgen versions) and,
per entry key (spec fingerprint, dtype, head dim, kernel family, kind), the winning config at
each tuned sequence length::

    {"meta": {...}, "entries": {"<fingerprint>|bf16|hd64|fwd": {"1024": {"config": {...}, "ms": ...}},
                                "<fingerprint>|bf16|hd64|sm90|fwd": {"1024": {...}}}}

A key names its kernel family between the head dim and the kind, except the sm80 family's
(``UNNAMED_FAMILY``), whose keys keep the form they had before other families were tuned, so
that an existing store reads and means what it did.

A file whose metadata differs from the running process is ignored. Ahead-of-time directories
(FLASHGEN_AOT_DIR, flashgen.build.aot) carry such a file too and are read first. A call uses the
winner tuned at the sequence length nearest (in log2) to its max(seqlen_q, seqlen_k).

The files are read once per process (``reload()`` forgets them; ``record`` writes and reloads).
This is a low module: it knows the file format, not the tiles. Which configs are well formed is
the kernel family's rule, registered here per (family, kind) with ``register_kind``
(flashgen.tiles does for sm80's 'fwd' and 'bwd', flashgen/families/sm90.py for sm90's 'fwd'); callbacks registered with ``on_reload`` (the op runtime's cached library
choices) run whenever what was read is forgotten.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
import threading
from collections.abc import Callable
from pathlib import Path

import filelock
import torch

from .. import env
from ..archs import cuda_arch
from ..lang import ir
from ..paths import private_dir, write_json_atomic
from ..version import __version__

BUCKET_MIN, BUCKET_MAX, BUCKET_DEFAULT = 256, 65536, 4096
# The family whose entry keys carry no family field (those written before other families were tuned).
UNNAMED_FAMILY = "sm80"

_lock = threading.Lock()
_index: dict[int, dict] | None = None  # device index -> {entry key: {seqlen: record}}
_kinds: dict[tuple[str, str], Callable[[dict], bool]] = {}  # (family, kind) -> is this config well formed
_reload_callbacks: list[Callable[[], None]] = []


# ---------------------------------------------------------------- hooks


def register_kind(kind: str, valid: Callable[[dict], bool], family: str = UNNAMED_FAMILY) -> None:
    """Let entries of ``family``'s ``kind`` (the last field of an entry key, e.g. 'fwd') load,
    those whose config ``valid(config)`` accepts; entries of a (family, kind) nobody registered
    are dropped when read. What was read is forgotten (``reload``)."""
    _kinds[(family, kind)] = valid
    reload()


def on_reload(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever what was read is forgotten (``reload``, and so after ``record``):
    results are read anew at the next lookup, and choices made from the old ones are stale."""
    if fn not in _reload_callbacks:
        _reload_callbacks.append(fn)


# ---------------------------------------------------------------- files


@functools.cache
def meta(device_index: int) -> dict:
    """What a tuning result is only valid under, for CUDA device ``device_index``: {'gpu': name,
    'arch': e.g. 'sm_90a', 'cuda': torch's CUDA runtime version, 'torch', 'flashgen' versions}."""
    props = torch.cuda.get_device_properties(device_index)
    return {"gpu": props.name, "arch": cuda_arch((props.major, props.minor)), "cuda": torch.version.cuda,
            "torch": torch.__version__, "flashgen": __version__}


def file_name(m: dict) -> str:
    """The store file's name for metadata ``m``: '<gpu>-<arch>.json' with odd characters as '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{m['gpu']}-{m['arch']}").strip("_") + ".json"


def store_path(device_index: int) -> Path:
    """The tuning file of this device in the cache directory (it may not exist)."""
    return env.cache_dir() / "tuning" / file_name(meta(device_index))


def entry_key(spec: ir.Spec | str, dtype: ir.DType, head_dim: int, kind: str, family: str | None = None) -> str:
    """The store's key of (spec or its fingerprint, dtype, head dim, kind 'fwd' / 'bwd') for the
    kernel family ``family`` (None: UNNAMED_FAMILY): '<fingerprint>|bf16|hd64|sm90|fwd', and for
    UNNAMED_FAMILY (sm80) '<fingerprint>|bf16|hd64|fwd', without the family field."""
    fp = spec if isinstance(spec, str) else spec.fingerprint()
    fam = "" if family in (None, UNNAMED_FAMILY) else f"{family}|"
    return f"{fp}|{dtype.value}|hd{head_dim}|{fam}{kind}"


def key_family_kind(key: str) -> tuple[str, str] | None:
    """(family, kind) of an entry key (``entry_key``'s two forms: four fields for
    UNNAMED_FAMILY, five with the family), or None for a key of neither form."""
    parts = key.split("|")
    if len(parts) == 4:
        return UNNAMED_FAMILY, parts[3]
    if len(parts) == 5 and parts[3]:
        return parts[3], parts[4]
    return None


def read_file(path: Path, want: dict) -> dict:
    """The entries {key: {seqlen str: record}} of a tuning file whose metadata equals ``want``;
    {} otherwise (missing, unreadable or malformed file). Entries that are not well formed (a
    sequence length that is not a positive integer, a record without a config dict, a kind not
    registered for the key's family or a config its rule rejects) are dropped. Never raises for a
    bad file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("meta") != want or not isinstance(data.get("entries"), dict):
        return {}
    out: dict = {}
    for key, per_n in data["entries"].items():
        if not isinstance(key, str) or not isinstance(per_n, dict):
            continue
        fk = key_family_kind(key)
        if fk is None:
            continue
        good = {n: r for n, r in per_n.items() if _valid_record(fk, n, r)}
        if good:
            out[key] = good
    return out


def _valid_record(family_kind: tuple[str, str], n, rec) -> bool:
    try:
        if int(n) < 1 or not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
            return False
    except (TypeError, ValueError):
        return False
    valid = _kinds.get(family_kind)
    return valid is not None and bool(valid(rec["config"]))


def sources(device_index: int) -> list[Path]:
    """The files read for a device, first wins: each FLASHGEN_AOT_DIR's tuning/ file, then the
    cache's (not with FLASHGEN_JIT=0: then only what ahead-of-time directories hold can load)."""
    name = file_name(meta(device_index))
    paths = [Path(d) / "tuning" / name for d in env.aot_dirs()]
    return [*paths, store_path(device_index)] if env.jit() else paths


def entries(device_index: int) -> dict[str, dict[int, dict]]:
    """Every stored winner for this device, merged over ``sources`` (earlier ones win per
    sequence length): {entry key: {seqlen: record}}. Read once per process (``reload``); the
    caller must not modify it."""
    global _index
    with _lock:
        if _index is None:
            _index = {}
        if device_index not in _index:
            merged: dict = {}
            want = meta(device_index)
            for path in reversed(sources(device_index)):  # earlier sources (AOT dirs) win
                for key, per_n in read_file(path, want).items():
                    merged.setdefault(key, {}).update(per_n)
            _index[device_index] = {k: {int(n): r for n, r in v.items()} for k, v in merged.items()}
        return _index[device_index]


def reload() -> None:
    """Forget what was read (the next lookup reads the files again) and tell the ``on_reload``
    callbacks."""
    global _index
    with _lock:
        _index = None
    for fn in list(_reload_callbacks):
        fn()


# ---------------------------------------------------------------- lookups


def lookup(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str,
           seqlen: int | None, family: str | None = None) -> tuple[dict, int] | None:
    """(config, tuned seqlen) of ``family``'s (None: UNNAMED_FAMILY) stored winner nearest
    ``seqlen`` (log2 distance; ties go to the longer one; None or ≤ 0: the longest), or None when
    nothing was tuned for this GPU and key. The config is a copy (config key → int)."""
    per_n = entries(device_index).get(entry_key(spec, dtype, head_dim, kind, family))
    if not per_n:
        return None
    ns = sorted(per_n)
    if seqlen is None or seqlen <= 0:
        n = ns[-1]
    else:
        x = math.log2(seqlen)
        i = bisect.bisect_left(ns, seqlen)
        near = [ns[j] for j in (i - 1, i) if 0 <= j < len(ns)]
        n = min(near, key=lambda m: (abs(math.log2(m) - x), -m))
    return dict(per_n[n]["config"]), n


def bucket(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int,
           seqlen: int | None, family: str | None = None) -> tuple[int | None, int | None]:
    """The tuned lengths (forward, backward) of ``family`` (None: UNNAMED_FAMILY) a call at
    ``seqlen`` uses, None where nothing is stored: the part of a call's library key that tuning
    decides."""
    out = []
    for kind in ("fwd", "bwd"):
        hit = lookup(spec, device_index, dtype, head_dim, kind, seqlen, family)
        out.append(hit[1] if hit is not None else None)
    return out[0], out[1]


def tuned_seqlens(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str,
                  family: str | None = None) -> list[int]:
    """The sequence lengths with a stored winner for this key of ``family`` (None:
    UNNAMED_FAMILY), sorted."""
    return sorted(entries(device_index).get(entry_key(spec, dtype, head_dim, kind, family), {}))


def seqlen_bucket(seqlen: int | None) -> int:
    """The sequence length FLASHGEN_AUTOTUNE tunes a call at: max(seqlen_q, seqlen_k) rounded to
    the nearest power of 4 in log2 (ties up), within [BUCKET_MIN, BUCKET_MAX] (256 … 65536; 1024,
    4096, 16384 are the `flashgen tune` defaults); BUCKET_DEFAULT for None or ≤ 0."""
    if seqlen is None or seqlen <= 0:
        return BUCKET_DEFAULT
    e = math.floor(math.log2(seqlen) / 2 + 0.5)  # log2 is exact at powers of two: ties go up
    return min(BUCKET_MAX, max(BUCKET_MIN, 4 ** e))


# ---------------------------------------------------------------- writing


def record(spec: ir.Spec | str, device_index: int, dtype: ir.DType, head_dim: int, kind: str, seqlen: int,
           config: dict, info: dict | None = None, family: str | None = None) -> Path:
    """Store ``config`` as ``family``'s (None: UNNAMED_FAMILY) winner for (spec, dtype,
    head_dim, kind) at ``seqlen`` on this device, with ``info`` (timings) beside it. Atomic (write + rename) under a file lock; then
    ``reload``. Returns the file. OSError when the cache directory cannot be written."""
    path = store_path(device_index)
    private_dir(private_dir(path.parent.parent) / path.parent.name)  # the cache root and tuning/, owner-only
    want = meta(device_index)
    with filelock.FileLock(str(path) + ".lock", mode=0o600):
        got = read_file(path, want)
        got.setdefault(entry_key(spec, dtype, head_dim, kind, family), {})[str(int(seqlen))] = {
            "config": dict(config), **(info or {})}
        write_json_atomic(path, {"meta": want, "entries": got})
    reload()
    return path

