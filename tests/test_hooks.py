"""The generated hooks themselves, compiled standalone (g++, no kernel): the element mask, score
and its derivative agree with the reference's evaluation of the same IR, and the closed-form key
ranges and full-tile tests are sound (exhaustively, on small shapes)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from flashgen import ops, reference
from flashgen.codegen import render, variant
from flashgen.lang import frontend
from flashgen.params import example_params
from flashgen.paths import include_dir

SPECS = Path(__file__).resolve().parent.parent / "specs"

DRIVER = r"""
#include <cmath>
#include <cstdint>
#include "flashgen/variant.h"
namespace {
%(variant)s
}
using V = %(struct)s;
extern "C" void keep_matrix(const void* p, int b, int h, int nq, int nk, uint8_t* out) {
  const V::Params& P = *static_cast<const V::Params*>(p);
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j) out[i * nk + j] = V::keep(P, b, h, i, j, nq, nk);
}
extern "C" void score_matrix(const void* p, int b, int h, int nq, int nk, const float* s, float* out,
                             float* dout) {
  const V::Params& P = *static_cast<const V::Params*>(p);
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j) {
      out[i * nk + j] = V::score(P, s[i * nk + j], b, h, i, j, nq, nk);
      dout[i * nk + j] = V::dscore(P, s[i * nk + j], b, h, i, j, nq, nk);
    }
}
extern "C" void param_grad_all(const void* p, int B, int H, int nq, int nk, const float* s, const float* ds) {
  const V::Params& P = *static_cast<const V::Params*>(p);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < nq; ++i)
        for (int j = 0; j < nk; ++j) {
          const int64_t x = ((int64_t)(b * H + h) * nq + i) * nk + j;
          V::param_grad(P, ds[x], s[x], b, h, i, j, nq, nk);
        }
}
// Rows whose kept keys differ from [kv_lo(q, q+1), kv_hi(q, q+1)) although the variant claims
// kRowExact (the CUDA forward then tests only those bounds).
extern "C" int row_exact_violations(const void* p, int b, int h, int nq, int nk) {
  const V::Params& P = *static_cast<const V::Params*>(p);
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
extern "C" int row_exact(void) { return V::kRowExact; }
extern "C" int param_grad_enabled(const void* p) {
  return V::param_grad_enabled(*static_cast<const V::Params*>(p));
}
extern "C" int keep_at(const void* p, int b, int h, int q, int kv, int nq, int nk) {
  return V::keep(*static_cast<const V::Params*>(p), b, h, q, kv, nq, nk);
}
extern "C" float score_at(const void* p, float s, int b, int h, int q, int kv, int nq, int nk) {
  return V::score(*static_cast<const V::Params*>(p), s, b, h, q, kv, nq, nk);
}
// Violations of the key-range contract over every (q tile, kv tile) of the given sizes.
extern "C" int range_violations(const void* p, int b, int h, int nq, int nk, int tq, int tk) {
  const V::Params& P = *static_cast<const V::Params*>(p);
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
"""

EXTRA = {  # expressions the examples do not exercise: floor division, modulo, not, where, math
    "blocks": "attention blocks {\n param w: int\n mask = not (kv // 4 > q // 4) and (kv % 3 != 1 or q - kv < w)\n}",
    "band": "attention band {\n param lo: int\n param hi: int\n mask = window(lo, hi) or kv == 0\n}",
    "sinks": "attention sinks {\n param n: i64[heads]\n mask = kv < n[h] or (kv >= q - 3 and kv <= q)\n}",
    "flip": "attention flip {\n mask = -kv >= -q + 2 and not (2 * kv < q)\n}",
    "chunked": "attention chunked {\n param chunk: int\n mask = causal and chunked(chunk)\n}",
    "chunked_lit": "attention chunked_lit {\n mask = chunked(6) or kv < 2\n}",
    "wide": ("attention wide {\n param w: int\n"
             " mask = kv * 3 - q * 2 > w and (q * kv) % 7 != 3 and (kv - q) // 5 >= (seqlen_q - seqlen_k) % 9 - 2 * q\n"
             " score = score + (q * kv) % 1000003 + (kv - q - (seqlen_k - seqlen_q)) // 3\n}"),
    "math": ("attention math {\n param t: f32[heads, seqlen_q]\n param c: float\n"
             " score = where(score > 0, sqrt(score * score + c), exp(score) - 1) + abs(t[h, q]) * log(1 + c)"
             " - max(score, t[h, q]) + min(score * 2, c) / (1.5 + tanh(score))\n}"),
}


def _specs():
    out = {p.stem: frontend.parse(p) for p in sorted(SPECS.glob("*.attn"))}
    out.update({name: frontend.parse(text) for name, text in EXTRA.items()})
    return out


ALL = _specs()
SCALARS = {"window": [1, 3, 100], "w": [0, 2, 5], "lo": [0, 2, -1], "hi": [0, 3, -2],
           "max_distance": [1, 4], "softcap": [0.5, 3.0], "c": [0.25, 2.0], "chunk": [1, 3, 7],
           "left": [0, 2, 1 << 30], "right": [0, 3, 1 << 30]}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Every spec's hooks compiled into one small shared library each (in parallel)."""
    out_dir = tmp_path_factory.mktemp("hooks")
    procs = {}
    for name, spec in ALL.items():
        ctx = variant.variant_context(spec)
        src = out_dir / f"{name}.cpp"
        src.write_text(DRIVER % {"variant": render.render("variant.h.jinja", **ctx), "struct": ctx["struct"]})
        procs[name] = subprocess.Popen(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include_dir()}",
                                        str(src), "-o", str(out_dir / f"{name}.so")], stderr=subprocess.PIPE)
    result = {}
    for name, p in procs.items():
        _, err = p.communicate()
        assert p.returncode == 0, f"{name}: generated hooks do not compile:\n{err.decode()}"
        lib = ctypes.CDLL(str(out_dir / f"{name}.so"))
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.keep_matrix.argtypes = [vp, i, i, i, i, vp]
        lib.score_matrix.argtypes = [vp, i, i, i, i, vp, vp, vp]
        lib.param_grad_all.argtypes = [vp, i, i, i, i, vp, vp]
        lib.range_violations.argtypes = [vp, i, i, i, i, i, i]
        lib.keep_at.argtypes = [vp, i, i, i, i, i, i]
        lib.row_exact_violations.argtypes = [vp, i, i, i, i]
        lib.param_grad_enabled.argtypes = [vp]
        lib.score_at.argtypes = [vp, ctypes.c_float, i, i, i, i, i, i]
        lib.score_at.restype = ctypes.c_float
        result[name] = lib
    return result


def _settings(spec, B, H, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    scalars = [p.name for p in spec.params if not p.is_tensor]
    combos = [{}]
    for name in scalars:
        combos = [c | {name: v} for c in combos for v in SCALARS[name]]
    for c in combos:
        yield example_params(spec, B, H, nq, nk, generator=g, **c)


def _block(spec, values):
    op = ops.compile(spec)
    block = op.params_block([values[p.name] for p in spec.params])
    return block, (ctypes.addressof(block) if block is not None else None)


@pytest.mark.parametrize("name", sorted(ALL))
def test_keep_matches_reference_and_ranges_are_sound(libs, name):
    spec, lib = ALL[name], libs[name]
    for nq, nk in ((1, 1), (9, 9), (13, 7), (6, 17)):
        if name in ("document", "transformers_packed", "transformers_packed_plain") and nq != nk:  # ids of queries and keys
            continue
        B, H = 2, 3
        for params in _settings(spec, B, H, nq, nk, seed=nq * 100 + nk):
            block, ptr = _block(spec, params)
            ref = reference.keep_mask(spec, nq, nk, batch=B, heads=H, **params)
            for b in range(B):
                for h in range(H):
                    got = (ctypes.c_uint8 * (nq * nk))()
                    lib.keep_matrix(ptr, b, h, nq, nk, ctypes.cast(got, ctypes.c_void_p))
                    got_t = torch.tensor(list(got), dtype=torch.bool).view(nq, nk)
                    want = torch.ones(nq, nk, dtype=torch.bool) if ref is None else \
                        ref[min(b, ref.shape[0] - 1), min(h, ref.shape[1] - 1)]
                    assert torch.equal(got_t, want), f"{name} {params} b={b} h={h}: keep differs from reference"
                    bad = lib.row_exact_violations(ptr, b, h, nq, nk)
                    assert bad == 0, f"{name} {params} b={b} h={h}: {bad} keys break kRowExact"
                    for tq in (1, 2, 4, 5):
                        for tk in (1, 3, 4):
                            bad = lib.range_violations(ptr, b, h, nq, nk, tq, tk)
                            assert bad == 0, f"{name} {params} b={b} h={h} tiles {tq}x{tk}: {bad} violations"


@pytest.mark.parametrize("name", sorted(n for n, s in ALL.items() if s.score is not None))
def test_score_and_derivative_match_reference(libs, name):
    spec, lib = ALL[name], libs[name]
    B, H, nq, nk = 2, 3, 7, 9
    for params in _settings(spec, B, H, nq, nk, seed=5):
        block, ptr = _block(spec, params)
        s = (torch.randn(B, H, nq, nk, dtype=torch.float64) * 3).requires_grad_()
        env = reference.positions(B, H, nq, nk) | {"score": s}
        p64 = {n: (x.double().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
               for n, x in params.items()}
        ref = reference.evaluate(spec.score, spec, env, p64, torch.float64).expand(s.shape)
        ds = torch.randn(B, H, nq, nk, dtype=torch.float64)
        (ref * ds).sum().backward()
        s32 = s.detach().float().contiguous()
        for b in range(B):
            for h in range(H):
                out = torch.empty(nq, nk)
                dout = torch.empty(nq, nk)
                lib.score_matrix(ptr, b, h, nq, nk, ctypes.c_void_p(s32[b, h].contiguous().data_ptr()),
                                 ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(dout.data_ptr()))
                torch.testing.assert_close(out.double(), ref[b, h].detach(), atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{name} {params}: score: {m}")
                # d score / d s: the reference's gradient divided by the random ds it was weighted by
                want = s.grad[b, h] / ds[b, h]
                torch.testing.assert_close(dout.double(), want, atol=1e-4, rtol=1e-3,
                                           msg=lambda m: f"{name} {params}: dscore: {m}")
        grads = {}
        for p in spec.params:
            f = f"{p.name}_grad"
            if any(fl.name == f for fl in variant.param_fields(spec)):
                # param_grad_enabled (kernels skip param_grad without it) follows the pointers
                assert ptr is None or not lib.param_grad_enabled(ptr), f"{name}: enabled before {f} is set"
                grads[p.name] = torch.zeros(params[p.name].shape)
                setattr(block, f, grads[p.name].data_ptr())
                assert lib.param_grad_enabled(ptr), f"{name}: {f} set but param_grad_enabled is false"
                setattr(block, f, None)
        for n, g in grads.items():
            setattr(block, f"{n}_grad", g.data_ptr())
        if ptr is not None and not grads:
            assert not lib.param_grad_enabled(ptr), f"{name}: no parameter gradient, yet enabled"
        if grads:
            ds32 = ds.float().contiguous()
            lib.param_grad_all(ptr, B, H, nq, nk, ctypes.c_void_p(s32.data_ptr()), ctypes.c_void_p(ds32.data_ptr()))
            for n, g in grads.items():
                torch.testing.assert_close(g.double(), p64[n].grad, atol=1e-3, rtol=1e-4,
                                           msg=lambda m: f"{name} {params}: d{n}: {m}")


# Positions near the kernels' limit (seqlens up to 2^30): the generator computes an int
# subexpression in 32 bits only where it provably fits, so these agree with exact arithmetic.
FAR = [(0, 0, 1, 1), (0, (1 << 30) - 1, 1, 1 << 30), ((1 << 30) - 1, 0, 1 << 30, 1),
       ((1 << 30) - 1, (1 << 30) - 1, 1 << 30, 1 << 30), (12345678, 987654321, 1 << 30, (1 << 30) - 5),
       (999999999, 3, (1 << 30) - 1, 7), (46341, 46340, 46342, 46341)]
FAR_SPECS = [n for n, s in ALL.items()
             if not any(p.is_tensor and len(p.shape) > 1 for p in s.params)]  # reads indexed by q/kv excluded


@pytest.mark.parametrize("name", sorted(FAR_SPECS))
def test_hooks_exact_at_far_positions(libs, name):
    spec, lib = ALL[name], libs[name]
    big = {"window": [1, 1 << 29, 1 << 40, -(1 << 40)], "w": [-(1 << 40), 7, 1 << 33],
           "lo": [1 << 31, -5], "hi": [1 << 31, 3], "max_distance": [1 << 31 - 1]}
    for settings in _settings(spec, 2, 3, 4, 4, seed=11):
        for sc in [{n: v for n, vs in big.items() if n in settings for v in vs[i:i + 1]} for i in range(4)]:
            params = settings | sc
            if "kv_len" in params:
                params["kv_len"] = torch.tensor([1 << 29, (1 << 30) - 1], dtype=torch.int32)
            if "prefix_len" in params:
                params["prefix_len"] = torch.tensor([-(1 << 31), (1 << 31) - 1], dtype=torch.int32)
            block, ptr = _block(spec, params)
            for b, h in ((0, 0), (1, 2)):
                for q, kv, nq, nk in FAR:
                    env = {"b": torch.tensor(b), "h": torch.tensor(h), "q": torch.tensor(q), "kv": torch.tensor(kv),
                           "seqlen_q": nq, "seqlen_k": nk, "score": torch.tensor(0.5, dtype=torch.float64)}
                    where = f"{name} {params} b={b} h={h} q={q} kv={kv} nq={nq} nk={nk}"
                    if spec.mask is not None:
                        want = bool(reference.evaluate(spec.mask, spec, env, params, torch.float64))
                        assert bool(lib.keep_at(ptr, b, h, q, kv, nq, nk)) == want, f"{where}: keep"
                    if spec.score is not None:
                        want = float(reference.evaluate(spec.score, spec, env, params, torch.float64))
                        got = lib.score_at(ptr, 0.5, b, h, q, kv, nq, nk)
                        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), f"{where}: score"


# Masks that keep one interval of keys per row are recognised (the CUDA forward then compares
# two bounds per element instead of evaluating the mask); masks that may not are not.
ROW_EXACT = {"dense": True, "causal": True, "sliding_window": True, "prefix_lm": True, "key_padding": True,
             "gemma": True, "alibi": True, "document": False, "transformers_packed": False,
             "transformers_packed_plain": False, "blocks": False, "band": False, "sinks": False,
             "flip": False, "wide": False, "chunked": True,
             "chunked_lit": False}  # flip: 2 * kv is not a unit-coefficient bound


@pytest.mark.parametrize("name", sorted(ROW_EXACT))
def test_row_exact_classification(libs, name):
    assert bool(libs[name].row_exact()) == ROW_EXACT[name]
