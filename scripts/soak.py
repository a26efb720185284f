#!/usr/bin/env python3
"""Load and soak tests of flashgen ops (issue 22, item 5), CPU or CUDA, each result checked.

    python3 scripts/soak.py load    [--device cpu] [--procs 8] [--specs causal,alibi,document,softcap]
    python3 scripts/soak.py threads [--device cpu] [--threads 16] [--calls 20]
    python3 scripts/soak.py soak    [--device cpu] [--calls 10000] [--check-every 50] [--json F]

* load: ``--procs`` processes start at once on one fresh cache directory, each compiling the
  ``--specs`` (every process builds or waits for the same artifacts: the cache's locks) and
  calling each on random shapes, every output checked against the float64 reference.
* threads: ``--threads`` threads call one op (``--specs``, default sliding_window, its window
  drawn per call) on random shapes at once, every output checked against the reference.
* soak: ``--calls`` calls in one process with random shapes, specs (dense, causal, sliding
  window, ALiBi, document ids, key padding), dtypes and layouts (padded, packed, a random block
  mask), every ``--check-every``-th checked against the reference; host RSS (VmRSS) and CUDA
  allocated memory are read after the first 10% of the calls (1,000 of 10,000) and at the end:
  growth beyond ``--max-growth`` percent (default 2) fails, as would a per-call cache that never
  stops growing.

Exit status 0 when every check passed. Prints one line per phase and, with --json, writes the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """This process's resident set size (VmRSS of /proc/self/status; 0 where there is none),
    after a garbage collection and, with glibc, malloc_trim: what is live, not what the allocator
    kept of freed temporaries (the reference checks' float64 tensors raise that high-water mark
    as ever larger shapes are drawn)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Specs whose parameters index queries and keys by one size (the random shapes keep Nq = Nk).
EQUAL_SEQLENS = ("document", "transformers_packed", "transformers_packed_plain")


def _dtypes(device: str, names: str | None = None):
    import torch

    if names:
        return tuple(getattr(torch, DTYPES[n]) for n in names.split(","))
    return (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16, torch.float16)


def checked_call(op, rng: random.Random, device: str, *, layout: str = "padded", sparse: bool = False,
                 check: bool = True, dtypes: str | None = None, window: int | None = None) -> None:
    """One call of ``op`` on random shapes (B 1-2, Hkv 1-2, Hq a multiple, N 1-300, d 32/64) and,
    with ``check``, its output and LSE against the float64 reference (AssertionError naming the
    call otherwise)."""
    import torch

    import flashgen
    from flashgen import check as fcheck
    from flashgen.params import example_params

    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = rng.choice(_dtypes(device, dtypes))
    B, hkv = rng.randint(1, 2), rng.randint(1, 2)
    hq, d = hkv * rng.choice((1, 2)), rng.choice((32, 64))
    equal = op.spec.name in EQUAL_SEQLENS  # ids compare query and key positions
    nq = rng.randint(1, 300)
    nk = nq if equal else rng.randint(1, 300)
    kw = {}
    if layout == "packed":
        lq = [rng.randint(0, nq) for _ in range(B)]
        lk = lq if equal else [rng.randint(0, nk) for _ in range(B)]
        lq[0], lk[0] = nq, nk  # the max lengths occur
        cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
              for x in (lq, lk)]
        q = torch.randn(sum(lq), hq, d, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(sum(lk), hkv, d, generator=gen).to(dtype).to(device) for _ in range(2))
        kw = {"cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1], "max_seqlen_q": nq, "max_seqlen_k": nk}
    else:
        q = torch.randn(B, hq, nq, d, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(B, hkv, nk, d, generator=gen).to(dtype).to(device) for _ in range(2))
    given = {"window": window} if window is not None else {}
    params = example_params(op.spec, B, hq, nq, nk, device=device, generator=gen, **given)
    if sparse:
        pattern = torch.rand(B, hq, -(-nq // 128), -(-nk // 128), generator=gen) < 0.7
        kw["block_mask"] = flashgen.BlockMask.from_pattern(pattern.to(device), 128)
    with torch.no_grad():
        out, lse = op(q, k, v, return_lse=True, **kw, **params)
    if check:
        cmp = fcheck.compare(op.spec, q, k, v, out, lse, **kw, **params)
        assert cmp.ok, f"{op.spec.name} {layout}{' sparse' if sparse else ''} {dtype} q{tuple(q.shape)} " \
                       f"k{tuple(k.shape)}: {cmp}"


# ------------------------------------------------------------------------------------------ load

def load_worker(device: str, specs: list[str], seed: int, dtypes: str | None) -> int:
    import flashgen

    rng = random.Random(seed)
    for name in specs:
        op = flashgen.compile(ROOT / "specs" / f"{name}.attn")
        for _ in range(3):
            checked_call(op, rng, device, dtypes=dtypes)
    return 0


def run_load(a) -> dict:
    specs = a.specs.split(",")
    with tempfile.TemporaryDirectory(prefix="flashgen-load-") as cache:
        env = os.environ | {"FLASHGEN_CACHE_DIR": cache, "PYTHONPATH": str(ROOT) + os.pathsep
                            + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "load-worker", "--device", a.device, "--specs",
                                   a.specs, "--seed", str(i)] + (["--dtypes", a.dtypes] if a.dtypes else []), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(a.procs)]
        outs = [p.communicate(timeout=a.timeout) for p in procs]
        wall = time.perf_counter() - t0
        entries = sorted(p.name for p in Path(cache).iterdir() if not p.name.startswith("."))
    failed = [(i, o[0][-2000:]) for i, (p, o) in enumerate(zip(procs, outs, strict=True)) if p.returncode != 0]
    for i, text in failed:
        print(f"load: process {i} failed:\n{text}", file=sys.stderr)
    res = {"phase": "load", "procs": a.procs, "specs": specs, "wall_s": round(wall, 2),
           "cache_entries": len(entries), "failed": len(failed)}
    print(f"load: {a.procs} processes x {len(specs)} specs on one fresh cache: {wall:.1f} s, "
          f"{len(entries)} cache entries, {len(failed)} failed")
    return res


# --------------------------------------------------------------------------------------- threads

def run_threads(a) -> dict:
    import flashgen

    op = flashgen.compile(ROOT / "specs" / f"{a.specs}.attn")
    errors: list[str] = []

    def body(i: int) -> None:
        rng = random.Random(1000 + i)
        try:
            for _ in range(a.calls):
                window = rng.randint(1, 200) if any(p.name == "window" for p in op.spec.params) else None
                checked_call(op, rng, a.device, dtypes=a.dtypes, window=window)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=body, args=(i,)) for i in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for e in errors:
        print(f"threads: {e}", file=sys.stderr)
    print(f"threads: {a.threads} threads x {a.calls} checked calls of one op: {wall:.1f} s, {len(errors)} failed")
    return {"phase": "threads", "threads": a.threads, "calls": a.calls, "wall_s": round(wall, 2),
            "failed": len(errors)}


# ------------------------------------------------------------------------------------------ soak

def run_soak(a) -> dict:
    import torch

    import flashgen

    cuda = a.device != "cpu"
    names = a.specs.split(",")
    ops = {n: flashgen.compile(ROOT / "specs" / f"{n}.attn") for n in names}
    rng = random.Random(a.seed)
    mark = max(1, a.calls // 10)
    at_mark = None
    t0 = time.perf_counter()
    checks = 0
    for i in range(a.calls):
        op = ops[rng.choice(names)]
        r = rng.random()
        layout, sparse = ("packed", False) if r < 0.2 else ("padded", r < 0.35)
        check = i % a.check_every == 0
        checked_call(op, rng, a.device, layout=layout, sparse=sparse, check=check, dtypes=a.dtypes)
        checks += check
        if i + 1 == mark:
            if cuda:
                torch.cuda.synchronize()
            at_mark = (rss_bytes(), torch.cuda.memory_allocated() if cuda else 0)
    if cuda:
        torch.cuda.synchronize()
    end = (rss_bytes(), torch.cuda.memory_allocated() if cuda else 0)
    wall = time.perf_counter() - t0
    growth = [100.0 * (e - m) / m if m else 0.0 for m, e in zip(at_mark, end, strict=True)]
    ok = all(g <= a.max_growth for g in growth)
    print(f"soak: {a.calls} calls ({checks} checked) in {wall:.1f} s; after {mark} calls RSS "
          f"{at_mark[0] / 2**20:.1f} MiB, CUDA {at_mark[1] / 2**20:.1f} MiB; at the end RSS {end[0] / 2**20:.1f} MiB "
          f"({growth[0]:+.2f}%), CUDA {end[1] / 2**20:.1f} MiB ({growth[1]:+.2f}%): "
          + ("ok" if ok else f"over {a.max_growth}%"))
    return {"phase": "soak", "calls": a.calls, "checked": checks, "wall_s": round(wall, 2), "mark": mark,
            "rss_mark": at_mark[0], "rss_end": end[0], "cuda_mark": at_mark[1], "cuda_end": end[1],
            "growth_pct": [round(g, 3) for g in growth], "failed": 0 if ok else 1}


def check_args(ap: argparse.ArgumentParser, a) -> None:
    """ap.error (one line, exit status 2) for an option value the phases cannot run with."""
    for name in a.specs.split(","):
        if not (ROOT / "specs" / f"{name}.attn").is_file():
            ap.error(f"--specs: no spec {name!r} in specs/")
    if a.phase == "threads" and len(a.specs.split(",")) != 1:
        ap.error("--specs: the threads phase calls one op (give one spec)")
    for name in (a.dtypes or "").split(",") if a.dtypes is not None else ():
        if name not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {name!r} (expected some of {', '.join(DTYPES)})")
    for opt, value in (("--calls", a.calls), ("--procs", a.procs), ("--threads", a.threads),
                       ("--check-every", a.check_every)):
        if value < 1:
            ap.error(f"{opt}: expected an int >= 1, got {value}")
    import torch

    try:
        dev = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device: expected cpu or cuda[:N], got {a.device!r}")
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        ap.error(f"--device: {a.device} is not available here (expected cpu, or cuda on a CUDA build of torch "
                 "with a GPU)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("load", "threads", "soak", "load-worker"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    ap.add_argument("--procs", type=int, default=8, help="load: processes (default: 8)")
    ap.add_argument("--specs", default=None, help="specs in specs/ (load: causal,alibi,document,softcap; soak: "
                    "dense,causal,sliding_window,alibi,document,key_padding)")
    ap.add_argument("--dtypes", default=None, help="dtypes to draw from, e.g. fp32,bf16 (default: cpu fp32,bf16; "
                    "cuda bf16,fp16)")
    ap.add_argument("--timeout", type=float, default=1800, help="load: seconds per process")
    ap.add_argument("--threads", type=int, default=16, help="threads: threads (default: 16)")
    ap.add_argument("--calls", type=int, default=None, help="threads: calls per thread (20); soak: calls (10000)")
    ap.add_argument("--check-every", type=int, default=50, help="soak: check every n-th call (default: 50)")
    ap.add_argument("--max-growth", type=float, default=2.0, help="soak: allowed memory growth in percent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    if a.phase == "load-worker":
        return load_worker(a.device, a.specs.split(","), a.seed, a.dtypes)
    if a.calls is None:
        a.calls = 20 if a.phase == "threads" else 10000
    if a.specs is None:
        a.specs = {"load": "causal,alibi,document,softcap", "threads": "sliding_window"}.get(
            a.phase, "dense,causal,sliding_window,alibi,document,key_padding")
    check_args(ap, a)
    res = {"load": run_load, "threads": run_threads, "soak": run_soak}[a.phase](a)
    res["device"] = a.device
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
