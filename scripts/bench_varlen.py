"""Packed (varlen) batches against the same batch padded to its longest sequence (CUDA).

    python3 scripts/bench_varlen.py [--spec specs/causal.attn] [--lengths 1,0,1000,...] [--json F]

Times, on one GPU in one run (CUDA events, median of --reps, flashgen.bench.time_fn), for the
forward and forward+backward:
  * packed:  op(q, k, v, cu_seqlens_q=..., ...) on the packed batch (the varlen layout);
  * packed-static: the same with FLASHGEN_SM90_SCHEDULE=static (the sm90 forward's static
             round-robin of query tiles instead of its dynamic, longest-first schedule);
  * padded:  the same op on [B, H, max_len, d] tensors, every sequence padded to the longest
             (what a batch without varlen support costs; the padded rows' outputs are unused);
  * ideal:   the packed batch's FLOPs at the TFLOP/s of a uniform batch of the same spec
             (B = 16384 // N sequences of N = --uniform-seqlen tokens): the padding-free cost.
  * packed-kernels, uniform-kernels (--kernel-time, forward): the GPU time of the call's
             kernels alone (torch.profiler), without the packed call's host-side validation.
  * sdpa-nested: torch SDPA on a jagged nested tensor (flash/cuDNN varlen kernels), when
             torch supports it for the spec (causal and dense only).
FLOPs count the visible (query, key) pairs of each sequence: 4 · H · d · pairs (forward),
× 3.5 forward+backward. The packed op validates cu_seqlens on the host once per cu_seqlens
tensor and version (one device-to-host copy); the benchmark reuses its tensors, so calls after the
first reuse the validated layout.
"""

from __future__ import annotations

import argparse
from collections import Counter
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import flops  # noqa: E402
from flashgen.bench import time_fn  # noqa: E402


def kernel_ms(fn, reps: int) -> float:
    """GPU time of one call's kernels (torch.profiler's CUDA kernel durations summed over
    ``reps`` calls, divided by reps; copies excluded): what a call costs the GPU when its host
    work -- here the packed layout's validation, one device-to-host copy -- is not on the
    critical path."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            total_us += e.device_time
    return total_us / reps / 1e3


def pairs(spec, n: int) -> int:
    """Visible (query, key) pairs of one sequence of n tokens (the reference's keep mask)."""
    if spec.params:
        raise SystemExit(f"{spec.name}: a spec without parameters, please (FLOPs from its mask alone)")
    keep = flashgen.reference.keep_mask(spec, n, n, "cpu", batch=1, heads=1)
    return n * n if keep is None else int(keep.sum())


def workload_flops(spec, lens: list[int], heads: int, head_dim: int, kind: str) -> float:
    """FLOPs of ``heads`` heads over sequences of the lengths ``lens`` (flashgen.flops)."""
    counts = Counter(lens)
    return flops.attention_flops(heads * sum(c * pairs(spec, n) for n, c in counts.items()), head_dim, kind)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="specs/causal.attn")
    ap.add_argument("--lengths", default="1,0,1000,37,512,4096,2048,3000,77,1500,3500,200")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--uniform-seqlen", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernel-time", action="store_true",
                    help="also the forward kernels' GPU time alone (torch.profiler), packed and uniform")
    a = ap.parse_args()

    dev = torch.device("cuda")
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    op = flashgen.compile(a.spec)
    name = op.spec.name
    lens = [int(x) for x in a.lengths.split(",")]
    H, d, B, mx, total = a.heads, a.head_dim, len(lens), max(lens), sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    fl = {k: workload_flops(op.spec, lens, H, d, k) for k in ("fwd", "fwd+bwd")}
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    qp, kp, vp = rnd(total, H, d), rnd(total, H, d), rnd(total, H, d)
    qd, kd, vd = rnd(B, H, mx, d), rnd(B, H, mx, d), rnd(B, H, mx, d)
    Nu = a.uniform_seqlen
    Bu = max(1, 16384 // Nu)
    qu, ku, vu = rnd(Bu, H, Nu, d), rnd(Bu, H, Nu, d), rnd(Bu, H, Nu, d)
    fl_u = {k: workload_flops(op.spec, [Nu] * Bu, H, d, k) for k in ("fwd", "fwd+bwd")}
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)

    def static_schedule():
        old = os.environ.get("FLASHGEN_SM90_SCHEDULE")
        os.environ["FLASHGEN_SM90_SCHEDULE"] = "static"
        try:
            return op(qp, kp, vp, **varlen)
        finally:
            if old is None:
                del os.environ["FLASHGEN_SM90_SCHEDULE"]
            else:
                os.environ["FLASHGEN_SM90_SCHEDULE"] = old

    impls = {
        "packed": lambda: op(qp, kp, vp, **varlen),
        "packed-static": static_schedule,
        "padded": lambda: op(qd, kd, vd),
        "uniform": lambda: op(qu, ku, vu),
    }
    try:  # SDPA on a jagged nested tensor: [B, j, H, d] -> transpose to [B, H, j, d]
        offs = cu.to(torch.int64)
        leaves = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
        nested = [torch.nested.nested_tensor_from_jagged(t, offs).transpose(1, 2) for t in leaves]
        causal = name == "causal"

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(*nested, is_causal=causal)
        sdpa()
        impls["sdpa-nested"] = sdpa
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"sdpa-nested: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})")

    rows = []
    for direction in ("fwd", "fwd+bwd"):
        times = {}
        for impl, fn in impls.items():
            call = fn
            if direction == "fwd+bwd":
                def call(fn=fn, impl=impl):
                    ins = {"packed": (qp, kp, vp), "packed-static": (qp, kp, vp), "padded": (qd, kd, vd),
                           "uniform": (qu, ku, vu)}.get(impl)
                    if ins is not None:
                        for t in ins:
                            t.requires_grad_(True)
                    out = fn()
                    nested_out = out.is_nested
                    out = out.transpose(1, 2).values() if nested_out else out
                    out.sum().backward(retain_graph=nested_out)
                    if ins is not None:
                        for t in ins:
                            t.grad = None
            try:
                times[impl] = time_fn(call, dev, reps=a.reps)
            except Exception as e:  # noqa: BLE001
                print(f"{impl} {direction}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        if "uniform" in times:
            tf_u = fl_u[direction] / times["uniform"] / 1e9
            times["ideal"] = fl[direction] / (tf_u * 1e9)
        if direction == "fwd" and a.kernel_time:  # kernels alone (profiler), packed and uniform
            for impl in ("packed", "uniform"):
                times[f"{impl}-kernels"] = kernel_ms(impls[impl], a.reps)
        for impl, ms in times.items():
            f = (fl_u if impl.startswith("uniform") else fl)[direction]
            row = {"impl": impl, "direction": direction, "ms": round(ms, 4), "tflops": round(f / ms / 1e9, 1),
                   "lengths": lens, "heads": H, "head_dim": d, "dtype": a.dtype, "spec": name}
            rows.append(row)
            print(f"{impl:12s} {direction:8s} {ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s")
    print(f"# {name}, {a.dtype}, H={H}, d={d}, lengths={lens} (total {total}, max {mx}); "
          f"uniform: B={Bu}, N={Nu}; GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
