"""Where an explain call runs: the device type and architecture (``--arch``'s table entry,
the live GPU, or this CPU) with the figures that come with it, and what a kernel family's model
(explain/cpu_model.py, explain/sm80_model.py) is given and returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import tiles
from ..build.artifact import cpu_arch, cuda_arch_of
from ..lang import ir
from .geometry import Geometry
from .report import TileReport


@dataclass(frozen=True)
class Target:
    """Where the call runs: ``device_type`` 'cuda' or 'cpu', the architecture, the CUDA
    figures (None on a CPU), the live CUDA device index (tuned and env tiles, measurement) and
    the torch device a measurement runs on (None: tables only)."""

    device_type: str  # 'cuda' | 'cpu'
    arch: str
    info: tiles.ArchInfo | None  # CUDA figures
    device_index: int | None  # live CUDA device (tuned/env tiles, measurement)
    device: torch.device | None  # where a measurement runs


def resolve(arch, device, measure: bool) -> Target:
    """The family and figures: --arch's table entry (the live device's own figures when it is
    that architecture), else the live GPU, else this CPU."""
    dev = None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: expected cpu or cuda[:N], got {device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: '{dev.type}' is not supported (expected cpu or cuda)")
    if arch is not None:
        norm = tiles.normalize_arch(str(arch))
        if dev is not None and dev.type == "cpu":
            raise ValueError(f"device: cpu conflicts with arch {arch!r} (an architecture names a CUDA target)")
        live = None
        if torch.cuda.is_available():
            index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
            if cuda_arch_of(index) == norm:
                live = index
        if live is None and (measure or (dev is not None and dev.type == "cuda")):
            what = "measure" if measure else "device"
            raise ValueError(f"{what}: needs a live CUDA device of arch {norm}, and this machine has none "
                             "(drop it to explain from the tables alone)")
        if live is not None:
            return Target("cuda", norm, tiles.device_info(live), live, torch.device("cuda", live))
        return Target("cuda", norm, tiles.arch_info(norm), None, None)
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: CUDA is not available in this torch build or machine (pass --arch to "
                             "explain a GPU from the tables)")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return Target("cuda", cuda_arch_of(index), tiles.device_info(index), index, torch.device("cuda", index))
    return Target("cpu", cpu_arch(), None, None, torch.device("cpu"))


def nearest_known_arch(arch: str) -> str:
    """The architecture of flashgen.tiles.ARCHS whose figures tiles.arch_info uses for ``arch``
    (the nearest older one), with its part's name."""
    base = tiles.known_arch(arch)
    return f"{base} ({tiles.ARCHS[base].name})"


@dataclass
class ModelCall:
    """What a kernel family's model is given: the op and its spec, the target, the dtype and
    sizes (q [batch, heads, nq, d], k and v [batch, hkv, nk, d]), the parameter values
    (``values``; ``given``: those the caller passed), ``build`` (compile to read registers) and
    the report's ``notes`` to add to."""

    op: object
    spec: ir.Spec
    target: Target
    dtype: ir.DType
    head_dim: int
    batch: int
    heads: int
    hkv: int
    nq: int
    nk: int
    values: dict
    given: dict
    build: bool
    notes: list[str]


@dataclass
class FamilyPart:
    """What a kernel family's model returns: the mask geometry it counted with, whether tile
    visits follow block lists (``listed``) or key ranges, the tiles (TileReport per 'fwd' /
    'bwd') and their (rows, keys) shapes, reference tiles, the backward's GQA split, the peaks
    (TFLOP/s, GB/s) and their source, the device's name, L2 bytes, threads (CPU), a line on how
    tile visits were counted, the target as the report shows it (``where``), and whether K/V
    re-reads go through an L2 that holds them (``l2_rereads``), and how many dQ partials the backward adds
    per visit (``dq_adds``: 2 for the sm90 backward at d 64, whose two warpgroups each add their keys')."""

    geo: Geometry
    listed: bool
    tiles: dict[str, TileReport]
    fwd_mn: tuple[int, int]
    bwd_mn: tuple[int, int]
    reference_tiles: dict
    splits: int
    peak_tflops: float
    hbm_gbps: float
    peaks_source: str
    gpu: str
    l2_bytes: int | None
    threads: int | None
    model: str
    where: str
    l2_rereads: bool = False
    dq_adds: int = 1  # dQ partial sums added to the accumulator per (query tile, key tile) visit
