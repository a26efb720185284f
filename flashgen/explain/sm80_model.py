"""The ``sm80`` kernel family's model for explain (FlashAttention-2 on tensor cores,
templates/include/flashgen/cuda): its tiles and their origin (flashgen.tiles), registers read
from the compiled library (ptxas' figures through cuobjdump) or the model's estimate, the GQA
split of the backward (flashgen.families.sm80.gqa_splits, the rule its launches use), block
lists for masks without a closed-form key range, and the architecture's datasheet peaks.
"""

from __future__ import annotations

from pathlib import Path

from .. import env, families, tiles
from ..build import aot
from ..errors import BuildError
from ..families.sm80 import gqa_splits
from ..ops import announce
from ..runtime import loader
from ..tune import resources
from .geometry import mask_geometry
from .report import TileReport
from .target import FamilyPart, ModelCall, Target, nearest_known_arch

FAMILY = families.get("sm80")


def resource_usage(lib: Path) -> dict[str, int]:
    """{mangled kernel name: registers per thread} of a compiled library (flashgen.tune's
    ``cuobjdump -res-usage`` report). Raises OSError when cuobjdump is missing or fails."""
    res = resources.resource_usage(lib)
    if res is None:
        raise OSError("cuobjdump not found or failed (CUDA toolkit bin/ not on PATH)")
    return {name: r.regs for name, r in res.items()}


def library_path(inst) -> Path | None:
    """lib.so of ``inst`` in the cache (or an ahead-of-time directory), if already built."""
    entry = env.cache_dir() / inst.name / "lib.so"
    if entry.is_file():
        return entry
    dirs = env.aot_dirs() if hasattr(env, "aot_dirs") else []
    if dirs:
        try:
            lib, _ = aot.find(inst, dirs)
            if lib is not None:
                return Path(lib.path)
        except Exception:  # noqa: BLE001 - an unreadable directory only means "no figure"
            return None
    return None


def registers(op, target: Target, dt, d, choice, listed: bool, compile_it: bool, notes: list) -> tuple:
    """(fwd regs, bwd regs, source) from the compiled library in the cache (built first with
    ``compile_it``), or (None, None, '') when it is not there or cannot be read."""
    inst = FAMILY.instantiation(op.spec, target.arch, dt, d, sparse=listed, tiles=choice.config())
    path = library_path(inst)
    if path is None and compile_it:
        failure = ""
        try:
            loader.load(inst, announce=announce)
        except (OSError, BuildError) as err:  # built but not loadable here (no GPU of that arch): the entry may exist
            failure = str(err).splitlines()[0] if str(err) else type(err).__name__
        path = library_path(inst)
        if path is None:
            raise ValueError(f"build: could not build {inst.name} for {target.arch}"
                             + (f": {failure}" if failure else ""))
    if path is None:
        notes.append("registers: model estimates (the library is not in the cache; --build compiles it)")
        return None, None, ""
    try:
        regs = resource_usage(path)
    except OSError as err:
        notes.append(f"registers: model estimates ({err})")
        return None, None, ""
    fwd = [r for n, r in regs.items() if "fwd_kernel" in n]
    bwd = [r for n, r in regs.items() if "bwd_kernel" in n]
    src = f"ptxas (cuobjdump -res-usage {path})"
    return (max(fwd) if fwd else None), (max(bwd) if bwd else None), src


def describe(call: ModelCall, fwd_tile=None) -> FamilyPart:
    """The sm80 family's tiles (flashgen.tiles.choose: env, tuned, table or derived), their
    shared memory and registers, the mask geometry (with block occupancy when the call builds
    block lists: a mask without a closed-form key range), the GQA split and the peaks.
    ``fwd_tile(listed)``: the (rows, keys) of another family's forward, whose block occupancy
    the geometry counts instead of sm80's forward tile's (sm90_model)."""
    op, spec, target, dt, d = call.op, call.spec, call.target, call.dtype, call.head_dim
    nq, nk, notes = call.nq, call.nk, call.notes
    info = target.info
    score_mod = spec.score is not None
    listed = op.auto_sparse and env.auto_block_mask()  # block lists per call (ops.auto_blocks)
    seqlen = None if listed else max(nq, nk)
    choice = tiles.choose(spec, target.arch, dt, d, seqlen, device_index=target.device_index,
                          fingerprint=op.fingerprint)
    fwd_t, bwd_t = choice.fwd, choice.bwd
    regs_f, regs_b, regs_src = registers(op, target, dt, d, choice, listed, call.build, notes)
    tile_rep = {
        "fwd": TileReport(fwd_t.block_m, fwd_t.block_n, fwd_t.warps, choice.fwd_origin, fwd_t.smem_bytes(d),
                          regs_f if regs_f is not None else fwd_t.regs_estimate(d, score_mod),
                          regs_src if regs_f is not None else "estimate (tiles.FwdTile.regs_estimate)",
                          str(fwd_t), choice.tuned_seqlen[0]),
        "bwd": TileReport(bwd_t.block_m, bwd_t.block_n, bwd_t.warps, choice.bwd_origin, bwd_t.smem_bytes(d),
                          regs_b if regs_b is not None else bwd_t.regs_estimate(d, score_mod),
                          regs_src if regs_b is not None else "estimate (tiles.BwdTile.regs_estimate)",
                          str(bwd_t), choice.tuned_seqlen[1]),
    }
    df, db = tiles.derived(info, d, score_mod)
    br, bc = tiles.paper_tiles(info.smem_optin, d)
    reference_tiles = {"derived_fwd": str(df), "derived_bwd": str(db), "paper_br_bc": [br, bc],
                       "smem_optin": info.smem_optin}
    fwd_mn = (fwd_t.block_m, fwd_t.block_n)
    bwd_mn = (bwd_t.block_m, bwd_t.block_n)
    if fwd_t.smem_bytes(d) > info.smem_optin:
        fix = " (set a smaller FLASHGEN_CUDA_FWD_TILE)" if choice.fwd_origin == "env" else ""
        notes.append(f"the forward tile {fwd_t} ({choice.fwd_origin}) needs {fwd_t.smem_bytes(d):,} B of shared "
                     f"memory per block, over this GPU's {info.smem_optin:,} B: the forward kernel cannot "
                     f"launch with it{fix}")
    if bwd_t.smem_bytes(d) > info.smem_optin:
        notes.append("the backward tile exceeds this GPU's shared memory: the kernels take the deterministic "
                     "path (dQ kernel), which the backward byte model does not describe")
    if fwd_tile is not None:
        fwd_mn = fwd_tile(listed)
    geo = mask_geometry(spec, nq, nk, call.batch, call.heads, call.values, call.given,
                        (fwd_mn, bwd_mn) if listed else ())
    splits = gqa_splits(-(-nk // bwd_mn[1]), call.hkv, call.batch, call.heads // call.hkv, info.sms)
    if target.device_index is not None:
        peaks_source = "datasheet, by the device's name (flashgen.tiles)"
    elif target.arch in tiles.ARCHS:
        peaks_source = f"datasheet of the representative part {info.name} (flashgen.tiles.ARCHS)"
    else:
        peaks_source = (f"datasheet of {nearest_known_arch(target.arch)}, the nearest older architecture in "
                        "flashgen.tiles.ARCHS")
    model = ("block lists: key tiles holding a kept pair, loaded whole" if listed
             else "key ranges: each query tile loads the hull of its kept keys")
    where = info.name if target.arch in info.name else f"{info.name} ({target.arch})"
    return FamilyPart(geo, listed, tile_rep, fwd_mn, bwd_mn, reference_tiles, splits, info.peak_tflops,
                      info.hbm_gbps, peaks_source, info.name, info.l2_bytes, None, model, where, l2_rereads=True)
