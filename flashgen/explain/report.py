"""What ``flashgen explain`` reports: the dataclasses, their JSON form and the readable
(rich) rendering. Sizes are elements, bytes bytes, times milliseconds, rates TFLOP/s and GB/s.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass
class TileReport:
    """One kernel's tile: ``block_m`` queries × ``block_n`` keys, ``warps`` (None on CPU),
    ``origin`` ('env', 'tuned', 'table', 'derived', 'family default' for the sm90 forward's
    untuned tile, or 'derived (L2 cache)' for the CPU family; ``tuned_seqlen`` the length a tuned
    one was measured at),
    ``smem_bytes`` dynamic shared memory per block (None on CPU), ``regs`` registers per thread
    and ``regs_source`` (the ptxas figure from cuobjdump, or the model's estimate)."""

    block_m: int
    block_n: int
    warps: int | None
    origin: str
    smem_bytes: int | None
    regs: int | None
    regs_source: str
    shape: str
    tuned_seqlen: int | None = None


@dataclass
class Traffic:
    """One direction's counts: ``flops``, ``hbm_bytes`` (our kernel, bytes), ``standard_hbm_bytes``
    (standard attention), ``compulsory_bytes``, ``terms`` (name → bytes of hbm_bytes) and
    ``compulsory_terms`` (name → bytes of compulsory_bytes)."""

    flops: int
    hbm_bytes: int
    standard_hbm_bytes: int
    compulsory_bytes: int
    terms: dict[str, int] = field(default_factory=dict)
    compulsory_terms: dict[str, int] = field(default_factory=dict)


@dataclass
class Report:
    """What ``explain`` computed. Sizes are elements, bytes are bytes, times milliseconds, rates
    TFLOP/s (1e12 FLOP/s) and GB/s (1e9 B/s). ``flops`` / ``hbm_bytes`` / ``standard_hbm_bytes``
    / ``compulsory_bytes`` cover the forward, or forward + backward with ``backward``; ``fwd`` and
    ``bwd`` hold each direction. ``measured_ms``, ``tflops``, ``fraction_of_floor`` (floor_ms /
    measured_ms) are None unless measured."""

    spec: str
    family: str  # the kernel family's name ('sm80', 'cpu'; flashgen.families)
    device: str  # the device type its kernels run on ('cuda', 'cpu')
    family_why: str  # why that family serves the call (flashgen.families.Choice.why)
    arch: str
    gpu: str
    target: str  # the device as the report shows it
    direction: str  # 'fwd' or 'fwd+bwd'
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    params: dict
    visible_pairs: float  # per (batch, query head)
    density: float  # visible_pairs / (Nq · Nk)
    flops: int
    hbm_bytes: int
    standard_hbm_bytes: int
    compulsory_bytes: int
    fwd: Traffic
    bwd: Traffic | None
    tiles: dict[str, TileReport]
    reference_tiles: dict  # derived tiles and the paper's (Br, Bc), for comparison
    model: str  # how tile visits were counted
    peak_tflops: float
    hbm_gbps: float
    peaks_source: str
    arithmetic_intensity: float
    floor_ms: float
    compulsory_floor_ms: float
    bound: str  # 'compute' or 'memory'
    l2_bytes: int | None = None
    threads: int | None = None
    measured_ms: float | None = None
    tflops: float | None = None
    fraction_of_floor: float | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """A JSON-able dict of every field (tiles as {'fwd': {...}, 'bwd': {...}})."""
        return asdict(self)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float) -> str:
    for unit, f in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= f:
            return f"{n / f:.3f} {unit}"
    return f"{int(n)} FLOP"


def to_json(rep: Report) -> str:
    """The report as one JSON object (non-finite floats as null)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(rep.as_dict()), indent=1)


def render(rep: Report, console=None) -> None:
    """Print the report readably (rich)."""
    # rich is loaded on first render only (a deliberate lazy load: JSON output never needs it)
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    con.print(f"[bold]{rep.spec}[/bold] {rep.direction}: B={rep.batch} Hq={rep.heads} Hkv={rep.kv_heads} "
              f"Nq={rep.seqlen_q} Nk={rep.seqlen_k} d={rep.head_dim} {rep.dtype}"
              + (f"  params: {rep.params}" if rep.params else ""))
    con.print(f"kernel family: {rep.family_why}")
    con.print(f"target: {rep.target}; peaks {rep.peak_tflops:.1f} TFLOP/s, {rep.hbm_gbps:.0f} GB/s ({rep.peaks_source})")

    t = Table(title="tiles", title_justify="left")
    for c in ("kernel", "tile", "queries x keys", "origin", "smem / block", "regs / thread"):
        t.add_column(c)
    for name, tr in rep.tiles.items():
        regs = "-" if tr.regs is None else (f"{tr.regs} (ptxas)" if tr.regs_source.startswith("ptxas")
                                            else f"~{tr.regs} (estimate)")
        origin = tr.origin + (f" at N={tr.tuned_seqlen}" if tr.tuned_seqlen else "")
        t.add_row({"fwd": "forward", "bwd": "backward"}[name], tr.shape, f"{tr.block_m} x {tr.block_n}", origin,
                  "-" if tr.smem_bytes is None else f"{tr.smem_bytes:,} B", regs)
    con.print(t)
    r = rep.reference_tiles
    if "paper_br_bc" in r:
        con.print(f"  for reference: derived tiles fwd {r['derived_fwd']}, bwd {r['derived_bwd']}; the paper's "
                  f"(Br, Bc) = ({r['paper_br_bc'][0]}, {r['paper_br_bc'][1]}) for M = {r['smem_optin']:,} B")

    con.print(f"visible pairs: {rep.visible_pairs:,.0f} per (batch, head) ({100 * rep.density:.1f}% of Nq·Nk)")
    m = Table(title="work and memory traffic", title_justify="left")
    for c in ("", "FLOPs", "ours (Thm 2, real tiles)", "standard attention", "compulsory"):
        m.add_column(c, justify="right")
    for name, tr in (("forward", rep.fwd), ("backward", rep.bwd)):
        if tr is not None:
            m.add_row(name, fmt_flops(tr.flops), fmt_bytes(tr.hbm_bytes), fmt_bytes(tr.standard_hbm_bytes),
                      fmt_bytes(tr.compulsory_bytes))
    if rep.bwd is not None:
        m.add_row("total", fmt_flops(rep.flops), fmt_bytes(rep.hbm_bytes), fmt_bytes(rep.standard_hbm_bytes),
                  fmt_bytes(rep.compulsory_bytes))
    con.print(m)
    con.print(f"  tile visits: {rep.model}")
    con.print(f"roofline: {rep.arithmetic_intensity:.1f} FLOP/B; floor {rep.floor_ms:.4g} ms ({rep.bound}-bound); "
              f"with compulsory bytes only {rep.compulsory_floor_ms:.4g} ms")
    if rep.measured_ms is not None:
        rate = f"{rep.tflops:.1f} TFLOP/s" if rep.tflops >= 1 else f"{rep.tflops * 1e3:.1f} GFLOP/s"
        con.print(f"measured: {rep.measured_ms:.4g} ms, {rate}: {1 / rep.fraction_of_floor:.2f}× the floor (the "
                  f"floor is {100 * rep.fraction_of_floor:.1f}% of the measured time)")
    for n in rep.notes:
        con.print(f"  note: {n}")
