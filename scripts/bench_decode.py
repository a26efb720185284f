"""Decode bandwidth: op.with_kvcache (the sm80 family's split-KV kernels) next to SDPA's flash and
cuDNN backends and a plain read-only kernel over the same bytes, in one run on one GPU.

    python3 scripts/bench_decode.py [--spec specs/causal.attn] [--shapes 1x32768,16x8192,64x4096,128x1024]
                                    [--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16]
                                    [--paged 0,16,256] [--splits 0] [--family sm80] [--json out.json]

Per shape B x cache (every sequence holds `cache` keys, Sq = 1, no append), GB/s are the bytes of
the K and V positions attended (B · Hkv · cache · d · 2 tensors · element size) per second
(DESIGN.md, "Decode bandwidth"):
  * flashgen[-paged<P>][-s<n>]: op.with_kvcache on a contiguous cache [B, Hkv, cache, d], or a
    paged one (page size P, pages shuffled in the pool), with num_splits n (0: the family's
    choice, printed);
  * sdpa-flash, sdpa-cudnn: torch.nn.functional.scaled_dot_product_attention under
    sdpa_kernel(FLASH_ATTENTION / CUDNN_ATTENTION) on q [B, H, 1, d] and k, v [B, Hkv, cache, d]
    with enable_gqa=True (where a backend refuses GQA, k and v expanded to H heads: the note
    says so and the bytes counted stay those of the Hkv heads);
  * read-only: torch.sum over K and V (fp32 accumulation), the ceiling of a kernel that reads
    those bytes once.
Timing: triton.testing.do_bench (an L2 flush before each call, 25 warm-up calls, the median of
100 ms of calls) when triton is importable, else the same method with CUDA events. JSON out:
one row per (shape, implementation) with ms, GB/s and the ratios to read-only and to cuDNN.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import families  # noqa: E402
from flashgen.lang import ir  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_ms(fn) -> float:
    """Median ms of fn: triton's do_bench, else its method (L2 flush, 25 warm-ups, >= 100 ms)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(25):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = max(10, int(100 / max(start.elapsed_time(end), 1e-3)))
    times = []
    for _ in range(n):
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_copy(k: torch.Tensor, v: torch.Tensor, page_size: int, g: torch.Generator):
    """[num_pages, page_size, Hkv, d] pools holding k and v with shuffled pages, and the table."""
    B, H, cap, d = k.shape
    pages = cap // page_size
    perm = torch.randperm(B * pages, generator=g).to(k.device)
    table = perm.view(B, pages).to(torch.int32)
    pk = torch.empty(B * pages, page_size, H, d, dtype=k.dtype, device=k.device)
    pv = torch.empty_like(pk)
    pk[perm] = k.view(B, H, pages, page_size, d).permute(0, 2, 3, 1, 4).reshape(B * pages, page_size, H, d)
    pv[perm] = v.view(B, H, pages, page_size, d).permute(0, 2, 3, 1, 4).reshape(B * pages, page_size, H, d)
    return pk, pv, table


def sdpa_call(backend, q, k, v):
    """A callable running SDPA on ``backend`` (GQA natively, else k, v expanded), and a note."""
    from torch.nn.attention import sdpa_kernel

    def native():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        native()
        torch.cuda.synchronize()
        return native, ""
    except (RuntimeError, TypeError) as e:
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    group = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(group, 1) for t in (k, v))

    def expanded():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, ke, ve)

    try:
        expanded()
        torch.cuda.synchronize()
        return expanded, f"k, v expanded to {q.shape[1]} heads (GQA refused: {first})"
    except RuntimeError as e:
        return None, f"unavailable: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(Path(__file__).resolve().parent.parent / "specs" / "causal.attn"))
    ap.add_argument("--shapes", default="1x32768,16x8192,64x4096,128x1024", help="B x cache, comma separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--paged", default="0", help="page sizes to time (0: the contiguous cache), comma separated")
    ap.add_argument("--splits", default="0", help="num_splits values to time (0: the family's choice)")
    ap.add_argument("--family", default="sm80")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA device", file=sys.stderr)
        return 2
    dtype, H, Hkv, d = DTYPES[args.dtype], args.heads, args.kv_heads, args.head_dim
    op = flashgen.compile(args.spec)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(0)
    rows = []
    from torch.nn.attention import SDPBackend

    with flashgen.use_family(args.family), torch.inference_mode():
        fam = families.get(args.family)
        op.decode_library(fam, dev, ir.DType(args.dtype), d)  # built before timing
        for shape in args.shapes.split(","):
            B, cap = (int(x) for x in shape.lower().split("x"))
            nbytes = 2 * B * Hkv * cap * d * torch.tensor([], dtype=dtype).element_size()
            q = torch.randn(B, H, 1, d, generator=g).to(dtype).to(dev)
            k = torch.randn(B, Hkv, cap, d, generator=g).to(dtype).to(dev)
            v = torch.randn(B, Hkv, cap, d, generator=g).to(dtype).to(dev)
            seqlens = torch.full((B,), cap, dtype=torch.int32, device=dev)
            results = {}

            def record(name, fn, note=""):
                ms = bench_ms(fn) if fn is not None else None
                gbs = nbytes / (ms * 1e-3) / 1e9 if ms else None
                results[name] = gbs
                rows.append({"impl": name, "batch": B, "cache": cap, "heads": H, "kv_heads": Hkv, "head_dim": d,
                             "dtype": args.dtype, "ms": ms, "gbps": gbs, "note": note})
                print(f"B={B:4d} cache={cap:6d} {name:24s} "
                      + (f"{ms:8.4f} ms {gbs:8.1f} GB/s" if ms else " " * 26) + (f"  {note}" if note else ""))

            record("read-only", lambda: (torch.sum(k, dtype=torch.float32), torch.sum(v, dtype=torch.float32)))
            for backend, name in ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"),
                                  (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn")):
                fn, note = sdpa_call(backend, q, k, v)
                record(name, fn, note)
            for ps in (int(x) for x in args.paged.split(",")):
                if ps:
                    if cap % ps:
                        continue
                    kc, vc, table = paged_copy(k, v, ps, g)
                else:
                    kc, vc, table = k, v, None
                for s in (int(x) for x in args.splits.split(",")):
                    def call(kc=kc, vc=vc, table=table, s=s):
                        return op.with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=s)

                    call()
                    lib = op.decode_library(fam, dev, ir.DType(args.dtype), d)
                    note = ""
                    if lib.decode is not None:
                        from flashgen.abi import FgFwdArgs

                        sms = torch.cuda.get_device_properties(dev).multi_processor_count
                        a = FgFwdArgs(batch=B, heads_q=H, heads_kv=Hkv, seqlen_q=1, num_sms=sms)
                        a.kv_cache.capacity = cap
                        note = f"num_splits {op.launch_fields(lib).kv_splits(a, lib.instantiation, s)}"
                    name = "flashgen" + (f"-paged{ps}" if ps else "") + (f"-s{s}" if s else "")
                    record(name, call, note)
            for r in rows:
                if r["batch"] == B and r["cache"] == cap and r["gbps"]:
                    ro, cu = results.get("read-only"), results.get("sdpa-cudnn")
                    r["vs_read_only"] = r["gbps"] / ro if ro else None
                    r["vs_cudnn"] = r["gbps"] / cu if cu else None
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
