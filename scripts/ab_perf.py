"""A/B timing of two flashgen checkouts on one GPU: rounds A, B, A, B, ... (each round a fresh
process importing that checkout's flashgen), medians per case compared.

    python scripts/ab_perf.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 5] [--json FILE]

Cases: dense and causal at d = 64 and 128, N = 2K and 16K, forward and forward+backward, and
ALiBi and document (8 documents) forward+backward at 4K; bf16, B·N = 16K tokens, H·d = 2048
(the FlashAttention grid). Each case is timed with triton.testing.do_bench (L2 flush before each
call, 25 warm-up calls, median of 100 ms of calls); TFLOP/s over visible pairs (forward 4·d per
pair, forward+backward 3.5×). Every round first warms the case up (builds happen in the first
round of each checkout, outside the timing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [(s, d, n, bwd) for s in ("dense", "causal") for d in (64, 128) for n in (2048, 16384)
         for bwd in (False, True)] + [("alibi", 128, 4096, True), ("document", 128, 4096, True)]

WORKER = r'''
import json, sys
import torch
import triton.testing
import flashgen

cases = json.loads(sys.argv[1])
out = {}
for spec_name, d, n, bwd in cases:
    op = flashgen.compile(f"specs/{spec_name}.attn")
    B, H = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(bwd)
               for _ in range(3))
    params = {}
    if spec_name == "alibi":
        params["slopes"] = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
    if spec_name == "document":
        params["document_id"] = (torch.arange(n, device="cuda") * 8 // n).to(torch.int32).expand(B, n).contiguous()
    # visible pairs from the spec's mask, counted on the host once (row chunks)
    pairs = 0
    pos_k = torch.arange(n, device="cuda")
    for r0 in range(0, n, 1024):
        rows = torch.arange(r0, min(r0 + 1024, n), device="cuda")
        if spec_name == "dense":
            pairs += rows.numel() * n
        elif spec_name in ("causal", "alibi"):
            pairs += int((pos_k[None, :] <= rows[:, None]).sum())
        else:
            doc = pos_k * 8 // n
            pairs += int(((doc[None, :] == doc[rows][:, None]) & (pos_k[None, :] <= rows[:, None])).sum())
    pairs *= B * H
    flops = 4 * d * pairs * (3.5 if bwd else 1.0)
    dout = torch.randn_like(q)
    if bwd:
        fn = lambda: torch.autograd.grad(op(q, k, v, **params), (q, k, v), dout)
    else:
        fn = lambda: op(q, k, v, **params)
    fn(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    out[f"{spec_name} d{d} N{n} {'fwd+bwd' if bwd else 'fwd'}"] = {"ms": ms, "tflops": flops / ms / 1e9}
print("AB_RESULT " + json.dumps(out))
'''


PREBUILD = r'''
import sys
from concurrent.futures import ThreadPoolExecutor
import flashgen
jobs = [("dense", [64, 128], (False,)), ("causal", [64, 128], (False,)), ("alibi", [128], (False,)),
        ("document", [128], (False, True))]
def one(job):
    name, hds, sparse = job
    flashgen.compile(f"specs/{name}.attn").build("cuda", ["bf16"], hds, sparse=sparse, decode=False)
with ThreadPoolExecutor(len(jobs)) as pool:
    list(pool.map(one, jobs))
print("PREBUILT")
'''


def env_for(checkout: Path, cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{checkout}:{env.get('PYTHONPATH', '')}"
    env["FLASHGEN_CACHE_DIR"] = str(cache)
    env["FLASHGEN_QUIET"] = "1"
    return env


def prebuild(checkouts: list[tuple[Path, Path]]) -> None:
    """Build both checkouts' kernels at once (before any timing)."""
    procs = [subprocess.Popen([sys.executable, "-c", PREBUILD], cwd=root, env=env_for(root, cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for root, cache in checkouts]
    for (root, _), p in zip(checkouts, procs, strict=True):
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{root}: prebuild failed\n{out[-2000:]}\n{err[-4000:]}")


def run(checkout: Path, cache: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", WORKER, json.dumps(CASES)], cwd=checkout, env=env_for(checkout, cache),
                         capture_output=True, text=True, timeout=900)
    for line in res.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line[len("AB_RESULT "):])
    raise RuntimeError(f"{checkout}: worker failed\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fg-ab-cache"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times: dict[str, dict[str, list]] = {"A": {}, "B": {}}
    prebuild([(args.old.resolve(), args.cache / "A"), (args.new.resolve(), args.cache / "B")])
    print("prebuilt both", flush=True)
    for r in range(args.rounds):
        for label, root in (("A", args.old), ("B", args.new)):
            got = run(root.resolve(), args.cache / label)
            for case, row in got.items():
                times[label].setdefault(case, []).append(row)
            print(f"round {r + 1} {label} done", flush=True)
    print(f"{'case':28s} {'A ms':>9s} {'B ms':>9s} {'B/A':>7s} {'A TF/s':>8s} {'B TF/s':>8s}")
    table = []
    for case in times["A"]:
        a = statistics.median(x["ms"] for x in times["A"][case])
        b = statistics.median(x["ms"] for x in times["B"][case])
        ta = statistics.median(x["tflops"] for x in times["A"][case])
        tb = statistics.median(x["tflops"] for x in times["B"][case])
        table.append({"case": case, "a_ms": a, "b_ms": b, "ratio": b / a, "a_tflops": ta, "b_tflops": tb})
        print(f"{case:28s} {a:9.3f} {b:9.3f} {b / a:7.3f} {ta:8.1f} {tb:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "table": table, "raw": times}, indent=1))


if __name__ == "__main__":
    main()
