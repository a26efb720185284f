"""Every environment variable flashgen reads, in one place. Nothing else reads os.environ.

One tuning knob is read by the CPU kernel headers themselves (templates/include/flashgen/cpu/
gemm.h), for benchmarking only: FLASHGEN_CPU_GEMM=blas forces MKL's sgemm instead of the
built-in micro-kernels.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The process environment as os.environ keeps it (a dict of bytes on POSIX): read directly on
# the call path, where os.environ.get's key encoding costs a microsecond per variable. Where
# the platform's os.environ has no such dict, os.environ.get is used.
_RAW = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)


def _get(name: str, keys: dict = {}) -> str | None:  # noqa: B006 - a cache of encoded names
    """os.environ.get(name), fast."""
    if _RAW is None or _ENCODE is None or _DECODE is None:
        return os.environ.get(name)
    key = keys.get(name)
    if key is None:
        key = keys[name] = _ENCODE(name)
    raw = _RAW.get(key)
    return None if raw is None else _DECODE(raw)


def raw(name: str) -> str | None:
    """The variable's value as the environment holds it, unparsed (None when unset), fast: for
    keys that must change when it does, without refusing a bad value where it is not read."""
    return _get(name)


def cache_dir() -> Path:
    """FLASHGEN_CACHE_DIR, else ~/.cache/flashgen: root of compiled artifacts and tuning data."""
    root = os.environ.get("FLASHGEN_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flashgen"


def cache_dir_set() -> bool:
    """Whether FLASHGEN_CACHE_DIR is set (messages about the cache root name where it came from)."""
    return bool(os.environ.get("FLASHGEN_CACHE_DIR"))


def cxx() -> str:
    """CXX, else 'c++': the C++ compiler torch.utils.cpp_extension builds the CPU kernels with."""
    return os.environ.get("CXX") or "c++"


def cxx_set() -> bool:
    """Whether CXX is set (a missing compiler is then named as CXX's value)."""
    return bool(os.environ.get("CXX"))


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """A boolean FLASHGEN_* variable: 1/true/yes/on or 0/false/no/off (any case; empty: off; any
    other integer: on unless 0, as before), ``default`` when unset; ValueError naming the
    variable for anything else (rather than taking e.g. 'false' as on)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value.lstrip("+-").isdigit():  # another integer (a level, e.g. FLASHGEN_VERBOSE=2): on unless 0
        return int(value) != 0
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (or true/false, yes/no, on/off)")


def verbose() -> bool:
    """FLASHGEN_VERBOSE=1: show compiler command lines and output while building."""
    return flag("FLASHGEN_VERBOSE", False)


def debug() -> bool:
    """FLASHGEN_DEBUG=1: build kernels with -g and -lineinfo (a separate cache entry)."""
    return flag("FLASHGEN_DEBUG", False)


def quiet() -> bool:
    """FLASHGEN_QUIET=1: no 'compiling ...' notice on stderr when a first call builds a kernel."""
    return flag("FLASHGEN_QUIET", False)


def auto_block_mask() -> bool:
    """FLASHGEN_AUTO_BLOCK_MASK=0: on CUDA, do not build block lists per call for masks without a
    closed-form key range (then every tile in range is visited, with the element mask)."""
    return flag("FLASHGEN_AUTO_BLOCK_MASK", True)


def sm90_dynamic_schedule() -> bool:
    """FLASHGEN_SM90_SCHEDULE=static: the sm90 forward runs packed batches on its static
    schedule instead of the dynamic one (a diagnostic switch for A/B timing, read per call)."""
    return _get("FLASHGEN_SM90_SCHEDULE") != "static"


def family() -> str | None:
    """FLASHGEN_FAMILY=<name> (sm80, cpu): run every call on that kernel family, never another
    (flashgen.families; a call it cannot serve raises NotImplementedError). Unset: the first
    family that serves the call."""
    return (_get("FLASHGEN_FAMILY") or "").strip() or None


_SELECTION = ("FLASHGEN_FAMILY", "FLASHGEN_CUDA_FWD_TILE", "FLASHGEN_CUDA_BWD_TILE", "FLASHGEN_CUDA_DECODE_TILE",
              "FLASHGEN_AUTOTUNE", "FLASHGEN_JIT", "FLASHGEN_AOT_DIR", "FLASHGEN_CACHE_DIR",
              "FLASHGEN_CUDA_DECODE_BULK", "FLASHGEN_CUDA_DECODE_KEYS")


_SELECTION_KEYS = tuple(_ENCODE(name) for name in _SELECTION) if _ENCODE is not None else ()


def library_selection() -> tuple:
    """The raw values of the variables that change which library serves a call (family, forced
    tiles, tuning, JIT, ahead-of-time and cache directories, the decode kernel's load variant),
    as the environment holds them (bytes on POSIX): part of the op's library key, read on every
    call."""
    if _RAW is None or not _SELECTION_KEYS:
        return tuple(map(os.environ.get, _SELECTION))
    return tuple(map(_RAW.get, _SELECTION_KEYS))


def cuda_home() -> str | None:
    """CUDA_HOME / CUDA_PATH as torch.utils.cpp_extension sees them (for the nvcc version)."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")


def _tile(var: str, form: str, fields: tuple[str, ...], example: str) -> tuple[tuple[str, int], ...]:
    """Parse ``var`` (``form``: ints joined by 'x') into (field, value) pairs; () when unset.
    Only the form is checked here: whether the tile is legal is the kernel family's rule
    (flashgen.tiles.forced)."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return ()
    try:
        values = tuple(int(x) for x in raw.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != len(fields):
        raise ValueError(f"{var}: expected {form} such as {example}, got {raw!r}")
    return tuple(zip(fields, values, strict=True))


def cuda_fwd_tile() -> tuple[tuple[str, int], ...]:
    """FLASHGEN_CUDA_FWD_TILE=BMxBNxW (e.g. 128x64x4): force the CUDA forward's tile (BM query
    rows, BN keys, W warps) instead of the default for the head dim. For tuning experiments; each
    tile is a separate cache entry. Returns (('fwd_block_m', BM), ('fwd_block_n', BN),
    ('fwd_warps', W)), () when unset; ValueError naming the variable when it is not three
    integers joined by 'x'. Which tiles are legal is checked by flashgen.tiles (FwdTile.legal)."""
    return _tile("FLASHGEN_CUDA_FWD_TILE", "BMxBNxW", ("fwd_block_m", "fwd_block_n", "fwd_warps"), "128x64x4")


def cuda_bwd_tile() -> tuple[tuple[str, int], ...]:
    """FLASHGEN_CUDA_BWD_TILE=BMxWxWDxWQ (e.g. 64x8x1x2): force the CUDA backward's main tile —
    BM queries per step, W warps (16·W/WD keys per CTA), WD warps sharing a key slab's dK/dV,
    WQ warps along the queries of the dQ product — instead of the default for the head dim
    (templates/include/flashgen/cuda/bwd.cuh, BwdTile). For tuning experiments; each tile is a
    separate cache entry. Returns the four (config key, value) pairs, () when unset; ValueError
    naming the variable when it is not four integers joined by 'x'. Which tiles are legal is
    checked by flashgen.tiles (BwdTile.legal)."""
    return _tile("FLASHGEN_CUDA_BWD_TILE", "BMxWxWDxWQ", ("bwd_block_m", "bwd_warps", "bwd_warps_d", "bwd_warps_mdq"),
                 "64x8x1x2")


def cuda_decode_tile() -> tuple[tuple[str, int], ...]:
    """FLASHGEN_CUDA_DECODE_TILE=BNxST (e.g. 64x3): force the sm80 decode kernel's tile (BN keys
    per shared-memory stage, 16 per warp; ST stages) instead of the family's choice
    (flashgen/families/sm80.py, decode_tile). For tuning experiments; each tile is a separate
    cache entry. Returns (('decode_block_n', BN), ('decode_stages', ST)), () when unset;
    ValueError naming the variable when it is not two integers joined by 'x'. Which tiles are
    legal is checked by decode_tile."""
    return _tile("FLASHGEN_CUDA_DECODE_TILE", "BNxST", ("decode_block_n", "decode_stages"), "64x3")


def cuda_decode_bulk() -> int:
    """FLASHGEN_CUDA_DECODE_BULK=1 (or 2): build the sm80 decode kernel's opt-in variant that loads
    the K/V tiles with 1-D TMA bulk copies (one per key row, an mbarrier per stage) instead of
    16-byte cp.async; 1: every warp issues its own rows' copies, 2: one warp issues all of them
    (templates/include/flashgen/cuda/decode.cuh, DecodeBulkTile). Needs sm_90 or newer (the family
    refuses an older target: flashgen/families/sm80.py, decode_tile). An A/B switch for timing the
    two load paths; each value is a separate cache entry. 0 when unset, empty or 0; ValueError
    naming the variable for anything but 0, 1 or 2."""
    raw = os.environ.get("FLASHGEN_CUDA_DECODE_BULK", "").strip()
    if raw in ("", "0"):
        return 0
    if raw in ("1", "2"):
        return int(raw)
    raise ValueError(f"FLASHGEN_CUDA_DECODE_BULK={raw!r}: expected 0 (cp.async, the default), 1 (bulk copies "
                     "issued by every warp) or 2 (bulk copies issued by one warp)")


def cuda_decode_keys() -> bool | None:
    """FLASHGEN_CUDA_DECODE_KEYS=1 / 0: build the sm80 decode kernel with the keys on the tensor
    cores' M side (S^T = K Q^T, O^T = V^T P^T: templates/include/flashgen/cuda/decode_keys.cuh)
    or with the GQA group's query rows there (cuda/decode.cuh, DecodeKernel). None when unset or
    empty: the family's default (flashgen/families/sm80.py, decode_tile). Each value is a separate
    cache entry. ValueError naming the variable for anything but 0 or 1."""
    raw = os.environ.get("FLASHGEN_CUDA_DECODE_KEYS", "").strip()
    if raw == "":
        return None
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"FLASHGEN_CUDA_DECODE_KEYS={raw!r}: expected 1 (keys on the M side) or 0 (query rows on the "
                     "M side)")


def _strtol(text: str) -> tuple[int, int]:
    """C's strtol(text, &end, 10): (value, characters consumed); (0, 0) without digits."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return (int(m.group(1)), m.end()) if m else (0, 0)


def _cpu_tile(var: str) -> tuple[int, int] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    qb, end = _strtol(raw)
    kvb = _strtol(raw[end + 1:])[0] if raw[end:end + 1] == "," else 0
    return qb, kvb


def cpu_tiles() -> tuple[int, int] | None:
    """FLASHGEN_CPU_TILES="qb,kvb": force the CPU forward's tiles (tuning experiments only). The raw
    (qb, kvb) as C's strtol reads them (a missing or unreadable number is 0), None when unset;
    which values apply is the CPU family's rule (flashgen/families/cpu_tiles.py, override_fwd:
    qb in [1, 1024], kvb in [8, 8192])."""
    return _cpu_tile("FLASHGEN_CPU_TILES")


def cpu_bwd_tiles() -> tuple[int, int] | None:
    """FLASHGEN_CPU_BWD_TILES="qb,kvb": force the CPU backward's tiles, as ``cpu_tiles`` (applied
    by cpu_tiles.override_bwd: qb in [1, 1024], kvb in [8, 1024])."""
    return _cpu_tile("FLASHGEN_CPU_BWD_TILES")


def aot_dirs() -> list[Path]:
    """FLASHGEN_AOT_DIR: directories written by `flashgen build --out DIR` (os.pathsep-separated),
    searched for kernels (and their tuned tiles) before the cache."""
    raw = os.environ.get("FLASHGEN_AOT_DIR", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def jit() -> bool:
    """FLASHGEN_JIT=0: never render or compile; kernels come only from FLASHGEN_AOT_DIR (a missing
    one raises an error naming it)."""
    return flag("FLASHGEN_JIT", True)


def autotune() -> bool:
    """FLASHGEN_AUTOTUNE=1: on CUDA, tune a spec's tiles at its first call for a (dtype, head dim,
    sequence-length bucket) that has no stored result (flashgen.tune), then use the winner."""
    return flag("FLASHGEN_AUTOTUNE", False)
