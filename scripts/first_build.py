#!/usr/bin/env python3
"""First-build and cached-load wall time of one (spec, dtype, head dim), each in a new process.

For each pass (``fwd``: the forward; ``fwd+bwd``: forward and backward), a fresh kernel cache
and a new Python process time `flashgen.compile` to the first result (spec parameters drawn by
flashgen.params.example_params) (the output, or the
gradients, copied to the host), binding and every kernel of the call built lazily as a user
meets it; then a second new process on the same cache times the cached load the same way (and
reports any library it still had to build: a cached run should build none).
Import time of torch and flashgen is reported apart, not counted. Usage (GPU machine):

    python3 scripts/first_build.py --spec causal --head-dim 128 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import flashgen
from flashgen import paths

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch, flashgen, flashgen.params
t1 = time.perf_counter()
spec, d, n, dev, backward = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
b, h = 4, 16
q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
if dev != "cpu":
    torch.cuda.synchronize()
t2 = time.perf_counter()
op = flashgen.compile(spec)
params = flashgen.params.example_params(op.spec, b, h, n, n, dev)
out = op(q, k, v, **params)
if backward:
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
else:
    finite = bool(torch.isfinite(out).all())
t3 = time.perf_counter()
family = op.family_for(q.device, q.dtype, d, backward=backward).family.name
print(f"RESULT {t1 - t0:.3f} {t3 - t2:.3f} {int(finite)} {family}")
"""


def _child(cache: str, spec: str, d: int, n: int, device: str, backward: bool) -> dict:
    env = dict(os.environ, FLASHGEN_CACHE_DIR=cache)
    env.pop("FLASHGEN_QUIET", None)  # the "compiling ..." notices tell what each process built
    r = subprocess.run([sys.executable, "-c", CHILD, spec, str(d), str(n), device, "1" if backward else "0"],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    imp, first, finite, family = line.split()[1:]
    built = [ln.split("compiling ", 1)[1].split()[0] for ln in r.stderr.splitlines() if "flashgen: compiling " in ln]
    return {"import_s": float(imp), "seconds": float(first), "finite": finite == "1", "family": family,
            "built": built}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--spec", default="causal", help="a spec name in specs/, or a .attn file")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (bf16 inputs, B 4, H 16)")
    ap.add_argument("--seqlen", type=int, default=4096, help="seqlen_q = seqlen_k")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    try:
        spec = paths.example_spec(a.spec)
    except ValueError as e:
        ap.error(f"argument --spec: {e}")
    if a.json is not None and not a.json.parent.is_dir():
        ap.error(f"argument --json: no folder {str(a.json.parent)!r}")
    if a.seqlen < 1:
        ap.error(f"argument --seqlen: expected >= 1, got {a.seqlen}")
    if a.device not in ("cpu", "cuda"):
        ap.error(f"argument --device: expected cpu or cuda, got {a.device!r}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("argument --device: cuda, but this torch sees no CUDA device (--device cpu)")
    dims = flashgen.compile(spec).head_dims(a.device)
    if a.head_dim not in dims:
        ap.error(f"argument --head-dim: {a.head_dim} is not a head dim of spec {a.spec!r} on {a.device}")
    spec = str(spec)
    rows = []
    for backward in (False, True):
        with tempfile.TemporaryDirectory(prefix="fg-first-build-") as cache:
            cold = _child(cache, spec, a.head_dim, a.seqlen, a.device, backward)
            warm = _child(cache, spec, a.head_dim, a.seqlen, a.device, backward)
        row = {"pass": "fwd+bwd" if backward else "fwd", "spec": a.spec, "head_dim": a.head_dim,
               "first_s": cold["seconds"], "cached_s": warm["seconds"], "import_s": cold["import_s"],
               "family": cold["family"], "finite": cold["finite"] and warm["finite"],
               "built_first": cold["built"], "built_cached": warm["built"]}
        rows.append(row)
        print(f"{row['pass']:8s} {a.spec} d{a.head_dim} ({row['family']}): first build {row['first_s']:.1f} s, "
              f"cached load {row['cached_s']:.2f} s (imports {row['import_s']:.1f} s apart), finite {row['finite']}; "
              f"libraries built: {len(row['built_first'])} first, {len(row['built_cached'])} in the cached run")
    if a.json:
        a.json.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
