#!/usr/bin/env python3
"""compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over small calls of every example spec on the CUDA families.

One process per (tool, family), run side by side (``--jobs``): memcheck and initcheck with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that torch's caching allocator neither hides an
out-of-bounds access inside one of its blocks nor makes a recycled block look initialised;
racecheck (``--racecheck-report analysis``: one report per pair of racing instructions, with
its hazard count) for shared-memory hazards; synccheck for barrier misuse. On sm90, initcheck runs
with FLASHGEN_SM90_TMA_STORE=0 (TOOL_ENV: the tool does not see TMA stores).
Each process runs this script with --worker, which makes the calls of ``calls_for`` for every
spec of specs/ (bf16), forced onto its family (a forced family never falls back, so a call it
cannot serve is reported as skipped with the family's reason, not run elsewhere):

- forward, padded layout: d 64 and 128, at a tile-aligned and a ragged shape (GQA 2:1 on the
  ragged one);
- forward, packed (varlen) batch: sequences shorter and longer than a tile and an empty one;
- forward, block-sparse: a random pattern of 128-blocks (``BlockMask.from_pattern``);
- backward: padded (heads_q = heads_kv), padded GQA, ``deterministic=True``, packed and
  block-sparse, each with a random dO;
- dropout (specs that declare it): forward and backward at dropout_p 0.1, a fixed seed;
- decode (``op.with_kvcache``): a contiguous and a paged cache, one new key appended.

Before any sanitizer starts, every kernel those calls need is built in this process (all at
once, as ``flashgen build`` does) and each family's calls run once without a sanitizer, which
builds whatever the plan missed and records the calls the family skips; the sanitized
processes only load libraries.

    python3 scripts/sanitize.py --family all --out DIR        # every tool on every CUDA family
    python3 scripts/sanitize.py --family sm90 --tools memcheck,racecheck --specs causal,dense
    python3 scripts/sanitize.py --list                         # the calls, without a GPU

``--out DIR`` gets one log per tool and family (``<family>-<tool>.log``) and ``summary.json``:
per family and tool the exit status, the error count the tool reports, the seconds it took, the
first distinct reports, and the calls that ran and were skipped (with the reason). Exit status
0 when every tool exits 0 and reports no error. A report that is a known false positive of the
tool (for example on wgmma operands in shared memory) must be shown with a minimal reproducer
before it is accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
CUDA_FAMILIES = ("sm90", "sm80")
SHAPES = [(1, 2, 2, 128, 128), (2, 4, 2, 77, 200)]  # (batch, heads, kv_heads, seqlen_q, seqlen_k): padded forward
HEAD_DIMS = (64, 128)
D = 128  # head dim of the other calls
DROPOUT_P = 0.1
PACKED_Q, PACKED_K = [77, 0, 200], [130, 5, 200]  # packed batch: sequence lengths (an empty query sequence)
N_SPARSE = 300  # block-sparse and backward calls: [2, 4, 300, d] (3 blocks of 128, the last ragged)
CAPACITY, PAGE = 256, 64  # decode: cache capacity (contiguous) and page size (paged: 4 pages a sequence)
CACHED = [100, 199]  # decode: keys already in each sequence's cache (one new key is appended)
NO_CACHING = ("memcheck", "initcheck")  # tools run with torch's caching allocator off
# initcheck does not count bytes written by a TMA or bulk store as initialised
# (scripts/initcheck_tma_store.cu shows it on its own), so it would report the backward's reads of
# every O the sm90 forward wrote by its TMA store. On sm90 it runs with the forward's direct-store
# epilogue instead, every write of which it sees, so its reports mean what they say; the TMA-store
# epilogue is what the other tools and the GPU tests' poisoned outputs check.
TOOL_ENV = {("sm90", "initcheck"): {"FLASHGEN_SM90_TMA_STORE": "0"}}


def tool_env(family: str, tool: str, base: dict) -> dict:
    """The environment of a sanitized worker: ``base`` with the caching allocator off for
    NO_CACHING's tools and TOOL_ENV's settings for (family, tool)."""
    env = dict(base)
    if tool in NO_CACHING:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env.update(TOOL_ENV.get((family, tool), {}))
    return env


@dataclass
class Call:
    """One call of a spec's op: ``label`` names it in reports (spec and what), ``run`` makes its
    inputs on the device and calls the op (autograd on where ``grad``)."""

    spec: str
    what: str
    run: Callable[[], object]
    grad: bool = False

    @property
    def label(self) -> str:
        return f"{self.spec} {self.what}"


def spec_paths(names: list[str] | None = None) -> list[Path]:
    """The example specs (specs/*.attn), or those of ``names``; ValueError for a name that is
    not one of them."""
    paths = sorted((ROOT / "specs").glob("*.attn"))
    if names:
        known = {p.stem for p in paths}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--specs: no spec {', '.join(map(repr, unknown))} in specs/ (expected some of "
                             f"{', '.join(sorted(known))})")
        paths = [p for p in paths if p.stem in names]
    return paths


def calls_for(op, device: str = "cuda", dtype=None) -> list[Call]:
    """The calls made of ``op`` (see the module docstring), on ``device`` in ``dtype`` (default
    bf16). Nothing is allocated until a call runs."""
    import torch

    import flashgen
    from flashgen.params import example_params

    dtype = dtype or torch.bfloat16
    spec = op.spec
    name = spec.name

    def randn(seed: int, *shape, grad: bool = False):
        g = torch.Generator(device=device).manual_seed(seed)
        t = torch.randn(*shape, device=device, generator=g).to(dtype)
        return t.requires_grad_() if grad else t

    def params(b, h, nq, nk):
        return example_params(spec, b, h, nq, nk, device=device,
                              generator=torch.Generator(device=device).manual_seed(b * 1000 + nk))

    def backward(out, *inputs):
        torch.autograd.grad(out, inputs, torch.randn_like(out))

    calls: list[Call] = []

    for d in HEAD_DIMS:
        for b, h, hkv, nq, nk in SHAPES:
            def fwd(b=b, h=h, hkv=hkv, nq=nq, nk=nk, d=d):
                op(randn(nq + d, b, h, nq, d), randn(nq + d + 1, b, hkv, nk, d), randn(nq + d + 2, b, hkv, nk, d),
                   **params(b, h, nq, nk))

            calls.append(Call(name, f"forward d{d} {b}x{h}/{hkv}x{nq}x{nk}", fwd))

    def packed_inputs(grad: bool):
        cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
              for n in (PACKED_Q, PACKED_K)]
        q = randn(7, sum(PACKED_Q), 4, D, grad=grad)
        k, v = randn(8, sum(PACKED_K), 2, D, grad=grad), randn(9, sum(PACKED_K), 2, D, grad=grad)
        kw = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(PACKED_Q), max_seqlen_k=max(PACKED_K))
        return q, k, v, kw | params(len(PACKED_Q), 4, max(PACKED_Q), max(PACKED_K))

    def sparse_mask():
        blocks = -(-N_SPARSE // 128)
        g = torch.Generator(device=device).manual_seed(11)
        pattern = torch.rand(2, 4, blocks, blocks, device=device, generator=g) < 0.6
        return flashgen.BlockMask.from_pattern(pattern, 128)

    def padded(hkv: int, grad: bool, seed: int = 20):
        return (randn(seed, 2, 4, N_SPARSE, D, grad=grad), randn(seed + 1, 2, hkv, N_SPARSE, D, grad=grad),
                randn(seed + 2, 2, hkv, N_SPARSE, D, grad=grad))

    def packed_fwd():
        q, k, v, kw = packed_inputs(False)
        op(q, k, v, **kw)

    def sparse_fwd():
        op(*padded(2, False), block_mask=sparse_mask(), **params(2, 4, N_SPARSE, N_SPARSE))

    calls += [Call(name, f"packed forward d{D}", packed_fwd), Call(name, f"block-sparse forward d{D}", sparse_fwd)]

    def bwd(hkv: int = 4, **kw):
        def run():
            q, k, v = padded(hkv, True)
            backward(op(q, k, v, **kw, **params(2, 4, N_SPARSE, N_SPARSE)), q, k, v)
        return run

    def packed_bwd():
        q, k, v, kw = packed_inputs(True)
        backward(op(q, k, v, **kw), q, k, v)

    def sparse_bwd():
        q, k, v = padded(2, True)
        backward(op(q, k, v, block_mask=sparse_mask(), **params(2, 4, N_SPARSE, N_SPARSE)), q, k, v)

    calls += [Call(name, f"backward d{D}", bwd(), True),
              Call(name, f"backward GQA 4/2 d{D}", bwd(2), True),
              Call(name, f"deterministic backward d{D}", bwd(deterministic=True), True),
              Call(name, f"packed backward d{D}", packed_bwd, True),
              Call(name, f"block-sparse backward d{D}", sparse_bwd, True)]

    if spec.dropout:
        def drop_fwd():
            op(*padded(2, False), dropout_p=DROPOUT_P, dropout_seed=1, **params(2, 4, N_SPARSE, N_SPARSE))

        calls += [Call(name, f"dropout {DROPOUT_P} forward d{D}", drop_fwd),
                  Call(name, f"dropout {DROPOUT_P} backward d{D}", bwd(2, dropout_p=DROPOUT_P, dropout_seed=1), True)]

    def decode(paged: bool):
        def run():
            b, h, hkv = len(CACHED), 4, 2
            q, k_new, v_new = randn(30, b, h, 1, D), randn(31, b, hkv, 1, D), randn(32, b, hkv, 1, D)
            seqlens = torch.tensor(CACHED, dtype=torch.int32, device=device)
            kw = {}
            if paged:
                per = CAPACITY // PAGE
                pages = b * per + 2  # two pages no sequence uses
                order = torch.randperm(pages, generator=torch.Generator().manual_seed(5))[: b * per]
                kw["block_table"] = order.view(b, per).to(device=device, dtype=torch.int32)
                k_cache, v_cache = randn(33, pages, PAGE, hkv, D), randn(34, pages, PAGE, hkv, D)
            else:
                k_cache, v_cache = randn(33, b, hkv, CAPACITY, D), randn(34, b, hkv, CAPACITY, D)
            op.with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k_new, v=v_new, **kw,
                            **params(b, h, CAPACITY, CAPACITY))
        return run

    calls += [Call(name, f"decode contiguous cache d{D}", decode(False)),
              Call(name, f"decode paged cache d{D}", decode(True))]
    return calls


def run_calls(calls: list[Call], family: str | None, device: str = "cuda", log=print) -> list[dict]:
    """Make ``calls`` forced onto ``family`` (None: unforced): one record per call, ``status``
    'ran' (with its seconds) or 'skipped' with the reason (the forced family does not serve
    it: NotImplementedError). Any other exception propagates: a call the script made wrong must
    not pass as skipped."""
    import torch

    import flashgen

    records = []
    for call in calls:
        t0 = time.perf_counter()
        try:
            with flashgen.use_family(family), torch.set_grad_enabled(call.grad):
                call.run()
            if device == "cuda":
                torch.cuda.synchronize()
        except NotImplementedError as e:
            reason = str(e).splitlines()[0]
            records.append({"call": call.label, "status": "skipped", "reason": reason})
            log(f"skip {call.label}: {reason[:160]}")
            continue
        records.append({"call": call.label, "status": "ran", "seconds": round(time.perf_counter() - t0, 3)})
    return records


def worker(family: str, specs: list[str] | None, record: Path | None) -> int:
    import flashgen

    records = []
    for path in spec_paths(specs):
        records += run_calls(calls_for(flashgen.compile(path)), family)
    ran = sum(r["status"] == "ran" for r in records)
    print(f"sanitize worker: {ran} calls ran on {family}, {len(records) - ran} skipped")
    if record is not None:
        record.write_text(json.dumps(records, indent=1))
    return 0 if ran else 1  # nothing ran: nothing was checked


def prebuild(specs: list[str] | None) -> float:
    """Build (or load from the cache) every kernel the calls may need on this GPU, all at once;
    the seconds it took."""
    import torch

    from flashgen.build import cache
    from flashgen.tools import aot_build

    t0 = time.perf_counter()
    planned = aot_build.plan(spec_paths(specs), device="cuda", dtypes=[torch.bfloat16], head_dims=HEAD_DIMS,
                             layouts=("padded", "packed"), sparse=(False, True))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda p: cache.load_cached(p.inst), planned))
    return time.perf_counter() - t0


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?(?! were not printed)")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_HEADLINE = re.compile(r"^========= (?!(ERROR|RACECHECK) SUMMARY|COMPUTE-SANITIZER|Target application)(\S.*)$")
_AT = re.compile(r"^=========\s+at (.*?)(\+0x[0-9a-f]+)?( in \S+)?$")


def parse_log(text: str) -> dict:
    """The error and warning counts a compute-sanitizer log reports (errors None when it has no
    summary line: the process did not finish; racecheck's warnings are intra-warp hazards, which
    count as reports too), its summary line, and its first distinct reports: each report's first
    line with the function of its first ``at`` line, addresses stripped. An ERROR SUMMARY's count
    is the total, not the "N errors were not printed" line that follows it past --print-limit."""
    race = _RACE_SUMMARY.search(text)
    total = _SUMMARY.search(text)
    errors = int(race.group(1)) if race else int(total.group(1)) if total else None
    warnings = int(race.group(2)) if race else 0
    lines = text.splitlines()
    summary = [ln.strip("= ") for ln in lines
               if ("ERROR SUMMARY" in ln and "were not printed" not in ln) or "RACECHECK SUMMARY" in ln]
    reports: list[str] = []
    for i, ln in enumerate(lines):
        m = _HEADLINE.match(ln)
        if m is None:
            continue
        report = m.group(2).strip()
        for nxt in lines[i + 1:i + 4]:
            at = _AT.match(nxt)
            if at:
                report += f" at {at.group(1).strip()}"
                break
        report = re.sub(r"0x[0-9a-f]+", "0x…", report)
        if report not in reports:
            reports.append(report)
        if len(reports) == 10:
            break
    return {"errors": errors, "warnings": warnings, "summary": summary[-1] if summary else None, "reports": reports}


def sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    for cand in filter(None, (found, os.environ.get("CUDA_HOME") and f"{os.environ['CUDA_HOME']}/bin/compute-sanitizer",
                              "/usr/local/cuda/bin/compute-sanitizer")):
        if Path(cand).exists():
            return cand
    return None


def worker_cmd(family: str, specs: list[str] | None, record: Path) -> list[str]:
    """The command line of one worker process (its calls recorded in ``record``)."""
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--family", family,
            "--record", str(record), *(["--specs", ",".join(specs)] if specs else [])]


def sanitize_cmd(tool_path: str, tool: str, family: str, specs: list[str] | None, record: Path) -> list[str]:
    """The command line of one sanitized worker."""
    return [tool_path, "--tool", tool, "--error-exitcode", "1",
            *(["--racecheck-report", "analysis"] if tool == "racecheck" else []), "--print-limit", "2000",
            *worker_cmd(family, specs, record)]


def recorded(record: Path) -> dict:
    """The calls a worker recorded: how many ran and the skipped ones (with their reasons)."""
    calls = json.loads(record.read_text()) if record.exists() else []
    return {"ran": sum(r["status"] == "ran" for r in calls), "skipped": [r for r in calls if r["status"] == "skipped"]}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="all", help="sm90, sm80, or all (default: every CUDA family; one this GPU "
                    "cannot run is reported as skipped)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated compute-sanitizer tools (default: "
                    + ",".join(TOOLS) + ")")
    ap.add_argument("--specs", default=None, help="only these specs of specs/ (comma-separated names; default all)")
    ap.add_argument("--out", default=None, help="folder for the tools' logs and summary.json (default: a "
                    "temporary folder, printed)")
    ap.add_argument("--jobs", type=int, default=None, help="sanitized processes at once (default: all of them)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds each sanitized process may take (default: 540)")
    ap.add_argument("--list", action="store_true", help="print the calls each spec makes and exit (no GPU needed)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    return ap


def options(argv=None) -> tuple[argparse.Namespace, list[str], list[str], list[str] | None]:
    """(arguments, families, tools, spec names or None); exits with a usage error (status 2)
    naming the option for a bad value."""
    ap = _parser()
    a = ap.parse_args(argv)
    from flashgen import families

    if a.family == "all":
        fams = list(CUDA_FAMILIES)
    else:
        if a.family not in families.FAMILIES:
            ap.error(f"--family: unknown family {a.family!r}; compute-sanitizer checks CUDA families "
                     f"({', '.join(CUDA_FAMILIES)} or all)")
        fam = families.get(a.family, "--family")
        if fam.device != "cuda":
            ap.error(f"--family: {fam.name} runs on {fam.device}; compute-sanitizer checks CUDA families "
                     f"({', '.join(CUDA_FAMILIES)} or all)")
        fams = [fam.name]
    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        ap.error(f"--tools: unknown tool(s) {', '.join(map(repr, bad)) or 'none given'} (expected some of "
                 f"{', '.join(TOOLS)})")
    specs = [s.strip() for s in a.specs.split(",") if s.strip()] if a.specs else None
    try:
        spec_paths(specs)
    except ValueError as e:
        ap.error(str(e))
    if a.jobs is not None and a.jobs < 1:
        ap.error(f"--jobs: {a.jobs} is out of range (expected ≥ 1)")
    return a, fams, tools, specs


def main(argv=None) -> int:
    a, fams, tools, specs = options(argv)
    if a.list:
        import flashgen

        for path in spec_paths(specs):
            for call in calls_for(flashgen.compile(path)):
                print(call.label)
        return 0
    if a.worker:
        return worker(fams[0], specs, Path(a.record) if a.record else None)

    import tempfile

    import torch

    from flashgen import families
    from flashgen.build import artifact

    if not torch.cuda.is_available():
        print("sanitize: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    tool_path = sanitizer()
    if tool_path is None:
        print("sanitize: compute-sanitizer not found (the CUDA toolkit's bin/, on PATH or under CUDA_HOME)",
              file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="flashgen-sanitize-"))
    out.mkdir(parents=True, exist_ok=True)
    arch = artifact.cuda_arch_of(torch.cuda.current_device())
    summary: dict = {"gpu": torch.cuda.get_device_name(), "arch": arch, "tools": tools, "specs": specs or "all",
                     "families": {}}
    build_s = prebuild(specs)
    summary["build_seconds"] = round(build_s, 1)
    print(f"kernels built or loaded in {build_s:.1f} s")
    jobs = []
    for fam in fams:
        why = families.get(fam).arch_reason(arch)
        if why:
            summary["families"][fam] = {"skipped": f"{fam} {why}"}
            print(f"{fam}: skipped ({why})")
            continue
        record = out / f"{fam}-plain.json"
        t0 = time.perf_counter()
        plain = subprocess.run(worker_cmd(fam, specs, record), check=False)
        summary["families"][fam] = {
            "plain": {"exit": plain.returncode, "seconds": round(time.perf_counter() - t0, 1), **recorded(record)},
            "tools": {}}
        if plain.returncode != 0:
            print(f"{fam}: the calls failed without a sanitizer (exit {plain.returncode}); not sanitized")
            continue
        jobs += [(fam, tool) for tool in tools]

    def sanitize(job):
        fam, tool = job
        record = out / f"{fam}-{tool}.json"
        env = tool_env(fam, tool, os.environ)
        t0 = time.perf_counter()
        try:
            res = subprocess.run(sanitize_cmd(tool_path, tool, fam, specs, record), env=env, capture_output=True,
                                 text=True, check=False, timeout=a.timeout)
            text, code = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += f"\nsanitize: timed out after {a.timeout:.0f} s\n"
            code = None
        (out / f"{fam}-{tool}.log").write_text(text)
        return job, {"exit": code, **parse_log(text), "env": TOOL_ENV.get(job, {}),
                     "seconds": round(time.perf_counter() - t0, 1),
                     **recorded(record), "log": str(out / f"{fam}-{tool}.log")}

    failed = False
    with ThreadPoolExecutor(max_workers=a.jobs or max(1, len(jobs))) as pool:
        for (fam, tool), res in pool.map(sanitize, jobs):
            summary["families"][fam]["tools"][tool] = res
            bad = res["exit"] != 0 or res["errors"] != 0 or res["warnings"] != 0
            failed |= bad
            print(f"{fam} {tool}: exit {res['exit']}, {res['errors']} errors, {res['warnings']} warnings, "
                  f"{res['ran']} calls ran, "
                  f"{len(res['skipped'])} skipped, {res['seconds']} s; {res['summary'] or 'no summary line'}")
    failed |= any(f.get("plain", {}).get("exit") not in (None, 0) for f in summary["families"].values())
    summary["ok"] = not failed and bool(jobs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
