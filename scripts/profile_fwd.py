#!/usr/bin/env python3
"""One forward (or backward) call of flashgen or a peer inside a profiler window, for Nsight Compute.

Runs warm-up calls outside the window, then ``--calls`` calls between cudaProfilerStart and
cudaProfilerStop, so that `ncu --profile-from-start off` sees only the attention kernels of
those calls (input creation, poisoning and warm-up stay out); with ``--backward`` the window
holds only the backward of a forward run before it (torch.autograd.grad with a random dout).
Shapes follow the peer preset:
bf16, batch * seqlen = 16K tokens, heads * head_dim = 2048. Usage (on the GPU machine):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        python3 scripts/profile_fwd.py --spec causal --head-dim 128 --seqlen 1024 --impl flashgen

``--impl``: flashgen (the op as a user calls it; FLASHGEN_FAMILY forces a family) or any
CUDA peer of flashgen.bench.peers (sdpa-cudnn, sdpa-flash, flex, ...).
"""

from __future__ import annotations

import argparse

import torch

import flashgen
from flashgen import bench, params as fg_params, paths


def main(argv=None) -> int:
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    ap.add_argument("--spec", default="causal", help="a spec name in specs/, or a .attn file")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--impl", default="flashgen", help="flashgen or a CUDA peer name (sdpa-cudnn, ...)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1, help="calls inside the profiler window")
    ap.add_argument("--backward", action="store_true", help="profile the backward (gradients of q, k, v)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    try:
        op = flashgen.compile(paths.example_spec(a.spec))
    except ValueError as e:
        ap.error(f"argument --spec: {e}")
    d, n = a.head_dim, a.seqlen
    b, h = max(1, 16384 // n), max(1, 2048 // d)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=a.backward)
               for _ in range(3))
    params = fg_params.example_params(op.spec, b, h, n, n, dev)
    if a.impl == "flashgen":
        def fn():
            return op(q, k, v, **params)
    else:
        peer = bench.peers(op.spec, dev).get(a.impl)
        if peer is None:
            ap.error(f"--impl: {a.impl!r} is not available here")

        def fn():
            return peer(q, k, v, params)
    step = fn
    if a.backward:
        out = fn()
        dout = torch.randn_like(out)

        def step():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(a.calls):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    what = "backward" if a.backward else "forward"
    print(f"{a.impl} {a.spec} d{d} N{n} B{b} H{h}: {a.calls} {what} call(s) profiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
