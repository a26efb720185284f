"""Checks of fuzzed specs (flashgen/tools/fuzz_gen.py), each case named by its seed.

- ``check_parse``: both spellings of a spec parse, validate and have one fingerprint.
- ``HookBinary``: the generated hooks of many specs compiled into one small shared library
  (g++ -O1, no kernel), then for each spec (``check_hooks``): the element mask against
  ``reference.keep_mask``, the closed-form key ranges and full-tile tests sound over every tile
  of several sizes, ``kRowExact`` honest, score and its derivative against the reference's
  autograd and the parameter gradients against the reference's (exhaustively, small shapes).
- ``build_kernels`` compiles many specs' CPU kernels in one build (flashgen/build/cache.py
  ``load_together``); ``check_kernels`` runs forward and backward (q, k, v and f32 tensor
  parameters) on small odd shapes against the float64 reference with flashgen/check.py's rule.

Every check returns a list of problems (strings naming the seed), empty when the spec passes.
"""

from __future__ import annotations

import ctypes
import random
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import check, reference
from ..build import cache
from ..codegen import render, variant
from ..families import cpu_tiles
from ..lang import expr as X
from ..lang import frontend, ir
from ..lang.expr import FUNCTIONS
from ..paths import include_dir
from ..runtime import op as op_mod
from .fuzz_gen import Fuzzed

HOOK_FUNCS = r"""
template <class V> void keep_matrix(const void* p, int b, int h, int nq, int nk, uint8_t* out) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j) out[i * nk + j] = V::keep(P, b, h, i, j, nq, nk);
}
template <class V> void score_matrix(const void* p, int B, int H, int nq, int nk, const float* s, float* out,
                                     float* dout) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) {
          const int64_t x = ((int64_t)(b * H + h) * nq + i) * nk + j;
          out[x] = V::score(P, s[x], b, h, i, j, nq, nk);
          dout[x] = V::dscore(P, s[x], b, h, i, j, nq, nk);
        }
}
template <class V> void param_grad_all(const void* p, int B, int H, int nq, int nk, const float* s,
                                       const float* ds) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) {
          const int64_t x = ((int64_t)(b * H + h) * nq + i) * nk + j;
          V::param_grad(P, ds[x], s[x], b, h, i, j, nq, nk);
        }
}
template <class V> int row_exact_violations(const void* p, int b, int h, int nq, int nk) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  if (!V::kRowExact) return 0;
  int bad = 0;
  for (int i = 0; i < nq; ++i) {
    int lo = V::kv_lo(P, b, h, i, i + 1, nq, nk), hi = V::kv_hi(P, b, h, i, i + 1, nq, nk);
    lo = lo < 0 ? 0 : lo; hi = hi > nk ? nk : hi;
    for (int j = 0; j < nk; ++j)
      if (bool(V::keep(P, b, h, i, j, nq, nk)) != (j >= lo && j < hi)) ++bad;
  }
  return bad;
}
template <class V> int range_violations(const void* p, int b, int h, int nq, int nk, int tq, int tk) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  int bad = 0;
  for (int q0 = 0; q0 < nq; q0 += tq) {
    const int q1 = q0 + tq < nq ? q0 + tq : nq;
    int lo = V::kv_lo(P, b, h, q0, q1, nq, nk), hi = V::kv_hi(P, b, h, q0, q1, nq, nk);
    lo = lo < 0 ? 0 : lo; hi = hi > nk ? nk : hi;
    for (int i = q0; i < q1; ++i)
      for (int j = 0; j < nk; ++j)
        if (V::keep(P, b, h, i, j, nq, nk) && (j < lo || j >= hi)) ++bad;
    for (int k0 = 0; k0 < nk; k0 += tk) {
      const int k1 = k0 + tk < nk ? k0 + tk : nk;
      if (!V::tile_full(P, b, h, q0, q1, k0, k1, nq, nk)) continue;
      for (int i = q0; i < q1; ++i)
        for (int j = k0; j < k1; ++j)
          if (!V::keep(P, b, h, i, j, nq, nk)) ++bad;
    }
  }
  return bad;
}
template <class V> int keep_at(const void* p, int b, int h, int q, int kv, int nq, int nk) {
  return V::keep(*static_cast<const typename V::Params*>(p), b, h, q, kv, nq, nk);
}
template <class V> float score_at(const void* p, float s, int b, int h, int q, int kv, int nq, int nk) {
  return V::score(*static_cast<const typename V::Params*>(p), s, b, h, q, kv, nq, nk);
}
// Row q's key range and the full-tile test of [q, q+1) x [k0, k0 + 8) at the sampled keys
// (positions far beyond what an exhaustive check reaches: 32-bit narrowing, 64-bit bounds).
template <class V> int far_row(const void* p, int b, int h, int q, int nq, int nk, const int* kvs, int n) {
  const typename V::Params& P = *static_cast<const typename V::Params*>(p);
  int lo = V::kv_lo(P, b, h, q, q + 1, nq, nk), hi = V::kv_hi(P, b, h, q, q + 1, nq, nk);
  lo = lo < 0 ? 0 : lo; hi = hi > nk ? nk : hi;
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    const int kv = kvs[i];
    if (kv < 0 || kv >= nk) continue;
    if (V::keep(P, b, h, q, kv, nq, nk) && (kv < lo || kv >= hi)) ++bad;
    const int k0 = kv & ~7, k1 = k0 + 8 < nk ? k0 + 8 : nk;
    if (V::tile_full(P, b, h, q, q + 1, k0, k1, nq, nk) && !V::keep(P, b, h, q, kv, nq, nk)) ++bad;
  }
  return bad;
}
template <class V> int param_grad_enabled(const void* p) {
  return V::param_grad_enabled(*static_cast<const typename V::Params*>(p));
}
"""
_FUNCS = ("keep_matrix", "score_matrix", "param_grad_all", "row_exact_violations", "range_violations",
          "param_grad_enabled", "keep_at", "score_at", "far_row")
_SIGS = {"keep_matrix": "void(*)(const void*, int, int, int, int, uint8_t*)",
         "score_matrix": "void(*)(const void*, int, int, int, int, const float*, float*, float*)",
         "param_grad_all": "void(*)(const void*, int, int, int, int, const float*, const float*)",
         "row_exact_violations": "int(*)(const void*, int, int, int, int)",
         "range_violations": "int(*)(const void*, int, int, int, int, int, int)",
         "param_grad_enabled": "int(*)(const void*)",
         "keep_at": "int(*)(const void*, int, int, int, int, int, int)",
         "score_at": "float(*)(const void*, float, int, int, int, int, int, int)",
         "far_row": "int(*)(const void*, int, int, int, int, int, const int*, int)"}

HOOK_SHAPES = ((1, 1), (9, 9), (13, 7), (6, 17))
HOOK_TILES = ((1, 1), (2, 3), (4, 4), (5, 3), (3, 8))


def check_parse(fz: Fuzzed) -> tuple[ir.Spec | None, list[str]]:
    """(the parsed spec, problems): both spellings parse, with one fingerprint."""
    try:
        spec = frontend.parse(fz.text)
        full = frontend.parse(fz.text_full)
    except Exception as e:  # noqa: BLE001 - any failure of a well-typed spec is a finding
        return None, [f"seed {fz.seed}: does not parse: {type(e).__name__}: {e}"]
    if spec.fingerprint() != full.fingerprint():
        return spec, [f"seed {fz.seed}: the two spellings have different fingerprints"]
    return spec, []


def features(fz: Fuzzed) -> set[str]:
    """What a spec's text uses (names, operators, functions, built-ins, parameter kinds), for the
    long run's coverage count."""
    tokens = set(re.findall(r"[A-Za-z_]\w*|//|<=|>=|==|!=|[-+*/%<>\[]", fz.text.split("{", 1)[1]))
    words = {"b", "h", "q", "kv", "seqlen_q", "seqlen_k", "score", "true", "false", "and", "or", "not",
             "causal", "causal_top_left", "window", "prefix_lm", "document", "key_padding", "chunked",
             "dropout", "scale", "dtype", "head_dim", *FUNCTIONS}
    out = {t for t in tokens if t in words or not t[0].isalpha()}
    out |= {f"param {p.kind if p.kind != 'tensor' else p.dtype}" for p in fz.params}
    out |= {f"dim {d[0]}" + ("|1" if d[2] else "") for p in fz.params for d in p.dims}
    if re.search(r"\[[^\]]*\w\[", fz.text):
        out.add("nested index")
    return out


def values(fz: Fuzzed, B: int, H: int, nq: int, nk: int, rng: random.Random) -> dict:
    """Parameter values for one call shape: ints by role, floats exact in fp32, tensors of the
    declared shape (broadcast dims drawn as 1 or full) with small values."""
    out: dict = {}
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for p in fz.params:
        if p.kind == "int":
            out[p.name] = {"free": rng.randint(-6, 10), "dim": rng.randint(0, 3), "chunk": rng.randint(1, 6)}[p.role]
        elif p.kind == "float":
            out[p.name] = rng.randint(-128, 128) / 64
    for p in fz.params:
        if p.kind != "tensor":
            continue
        shape = []
        for what, value, broadcast in p.dims:
            size = {"batch": B, "heads": H, "seqlen_q": nq, "seqlen_k": nk}.get(what)
            if what == "lit":
                size = value
            elif what == "pexpr":
                name, a, c = value
                size = a * out[name] + c
            shape.append(1 if broadcast and rng.random() < 0.5 else size)
        if p.doc:
            out[p.name] = torch.randint(0, 4, shape, generator=g).sort(-1).values.to(_TORCH[p.dtype])
        elif p.dtype == "f32":
            out[p.name] = torch.randn(shape, generator=g)
        elif p.dtype == "bool":
            out[p.name] = torch.rand(shape, generator=g) < 0.6
        else:
            out[p.name] = torch.randint(-4, 9, shape, generator=g).to(_TORCH[p.dtype])
    return out


_TORCH = {"i32": torch.int32, "i64": torch.int64, "f32": torch.float32, "bool": torch.bool}


class HookBinary:
    """The hooks of ``specs`` ({seed: ir.Spec}) compiled into one shared library (``edit``:
    (seed, rendered variant) → the variant to compile, for testing the checks themselves)."""

    def __init__(self, specs: dict[int, ir.Spec], folder: Path | None = None, edit=None):
        self.seeds = list(specs)
        self.index = {s: i for i, s in enumerate(self.seeds)}
        self._tmp = tempfile.TemporaryDirectory(prefix="fg-fuzz-hooks-") if folder is None else None
        folder = Path(self._tmp.name if folder is None else folder)
        parts = ["#include <cmath>\n#include <cstdint>\n#include \"flashgen/variant.h\"\n", HOOK_FUNCS]
        structs = []
        for i, spec in enumerate(specs.values()):
            ctx = variant.variant_context(spec)
            text = render.render("variant.h.jinja", **ctx)
            if edit is not None:  # the checker's own test: a deliberately broken variant
                text = edit(self.seeds[i], text)
            parts.append(f"namespace fz_{i} {{\n{text}\n}}\n")
            structs.append(f"fz_{i}::{ctx['struct']}")
        for fn in _FUNCS:
            table = ", ".join(f"&{fn}<{s}>" for s in structs) or "nullptr"
            parts.append(f"using {fn}_t = {_SIGS[fn]};\nstatic const {fn}_t {fn}_table[] = {{{table}}};\n")
        parts.append("extern \"C\" void* fz_fn(int which, int fn) {\n  switch (fn) {\n" + "".join(
            f"    case {j}: return (void*){fn}_table[which];\n" for j, fn in enumerate(_FUNCS))
            + "  }\n  return nullptr;\n}\n")
        parts.append("extern \"C\" int fz_row_exact(int which) {\n  static const int t[] = {"
                     + ", ".join(f"{s}::kRowExact" for s in structs or ["0"]) + "};\n  return t[which];\n}\n")
        src = folder / "hooks.cpp"
        src.write_text("".join(parts))
        so = folder / "hooks.so"
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include_dir()}", str(src), "-o",
                            str(so)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"the generated hooks of seeds {self.seeds} do not compile:\n{r.stderr[-4000:]}")
        self.lib = ctypes.CDLL(str(so))
        self.lib.fz_fn.restype = ctypes.c_void_p
        self.lib.fz_fn.argtypes = [ctypes.c_int, ctypes.c_int]
        self.lib.fz_row_exact.argtypes = [ctypes.c_int]
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._types = {
            "keep_matrix": ctypes.CFUNCTYPE(None, vp, i, i, i, i, vp),
            "score_matrix": ctypes.CFUNCTYPE(None, vp, i, i, i, i, vp, vp, vp),
            "param_grad_all": ctypes.CFUNCTYPE(None, vp, i, i, i, i, vp, vp),
            "row_exact_violations": ctypes.CFUNCTYPE(i, vp, i, i, i, i),
            "range_violations": ctypes.CFUNCTYPE(i, vp, i, i, i, i, i, i),
            "param_grad_enabled": ctypes.CFUNCTYPE(i, vp),
            "keep_at": ctypes.CFUNCTYPE(i, vp, i, i, i, i, i, i),
            "score_at": ctypes.CFUNCTYPE(ctypes.c_float, vp, ctypes.c_float, i, i, i, i, i, i),
            "far_row": ctypes.CFUNCTYPE(i, vp, i, i, i, i, i, vp, i)}

    def fn(self, seed: int, name: str):
        return self._types[name](self.lib.fz_fn(self.index[seed], _FUNCS.index(name)))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def check_hooks(fz: Fuzzed, spec: ir.Spec, hooks: HookBinary, draws: int = 2) -> list[str]:
    """The hooks of ``spec`` against the reference, exhaustively on small shapes."""
    op = op_mod.compile(spec)
    rng = random.Random(fz.seed)
    keep_m, row_ex, ranges = (hooks.fn(fz.seed, n) for n in ("keep_matrix", "row_exact_violations",
                                                             "range_violations"))
    problems: list[str] = []
    B, H = 2, 3
    for nq, nk in HOOK_SHAPES:
        for _ in range(draws):
            vals = values(fz, B, H, nq, nk, rng)
            block = op.params_block([vals[p.name] for p in spec.params])
            ptr = ctypes.addressof(block) if block is not None else None
            where = f"seed {fz.seed} nq={nq} nk={nk} {_show(vals)}"
            if spec.mask is not None:
                ref = reference.keep_mask(spec, nq, nk, batch=B, heads=H, **vals)
                got = torch.zeros(nq, nk, dtype=torch.uint8)
                for b in range(B):
                    for h in range(H):
                        keep_m(ptr, b, h, nq, nk, _ptr(got))
                        want = ref[min(b, ref.shape[0] - 1), min(h, ref.shape[1] - 1)]
                        if not torch.equal(got.bool(), want):
                            problems.append(f"{where} b={b} h={h}: keep differs from the reference "
                                            f"at {(got.bool() != want).nonzero()[:4].tolist()}")
                            return problems
            for b in range(B):
                for h in range(H):
                    bad = row_ex(ptr, b, h, nq, nk)
                    if bad:
                        problems.append(f"{where} b={b} h={h}: {bad} keys break kRowExact")
                    for tq, tk in HOOK_TILES:
                        bad = ranges(ptr, b, h, nq, nk, tq, tk)
                        if bad:
                            problems.append(f"{where} b={b} h={h} tiles {tq}x{tk}: {bad} key-range or "
                                            "full-tile violations")
                            return problems
            if spec.score is not None and (nq, nk) == (13, 7):
                problems += _check_score(fz, spec, hooks, vals, block, ptr, B, H, nq, nk, where)
    return problems


def _close(got: torch.Tensor, refs: list[torch.Tensor], rtol: float, atol: float) -> torch.Tensor:
    """Elements of ``got`` close to none of ``refs`` (the float64 reference, and the fp32 one:
    at a discontinuity, such as a branch of where() or sign() decided by a rounding, the
    kernel's fp32 may side with either)."""
    bad = torch.ones_like(got, dtype=torch.bool)
    for ref in refs:
        bad &= ~torch.isclose(got, ref.double(), rtol=rtol, atol=atol, equal_nan=True)
    return bad


def _check_score(fz, spec, hooks, vals, block, ptr, B, H, nq, nk, where) -> list[str]:
    g = torch.Generator().manual_seed(fz.seed)
    s32 = (torch.randn(B, H, nq, nk, generator=g) * 3).contiguous()
    s = s32.double().requires_grad_()
    p64 = {n: (x.double().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
           for n, x in vals.items()}
    env = reference.positions(B, H, nq, nk)
    ref = reference.evaluate(spec.score, spec, env | {"score": s}, p64, torch.float64).expand(s.shape).double()
    ref32 = reference.evaluate(spec.score, spec, env | {"score": s32}, vals, torch.float32).expand(s.shape)
    ds = torch.randn(B, H, nq, nk, generator=g, dtype=torch.float64)
    if ref.requires_grad:
        ref.backward(torch.ones_like(ref), retain_graph=True)
    dref = s.grad.clone() if s.grad is not None else torch.zeros_like(s)
    out, dout = torch.empty(B, H, nq, nk), torch.empty(B, H, nq, nk)
    hooks.fn(fz.seed, "score_matrix")(ptr, B, H, nq, nk, _ptr(s32), _ptr(out), _ptr(dout))
    problems = []
    scale = 1 + float(ref.detach().abs().max())
    bad = _close(out.double(), [ref.detach(), ref32.double()], 1e-4, 1e-5 * scale)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        problems.append(f"{where}: score at {i}: kernel {float(out[tuple(i)])} reference "
                        f"{float(ref.detach()[tuple(i)])}")
    dscale = 1 + float(dref.abs().max())
    bad = _close(dout.double(), [dref], 1e-3, 1e-4 * dscale)
    # d score / d s of the fp32 reference: where a rounding picked the other branch
    s32g = s32.clone().requires_grad_()
    r32 = reference.evaluate(spec.score, spec, env | {"score": s32g}, vals, torch.float32).expand(s.shape).float()
    if r32.requires_grad:
        r32.backward(torch.ones_like(r32))
        bad &= _close(dout.double(), [s32g.grad.double()], 1e-3, 1e-4 * dscale)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        problems.append(f"{where}: dscore at {i}: kernel {float(dout[tuple(i)])} reference {float(dref[tuple(i)])}")
    grads = {}
    for p in spec.params:
        f = f"{p.name}_grad"
        if any(fl.name == f for fl in variant.param_fields(spec)):
            grads[p.name] = torch.zeros(vals[p.name].shape)
            setattr(block, f, grads[p.name].data_ptr())
    if grads:
        # (a score whose derivative in the parameter is 0, e.g. floor division of it, may leave
        # param_grad disabled: the kernels then add nothing, the reference's gradient is 0)
        enabled = hooks.fn(fz.seed, "param_grad_enabled")(ptr)
        ref_w = (ref * ds).sum()
        leaves = [p64[n] for n in grads]
        want = torch.autograd.grad(ref_w, leaves, allow_unused=True)
        ds32 = ds.float().contiguous()
        if enabled:
            hooks.fn(fz.seed, "param_grad_all")(ptr, B, H, nq, nk, _ptr(s32), _ptr(ds32))
        for (n, got), w in zip(grads.items(), want, strict=True):
            w = torch.zeros_like(p64[n]) if w is None else w
            tol = 1e-3 * (1 + float(w.abs().max()))
            if not torch.allclose(got.double(), w, rtol=1e-3, atol=tol):
                problems.append(f"{where}: d{n}: max error {float((got.double() - w).abs().max()):.3e}")
        for n in grads:
            setattr(block, f"{n}_grad", None)
    return problems


def _show(vals: dict) -> str:
    return "{" + ", ".join(f"{k}={v if not isinstance(v, torch.Tensor) else tuple(v.shape)}"
                           for k, v in vals.items()) + "}"


# ---------------------------------------------------------------- kernels

def build_kernels(specs: dict[int, ir.Spec]) -> dict[int, op_mod.AttentionOp]:
    """The specs' ops with their CPU fp32 kernels compiled in one build (loaded into the cache)."""
    ops = {seed: op_mod.compile(spec) for seed, spec in specs.items()}
    insts = [o.instantiation("cpu", ir.DType.FP32, 8, family="cpu") for o in ops.values()]
    cache.load_together(insts)
    return ops


def kernel_cases(fz: Fuzzed, spec: ir.Spec, count: int = 2):
    """(B, Hq, Hkv, nq, nk, d) call shapes for ``fz``, small and odd (drawn from its seed)."""
    rng = random.Random(fz.seed ^ 0x5EED)
    dims = spec.head_dims or (8, 16, 24, 40)
    for _ in range(count):
        hq, hkv = rng.choice(((1, 1), (2, 1), (3, 3), (4, 2)))
        yield (rng.choice((1, 2)), hq, hkv, rng.randint(1, 40), rng.randint(1, 40), rng.choice(dims))


def check_kernels(fz: Fuzzed, spec: ir.Spec, op, count: int = 2) -> list[str]:
    """Forward and backward of the CPU kernels against the float64 reference."""
    problems = []
    rng = random.Random(fz.seed ^ 0xF00D)
    for case, (B, hq, hkv, nq, nk, d) in enumerate(kernel_cases(fz, spec, count)):
        g = torch.Generator().manual_seed(fz.seed * 31 + case)
        q = torch.randn(B, hq, nq, d, generator=g)
        k = torch.randn(B, hkv, nk, d, generator=g)
        v = torch.randn(B, hkv, nk, d, generator=g)
        vals = values(fz, B, hq, nq, nk, rng)
        drop = {"dropout_p": 0.25, "dropout_seed": fz.seed} if spec.dropout and rng.random() < 0.7 else {}
        where = f"seed {fz.seed} case {case} B={B} Hq={hq} Hkv={hkv} nq={nq} nk={nk} d={d} {_show(vals)}"
        trainable = {n: x.clone().requires_grad_() for n, x in vals.items()
                     if isinstance(x, torch.Tensor) and x.dtype == torch.float32}
        call = vals | trainable
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        try:
            out, lse = op(qq, kk, vv, return_lse=True, **drop, **call)
        except Exception as e:  # noqa: BLE001 - a finding
            problems.append(f"{where}: forward raises {type(e).__name__}: {e}")
            continue
        cmp = check.compare(spec, q, k, v, out.detach(), lse.detach(), **drop, **vals)
        if not cmp.ok:
            problems.append(f"{where}: forward {cmp}")
            continue
        dout = torch.randn(out.shape, generator=g)
        dlse = torch.randn(lse.shape, generator=g) if case % 2 else None
        loss = (out * dout).sum()
        if dlse is not None:
            loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{where}: backward raises {type(e).__name__}: {e}")
            continue
        pg = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in trainable.items()}
        gc = check.compare_grads(spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), dlse=dlse, params=vals,
                                 param_grads=pg, out=out.detach(),
                                 dropout_p=drop.get("dropout_p", 0.0), dropout_seed=drop.get("dropout_seed"))
        if not gc.ok:
            problems.append(f"{where}: backward {gc}")
    return problems


def small_tiles() -> tuple[str, str]:
    """FLASHGEN_CPU_TILES / FLASHGEN_CPU_BWD_TILES values that split the fuzzer's short sequences
    into several tiles each (the key-range skips and full tiles then matter); set them before the
    first call and call ``cpu_tiles.overrides.cache_clear()``."""
    return "5,8", "3,8"


clear_tile_overrides = cpu_tiles.overrides.cache_clear


# (q, kv, seqlen_q, seqlen_k) near the kernels' limit (seqlens up to 2^30, FG_MAX_SEQLEN)
FAR = ((0, (1 << 30) - 1, 1, 1 << 30), ((1 << 30) - 1, 0, 1 << 30, 1), ((1 << 30) - 1, (1 << 30) - 1, 1 << 30, 1 << 30),
       (12345678, 987654321, 1 << 30, (1 << 30) - 5), (999999999, 3, (1 << 30) - 1, 7), (46341, 46340, 46342, 46341))
_BIG = 1 << 62


def _exact_ints(spec: ir.Spec, e: ir.Expr, env: dict, vals: dict) -> bool:
    """Whether every int subexpression of ``e`` at this point stays within ±2^62 (beyond 64 bits
    the kernels wrap where the reference is exact, as README's "Operators" says)."""
    scope = X.Scope({p.name: p for p in spec.params}, allow_score=True)
    tensors = {p.name for p in spec.params if p.is_tensor}
    for n in X.walk(e):
        if isinstance(n, ir.Name) and n.id in tensors:  # the base of a read
            continue
        if X.type_of(n, scope) == X.INT:
            v = reference.evaluate(n, spec, env, vals, torch.float64, check_bounds=False)
            if abs(int(v)) >= _BIG:
                return False
    return True


def check_far(fz: Fuzzed, spec: ir.Spec, hooks: HookBinary) -> list[str]:
    """keep and score at positions near 2^30 against the reference (indices clamped as the
    kernels clamp them), and the key range and full-tile test of those rows at sampled keys."""
    op = op_mod.compile(spec)
    rng = random.Random(fz.seed ^ 0xFA4)
    keep_at, score_at, far_row = (hooks.fn(fz.seed, n) for n in ("keep_at", "score_at", "far_row"))
    problems = []
    vals = values(fz, 2, 3, 7, 9, rng)
    block = op.params_block([vals[p.name] for p in spec.params])
    ptr = ctypes.addressof(block) if block is not None else None
    for q, kv, nq, nk in FAR:
        b, h = rng.randrange(2), rng.randrange(3)
        env = {"b": torch.tensor(b), "h": torch.tensor(h), "q": torch.tensor(q), "kv": torch.tensor(kv),
               "seqlen_q": nq, "seqlen_k": nk, "score": torch.tensor(0.5, dtype=torch.float64)}
        where = f"seed {fz.seed} b={b} h={h} q={q} kv={kv} nq={nq} nk={nk} {_show(vals)}"
        if spec.mask is not None and _exact_ints(spec, spec.mask, env, vals):
            # (floats are fp32 in the kernels: a position beyond 2^24 mixed with a float rounds, as
            # the reference's fp32 evaluation does; README "Operators")
            want = [bool(reference.evaluate(spec.mask, spec, env, vals, dt, check_bounds=False))
                    for dt in (torch.float64, torch.float32)]
            if bool(keep_at(ptr, b, h, q, kv, nq, nk)) not in want:
                problems.append(f"{where}: keep is {not want[0]}, the reference says {want[0]}")
            kvs = sorted({kv, kv - 1, kv + 1, 0, nk - 1, *(rng.randrange(nk) for _ in range(6))})
            arr = (ctypes.c_int * len(kvs))(*kvs)
            if all(_exact_ints(spec, spec.mask, env | {"kv": torch.tensor(j)}, vals) for j in kvs):
                bad = far_row(ptr, b, h, q, nq, nk, ctypes.cast(arr, ctypes.c_void_p), len(kvs))
                if bad:
                    problems.append(f"{where}: {bad} key-range or full-tile violations in row {q} at keys {kvs}")
        if spec.score is not None and _exact_ints(spec, spec.score, env, vals):
            want = [float(reference.evaluate(spec.score, spec, env, vals, dt, check_bounds=False))
                    for dt in (torch.float64, torch.float32)]
            got = score_at(ptr, 0.5, b, h, q, kv, nq, nk)
            if not any(abs(got - w) <= 1e-5 * (1 + abs(w)) or got == w for w in want):
                problems.append(f"{where}: score {got}, the reference {want[0]}")
    return problems
