#!/usr/bin/env python3
"""compute-sanitizer over small calls of every example spec on one kernel family.

One process per tool (memcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that torch's caching
allocator does not hide out-of-bounds accesses inside its blocks; racecheck for shared-memory
hazards). Each process runs this script with --worker: every spec in specs/ at two small shapes
(a tile-aligned and a ragged one), bf16, d 64 and 128, and at d 128 one packed batch and one
block-sparse call and one backward, forced onto ``--family`` (a forced family
never falls back, so a call it cannot serve is reported as skipped, not run elsewhere). The
kernels are built first in a plain process, so the sanitized processes only load them.

    python3 scripts/sanitize.py --family sm90 [--tools memcheck,racecheck] [--specs causal,dense] [--out DIR]

Exit status 0 when every tool reports no error. A report that is a known false positive of the
tool (for example on wgmma operands in shared memory) must be shown with a minimal reproducer
before it is accepted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 2, 2, 128, 128), (2, 4, 2, 77, 200)]  # (batch, heads, kv_heads, seqlen_q, seqlen_k)


def worker(family: str, specs: list[str] | None = None) -> int:
    import torch

    import flashgen
    from flashgen.params import example_params

    ran = skipped = 0
    for path in sorted((ROOT / "specs").glob("*.attn")):
        if specs and path.stem not in specs:
            continue
        op = flashgen.compile(path)
        for d in (64, 128):
            for b, h, hkv, nq, nk in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(nq + d)
                q = torch.randn(b, h, nq, d, device="cuda", generator=g).bfloat16()
                k = torch.randn(b, hkv, nk, d, device="cuda", generator=g).bfloat16()
                v = torch.randn(b, hkv, nk, d, device="cuda", generator=g).bfloat16()
                params = example_params(op.spec, b, h, nq, nk, device="cuda")
                kw = {"dropout_p": 0.1, "dropout_seed": 1} if op.spec.dropout else {}
                try:
                    with flashgen.use_family(family), torch.no_grad():
                        op(q, k, v, **params, **kw)
                    torch.cuda.synchronize()
                    ran += 1
                except (NotImplementedError, ValueError) as e:  # not served, or params unfit for nq != nk
                    skipped += 1
                    print(f"skip {path.stem} d{d} {nq}x{nk}: {str(e).splitlines()[0][:120]}")
        # one packed batch (sequences shorter and longer than a tile, an empty one) and one
        # block-sparse call (a random pattern of 128-blocks) per spec, d 128
        lens_q, lens_k = [77, 0, 200], [130, 5, 200]
        cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
              for n in (lens_q, lens_k)]
        g = torch.Generator(device="cuda").manual_seed(7)
        qp = torch.randn(sum(lens_q), 4, 128, device="cuda", generator=g).bfloat16()
        kp = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=g).bfloat16()
        pattern = torch.rand(2, 4, 3, 3, device="cuda", generator=g) < 0.6
        qs = torch.randn(2, 4, 300, 128, device="cuda", generator=g).bfloat16()
        ks = torch.randn(2, 2, 300, 128, device="cuda", generator=g).bfloat16()
        calls = [("packed", lambda: op(qp, kp, kp.clone(), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=200,
                                       max_seqlen_k=200, **example_params(op.spec, 3, 4, 200, 200, device="cuda"), **kw)),
                 ("block-sparse", lambda: op(qs, ks, ks.clone(), block_mask=flashgen.BlockMask.from_pattern(pattern, 128),
                                             **example_params(op.spec, 2, 4, 300, 300, device="cuda"), **kw))]
        # one backward per spec at d 128 (the family's own backward where it serves the call)
        qb, kb, vb = (torch.randn(2, 4, 300, 128, device="cuda", generator=g).bfloat16().requires_grad_()
                      for _ in range(3))

        def backward():
            out = op(qb, kb, vb, **example_params(op.spec, 2, 4, 300, 300, device="cuda"), **kw)
            torch.autograd.grad(out, (qb, kb, vb), torch.randn_like(out))

        calls.append(("backward", backward))
        for what, call in calls:
            try:
                with flashgen.use_family(family), torch.set_grad_enabled(what == "backward"):
                    call()
                torch.cuda.synchronize()
                ran += 1
            except (NotImplementedError, ValueError) as e:
                skipped += 1
                print(f"skip {path.stem} {what}: {str(e).splitlines()[0][:120]}")
    print(f"sanitize worker: {ran} calls ran on {family}, {skipped} skipped")
    return 0 if ran else 1  # nothing ran: nothing was checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="sm90")
    ap.add_argument("--tools", default="memcheck,racecheck")
    ap.add_argument("--out", default=None, help="folder for the tools' logs")
    ap.add_argument("--specs", default=None, help="only these specs of specs/ (comma-separated names; default all)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from flashgen import families

    fam = families.get(a.family, "--family")  # ValueError naming it for an unknown family
    if fam.device != "cuda":
        ap.error(f"--family: {fam.name} runs on {fam.device}; compute-sanitizer checks CUDA families")
    if a.worker:
        return worker(a.family, a.specs.split(",") if a.specs else None)
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(tool).exists():
        print("compute-sanitizer not found (CUDA toolkit bin/)", file=sys.stderr)
        return 2
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--family", a.family,
          *(["--specs", a.specs] if a.specs else [])]
    build = subprocess.run(me, check=False)  # build every kernel outside the sanitizer
    if build.returncode != 0:
        return build.returncode
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in a.tools.split(","):
        env = dict(os.environ)
        if name == "memcheck":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        cmd = [tool, "--tool", name, "--error-exitcode", "1", *(["--racecheck-report", "all"] if name == "racecheck" else []),
               *me]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        text = res.stdout + res.stderr
        if out:
            (out / f"{name}.log").write_text(text)
        summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
        print(f"{name}: exit {res.returncode}; {summary[-1] if summary else 'no summary line'}")
        if res.returncode != 0:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
