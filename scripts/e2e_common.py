"""Shared pieces of the end-to-end scripts (scripts/e2e_gpt2.py, scripts/e2e_gemma2.py): the
environment record, the attention implementations' registration, a wall-clock budget, timing,
tables, JSON and plots. Not part of the package; the scripts import it from their own folder."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Names registered with transformers' AttentionInterface for implementations a model does not
# declare (none may contain "flash", "sdpa", "flex_attention", "eager" or "paged": transformers
# interprets those parts). Labels in results and plots keep the implementation's own name.
TORCH_FLEX = "torchflex"   # transformers' flex_attention_forward + flex mask, for models without flex support
SDPA_NOCAP = "sdpnocap"    # transformers' sdpa_attention_forward + sdpa mask, softcap dropped (different math)


class MissingPiece(SystemExit):
    """A prerequisite is missing: exits with status 2 and a message naming it."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


def require_transformers():
    try:
        import transformers
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError as e:
        raise MissingPiece(f"transformers >= 4.53 is needed (pip install 'flashgen[transformers]'): {e}") from e
    return transformers


def require_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingPiece(f"matplotlib is needed for the plots (pip install matplotlib): {e}") from e
    return plt


def check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MissingPiece(f"--device {device}: CUDA is not available (torch {torch.__version__}, "
                           f"built with CUDA {torch.version.cuda}); use --smoke or --device cpu on a machine without a GPU")
    if dev.type not in ("cpu", "cuda"):
        raise MissingPiece(f"--device {device}: expected cpu or cuda")
    return dev


def environment(device: torch.device) -> dict:
    """Versions, the GPU and the commit: recorded with every result file."""
    import transformers

    import flashgen

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "flashgen": getattr(flashgen, "__version__", None),
        "flashgen_path": str(Path(flashgen.__file__).resolve().parent),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "argv": sys.argv,
    }
    try:
        import tokenizers
        env["tokenizers"] = tokenizers.__version__
    except ImportError:
        env["tokenizers"] = None
    try:
        env["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                       timeout=10, check=False).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        env["dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_capability"] = f"sm_{props.major}{props.minor}"
    else:
        env["gpu"] = None
    return env


def register_backends() -> None:
    """flashgen under "fgen", and the two aliases above, with transformers."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask, sdpa_mask

    import flashgen.integrations.transformers as fg_hf

    fg_hf.register("fgen")
    AttentionInterface.register(TORCH_FLEX, flex_attention_forward)
    AttentionMaskInterface.register(TORCH_FLEX, flex_attention_mask)
    def sdpa_without_softcap(module, query, key, value, attention_mask, softcap=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # softcap dropped

    AttentionInterface.register(SDPA_NOCAP, sdpa_without_softcap)
    AttentionMaskInterface.register(SDPA_NOCAP, sdpa_mask)


def build_fgen(device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """Compile (or load) the backend's kernels before any timing; returns the seconds it took."""
    import flashgen.integrations.transformers as fg_hf

    t0 = time.perf_counter()
    for name in fg_hf.SPECS:
        fg_hf.op(name).build(device, [dtype], [head_dim])
    return time.perf_counter() - t0


def fgen_calls() -> dict:
    """flashgen's per-path call counts so far: kernel calls per spec, "kvcache:<spec>" for those
    of them that were decoding steps on op.with_kvcache, and "fallback:<function>". Eager calls
    only: the backend counts nothing while torch.compile traces (a counter there would recompile
    the model at every step), so a compiled run's calls are not in them. Except
    "block_lists:<spec>": the runs of the packed-sequence spec's block classification, compiled
    ones included (one per compiled training step and mask type)."""
    import flashgen.integrations.transformers as fg_hf

    return (dict(fg_hf.call_counts) | {f"kvcache:{k}": v for k, v in fg_hf.kvcache_calls.items()}
            | {f"block_lists:{k}": v for k, v in fg_hf.block_list_calls.items()})


def fgen_note(calls: dict, messages: list[str] | None = None) -> str | None:
    """What a status says when flashgen's layers left its kernels: calls that fell back to
    transformers' attention functions (their reasons are in the run's warnings). Compiled calls
    are not counted (``fgen_calls``): for them a fallback shows in the run's warning ``messages`` only."""
    calls = {k: v for k, v in calls.items() if not k.startswith("block_lists:")}  # not attention calls
    back = {k: v for k, v in calls.items() if k.startswith("fallback:")}
    if not back:
        if any("attention for such calls instead" in m for m in messages or ()):
            return ("flashgen fell back to transformers' attention for some attention calls (compiled calls are not "
                    "counted; the reasons are in the warnings): not a flashgen figure")
        return None
    kernels = sum(v for k, v in calls.items() if not k.startswith("fallback:"))
    return (f"flashgen fell back for {sum(back.values())} of {sum(calls.values())} attention calls "
            f"({', '.join(f'{k[9:]} {v}' for k, v in sorted(back.items()))}; its kernels {kernels}): "
            "not a flashgen figure")


class FgenWarnings:
    """Records flashgen's transformers warnings (fallback reasons) within a run, each run anew."""

    def __enter__(self):
        import warnings

        import flashgen.integrations.transformers as fg_hf

        fg_hf._warned.clear()  # warned once per process otherwise: each run reports its own reasons
        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        self.messages = sorted({str(w.message) for w in self.caught if "flashgen" in str(w.message)})
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def dynamo_reset() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def graph_breaks() -> int:
    return int(sum(torch._dynamo.utils.counters["graph_break"].values()))


def graph_break_reasons() -> dict[str, int]:
    """dynamo's graph-break reasons since the last reset (first line of each, 300 characters at
    most) and their counts, for the JSON: which breaks a backend adds to the model's own."""
    out: dict[str, int] = {}
    for reason, n in torch._dynamo.utils.counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0][:300] if str(reason).strip() else "?"
        out[key] = out.get(key, 0) + int(n)
    return out


def kernel_profile(step, steps: int, device: torch.device, top: int = 15) -> list[dict]:
    """Where a step's device time goes: ``torch.profiler`` over ``steps`` calls of ``step(k)``
    (k = 0 .. steps - 1; run after the timed window, so the figures above are untouched), the
    ``top`` kernels by device time as {name (120 characters at most), ms per step, calls per
    step}, and a last entry "(all kernels)" with the total; then "(host waits)" entries (calls that
    wait for the device, per step) and "(host)" entries: host time per step inside each flashgen op,
    compiled region and optimizer step (inclusive CPU time, profiler overhead included: for
    comparing runs of one script, not as a cost of its own). A diagnostic, not a benchmark figure:
    the profiler's own overhead is in the host time, not in the kernels' device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for k in range(steps):
            step(k)
        sync(device)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if device.type != "cuda":
            t = e.self_cpu_time_total
        if t > 0 and (device.type != "cuda" or e.device_type.name == "CUDA"):
            rows.append({"name": e.key[:120], "ms_per_step": t / 1e3 / steps, "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    # host calls that wait for the device (each drains the queue the host had run ahead with)
    waits = {}
    for e in prof.key_averages():
        if e.key in SYNC_EVENTS:
            waits[e.key] = e.count / steps
    host = [{"name": f"(host) {e.key[:110]}", "ms_per_step": e.cpu_time_total / 1e3 / steps,
             "calls_per_step": e.count / steps}
            for e in prof.key_averages() if e.key.startswith(HOST_EVENTS) and e.cpu_time_total > 0]
    host.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top] + [{"name": "(all kernels)", "ms_per_step": total, "calls_per_step": sum(
        r["calls_per_step"] for r in rows)}] + [{"name": f"(host waits) {k}", "ms_per_step": 0.0, "calls_per_step": v}
                                               for k, v in sorted(waits.items())] + host[:top]


# host-side events whose inclusive CPU time kernel_profile reports: our ops, compiled regions
# (dynamo's frames, AOTAutograd's forward and backward), the optimizer
HOST_EVENTS = ("flashgen::", "Torch-Compiled Region", "CompiledFunction", "Optimizer.step", "aten::_foreach",
               "autograd::engine")


SYNC_EVENTS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "cudaStreamSynchronize",
               "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def print_profile(label: str, rows: list[dict]) -> None:
    print(f"  {label}: device time per step by kernel")
    for r in rows:
        print(f"    {r['ms_per_step']:9.3f} ms  {r['calls_per_step']:7.1f} x  {r['name']}")


def compiled_frames() -> int:
    """Frames dynamo has compiled since the last reset (a rise inside a timed window means a
    recompilation was timed)."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Budget:
    """The run's wall-clock limit: measurements that would not fit are skipped (and recorded as
    skipped), never estimated."""

    def __init__(self, limit_s: float):
        self.start = time.perf_counter()
        self.limit_s = limit_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.limit_s - self.elapsed()

    def fits(self, estimate_s: float) -> bool:
        return self.left() > estimate_s


def cuda_graphs(mode: str | None) -> bool:
    """Whether torch.compile's ``mode`` captures CUDA graphs: a step must then be marked
    (torch.compiler.cudagraph_mark_step_begin) and outputs kept past the next step copied out."""
    return mode in ("reduce-overhead", "max-autotune")


def replot(src: Path, out: Path, prefix: str, finish) -> int:
    """``--replot``: the report ``src`` (``<prefix>-<tag>.json``) read back, its table printed
    and its plots drawn into ``out`` by the script's ``finish``, and the report written there too
    (when only the JSON came back from a machine). Exit status 2 for a missing or foreign file."""
    try:
        report = json.loads(Path(src).read_text())
    except (OSError, ValueError) as e:
        print(f"error: --replot: cannot read {src}: {e}", file=sys.stderr)
        return 2
    stem = Path(src).stem
    if not stem.startswith(prefix + "-") or not isinstance(report, dict) or "environment" not in report:
        print(f"error: --replot: {src} is not a {prefix}-TAG.json report of this script", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    finish(report, out, stem[len(prefix) + 1:], require_matplotlib())
    write_json(out / f"{stem}.json", report)
    print(f"wrote {out / (stem + '.json')} and its plots")
    return 0


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with ``cols`` (key, header); missing values as "—"."""
    def cell(v):
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def bar_plot(plt, path: Path, groups: list[str], series: dict[str, list[float | None]], ylabel: str,
             title: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series; missing values are
    left out (marked "n/a"), never drawn as zero."""
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(series)) / 3), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        for g, v in enumerate(values):
            x = g + (i - (len(series) - 1) / 2) * width
            if v is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
            else:
                ax.bar(x, v, width, color=f"C{i}", label=name if g == next(
                    j for j, w in enumerate(values) if w is not None) else None)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
