"""Block-sparse attention (block_mask=) on one GPU: scaling with density and length, and against
FlexAttention with the same mask, all from one run.

    python3 scripts/bench_sparsity.py [--json F] [--n 16384] [--long 65536] [--reps 10]

bf16, B = 1, H = 16, d = 128. Times (CUDA events, median of --reps, flashgen.bench.time_fn) of
the forward and forward+backward:
  * density table at N = --n: dense.attn without a block mask, then random block patterns
    (block 128, each (query block, key block) kept with probability rho) passed as
    BlockMask.from_pattern; the ratio runtime / (rho_actual × dense runtime) (target <= 1.25);
  * at N = --long: a sliding window of 1024 (sliding_window.attn, its block mask from the spec),
    a random 90%-sparse pattern, and the peak memory at N/4, N/2, N (linear in N);
  * document ids at N = --n (16 documents of random lengths): document.attn with a block mask
    built once, without one (block lists built per call by the classifier kernel), and with
    that switched off (FLASHGEN_AUTO_BLOCK_MASK=0: every tile in the causal range visited);
  * FlexAttention (torch.compile'd flex_attention) with the same masks: its create_block_mask
    and flashgen.block_mask / BlockMask.from_pattern timed separately from the attention calls.
FLOPs count visible (query, key) pairs: 4 · B · H · d · pairs forward, × 3.5 forward+backward
(as the other benchmarks); the same count for both implementations.

    python3 scripts/bench_sparsity.py --device cpu [--n 4096] [--heads 8] [--dtype fp32]

The CPU family at N = --n (default 4096): dense against a random 90%-sparse block pattern and a
sliding window of 128 (its block mask from the spec, and without a block mask), forward and
forward+backward, one timed run each after a warm-up, as ratios to dense.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen import flops  # noqa: E402
from flashgen.bench import time_fn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEV = torch.device("cuda")  # the GPU part; --device cpu runs cpu_main
B, H, D, BS = 1, 16, 128, 128


def inputs(n: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(B, H, n, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(3)]


def timed(fn_fwd, q, k, v, reps):
    out = fn_fwd()
    dout = torch.randn_like(out)
    f = time_fn(lambda: fn_fwd(), DEV, reps=reps)

    def fb():
        q.grad = k.grad = v.grad = None
        fn_fwd().backward(dout)

    fbt = time_fn(fb, DEV, reps=reps)
    return f, fbt


def wall_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def tflops(pairs: float, ms: float, kind: str = "fwd") -> float:
    """TFLOP/s of ``pairs`` visible pairs per (batch, head) in ``ms`` (flashgen.flops)."""
    return flops.attention_flops(B * H * pairs, D, kind) / (ms * 1e-3) / 1e12


def window_pairs(n: int, w: int) -> int:
    i = torch.arange(n, dtype=torch.int64)
    return int(torch.clamp(i + 1, max=w).sum())  # keys q - w < kv <= q


def flex_row(flex, mask_mod, n, q, k, v, pairs, reps) -> dict:
    """FlexAttention with ``mask_mod``: its create_block_mask (timed apart) and its forward and
    forward+backward on q, k, v; {} without FlexAttention."""
    if flex is None:
        return {}
    cbm, fa = flex
    build, fbm = wall_ms(lambda: cbm(mask_mod, None, None, n, n, device=DEV))
    ff, ffb = timed(lambda: fa(q, k, v, block_mask=fbm), q, k, v, reps)
    return dict(flex_fwd_ms=ff, flex_fwdbwd_ms=ffb, flex_fwd_tflops=tflops(pairs, ff),
                flex_fwdbwd_tflops=tflops(pairs, ffb, "fwd+bwd"), flex_block_mask_ms=build)


def flex_fns():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return create_block_mask, torch.compile(flex_attention)


def cpu_main(a) -> None:
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    n, h, d = a.n or 4096, a.heads, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(dt).requires_grad_() for _ in range(3))
    dout = torch.randn(1, h, n, d, generator=g).to(dt)
    dense = flashgen.compile(ROOT / "specs" / "dense.attn")
    sw = flashgen.compile(ROOT / "specs" / "sliding_window.attn")
    nb = -(-n // BS)
    pat = torch.rand(1, 1, nb, nb, generator=g) < 0.1
    cases = [("dense", lambda: dense(q, k, v), n * n),
             ("random 90%-sparse pattern (block 128)",
              lambda bm=flashgen.BlockMask.from_pattern(pat, BS): dense(q, k, v, block_mask=bm),
              float(pat.float().mean()) * n * n),
             ("sliding window 128, block mask from the spec",
              lambda bm=flashgen.block_mask(sw, n, n, block_size=BS, window=128): sw(q, k, v, block_mask=bm,
                                                                                     window=128),
              window_pairs(n, 128)),
             ("sliding window 128, no block mask", lambda: sw(q, k, v, window=128), window_pairs(n, 128))]
    rows, base = [], None
    for name, fn, pairs in cases:
        fn().backward(dout)  # warm-up (and first-use build)
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        f, fb = (t1 - t0) * 1e3, (t2 - t0) * 1e3
        base = base or (f, fb)
        r = dict(device="cpu", n=n, heads=h, head_dim=d, dtype=a.dtype, kind=name, fwd_ms=f, fwdbwd_ms=fb,
                 fwd_vs_dense=f / base[0], fwdbwd_vs_dense=fb / base[1], pairs_fraction=pairs / (n * n),
                 threads=torch.get_num_threads())
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--long", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8, help="CPU only")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="CPU only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.device == "cpu":
        return cpu_main(a)
    a.n = a.n or 16384
    dense = flashgen.compile(ROOT / "specs" / "dense.attn")
    sw = flashgen.compile(ROOT / "specs" / "sliding_window.attn")
    flex = flex_fns()
    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    # --- density table
    n = a.n
    q, k, v = inputs(n)
    base_f, base_fb = timed(lambda: dense(q, k, v), q, k, v, a.reps)
    emit(table="density", n=n, rho=1.0, kind="dense (no block mask)", fwd_ms=base_f, fwdbwd_ms=base_fb,
         fwd_tflops=tflops(n * n, base_f), fwdbwd_tflops=tflops(n * n, base_fb, "fwd+bwd"))
    nb = n // BS
    for rho in (1.0, 0.5, 0.25, 0.1, 0.05):
        g = torch.Generator().manual_seed(int(rho * 1000))
        pat = (torch.rand(1, 1, nb, nb, generator=g) < rho).to(DEV)
        actual = float(pat.float().mean())
        bm = flashgen.BlockMask.from_pattern(pat, BS)
        f, fb = timed(lambda bm=bm: dense(q, k, v, block_mask=bm), q, k, v, a.reps)
        pairs = actual * n * n
        r = dict(table="density", n=n, rho=rho, rho_actual=actual, kind="flashgen pattern", fwd_ms=f, fwdbwd_ms=fb,
                 fwd_ratio=f / (actual * base_f), fwdbwd_ratio=fb / (actual * base_fb),
                 fwd_tflops=tflops(pairs, f), fwdbwd_tflops=tflops(pairs, fb, "fwd+bwd"))
        if rho in (0.5, 0.1):
            pat_l = pat[0, 0]
            r.update(flex_row(flex, lambda b, h, qi, kv: pat_l[qi // BS, kv // BS], n, q, k, v, pairs, a.reps))
        ours_build, _ = wall_ms(lambda: flashgen.BlockMask.from_pattern(pat, BS).tile_lists(128, 64, n, n))
        r["flashgen_block_mask_ms"] = ours_build
        emit(**r)
    del q, k, v

    # --- a mask without a closed-form key range: document ids (causal within each document)
    n = a.n
    q, k, v = inputs(n, 2)
    doc = flashgen.compile(ROOT / "specs" / "document.attn")
    g = torch.Generator().manual_seed(3)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:15] + 1).values
    ids = torch.zeros(n, dtype=torch.int32)
    ids[cuts] = 1
    ids = ids.cumsum(0).to(torch.int32)[None].to(DEV)  # 16 documents of random lengths
    lens = torch.bincount(ids[0].long()).cpu()
    pairs = int((lens * (lens + 1) // 2).sum())
    build, bmd = wall_ms(lambda: flashgen.block_mask(doc, n, n, block_size=BS, device=DEV, document_id=ids))
    r = dict(table="document", n=n, documents=16, flashgen_block_mask_ms=build)
    for label, fn in (("block_mask", lambda: doc(q, k, v, block_mask=bmd, document_id=ids)),
                      ("auto", lambda: doc(q, k, v, document_id=ids))):
        f, fb = timed(fn, q, k, v, a.reps)
        r.update({f"{label}_fwd_ms": f, f"{label}_fwdbwd_ms": fb, f"{label}_fwd_tflops": tflops(pairs, f),
                  f"{label}_fwdbwd_tflops": tflops(pairs, fb, "fwd+bwd")})
    import os

    os.environ["FLASHGEN_AUTO_BLOCK_MASK"] = "0"
    f, fb = timed(lambda: doc(q, k, v, document_id=ids), q, k, v, max(2, a.reps // 3))
    os.environ.pop("FLASHGEN_AUTO_BLOCK_MASK")
    r.update(no_lists_fwd_ms=f, no_lists_fwdbwd_ms=fb, no_lists_fwd_tflops=tflops(pairs, f),
             no_lists_fwdbwd_tflops=tflops(pairs, fb, "fwd+bwd"))
    idl = ids[0]
    r.update(flex_row(flex, lambda b, h, qi, kv: (idl[qi] == idl[kv]) & (kv <= qi), n, q, k, v, pairs, a.reps))
    emit(**r)
    del q, k, v

    # --- long sequences: memory and speed
    nl = a.long
    for frac in (4, 2, 1):
        n = nl // frac
        q, k, v = inputs(n, 1)
        torch.cuda.reset_peak_memory_stats()
        bmw_ms, bmw = wall_ms(lambda: flashgen.block_mask(sw, n, n, block_size=BS, device=DEV, window=1024))
        f, fb = timed(lambda: sw(q, k, v, block_mask=bmw, window=1024), q, k, v, a.reps)
        mem = torch.cuda.max_memory_allocated() / 2**30
        pairs = window_pairs(n, 1024)
        r = dict(table="long", n=n, kind="sliding window 1024 (block mask from the spec)", fwd_ms=f, fwdbwd_ms=fb,
                 fwd_tflops=tflops(pairs, f), fwdbwd_tflops=tflops(pairs, fb, "fwd+bwd"), peak_gib=mem,
                 flashgen_block_mask_ms=bmw_ms)
        if frac == 1:
            f2, fb2 = timed(lambda: sw(q, k, v, window=1024), q, k, v, a.reps)
            r.update(no_block_mask_fwd_ms=f2, no_block_mask_fwdbwd_ms=fb2)
            r.update(flex_row(flex, lambda b, h, qi, kv: (kv <= qi) & (qi - kv < 1024), n, q, k, v, pairs, a.reps))
        emit(**r)
        nb = n // BS
        g = torch.Generator().manual_seed(7)
        pat = (torch.rand(1, 1, nb, nb, generator=g) < 0.1).to(DEV)
        actual = float(pat.float().mean())
        torch.cuda.reset_peak_memory_stats()
        bm = flashgen.BlockMask.from_pattern(pat, BS)
        f, fb = timed(lambda: dense(q, k, v, block_mask=bm), q, k, v, a.reps)
        mem = torch.cuda.max_memory_allocated() / 2**30
        pairs = actual * n * n
        r = dict(table="long", n=n, kind="random 90%-sparse pattern", rho_actual=actual, fwd_ms=f, fwdbwd_ms=fb,
                 fwd_tflops=tflops(pairs, f), fwdbwd_tflops=tflops(pairs, fb, "fwd+bwd"), peak_gib=mem)
        if frac == 1:
            pat_l = pat[0, 0]
            r.update(flex_row(flex, lambda b, h, qi, kv: pat_l[qi // BS, kv // BS], n, q, k, v, pairs, a.reps))
        emit(**r)
        del q, k, v
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
