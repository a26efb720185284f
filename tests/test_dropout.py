"""Fused dropout on the CPU family (FlashAttention, Alg. 2 and 4): forward and backward against
the float64 reference computed with the regenerated keep mask, reproducibility and seeding, the
mask itself and its statistics, the ABI and the errors. The CUDA family's tests are in
test_gpu_dropout.py."""

import ctypes
import math
import subprocess

import pytest
import torch
from conftest import SPECS
from dropout_cases import fwd_bwd, inputs, run_case, spec_op

import flashgen
from flashgen import check, ops, philox
from flashgen.paths import include_dir


@pytest.fixture(scope="module", autouse=True)
def _built():
    """The kernels these tests use, compiled together (ninja runs them in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    builds = [("dropout", ["fp32", "bf16"]), ("alibi", ["fp32"]), ("window_softcap", ["fp32"])]
    with ThreadPoolExecutor(len(builds)) as pool:
        list(pool.map(lambda b: spec_op(b[0]).build("cpu", b[1]), builds))


# (spec, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, p): tile-crossing seqlens
# (64, 65, 128, 257, 1000), seqlen_q != seqlen_k both ways, GQA/MQA, p in {0.1, 0.5}; the causal
# spec takes the backward without a score mod, alibi the score-mod path with a parameter
# gradient, window + softcap the one that multiplies dscore in the gemm epilogue.
CASES = [
    ("dropout", 1, 2, 2, 64, 64, 32, torch.float32, 0.1),
    ("dropout", 2, 4, 2, 65, 65, 32, torch.float32, 0.5),
    ("dropout", 1, 2, 1, 1000, 1000, 64, torch.float32, 0.1),
    ("dropout", 1, 2, 2, 128, 257, 32, torch.float32, 0.5),
    ("dropout", 2, 2, 1, 257, 65, 32, torch.float32, 0.1),  # rows that see no key
    ("dropout", 2, 4, 2, 257, 257, 64, torch.bfloat16, 0.1),
    ("alibi", 2, 4, 2, 257, 257, 32, torch.float32, 0.5),
    ("alibi", 1, 4, 1, 65, 128, 64, torch.float32, 0.1),
    ("window_softcap", 1, 4, 2, 257, 257, 32, torch.float32, 0.1),
    ("window_softcap", 2, 2, 2, 128, 65, 64, torch.float32, 0.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}h{c[2]}kv{c[3]}-{c[4]}x{c[5]}-d{c[6]}-"
                         f"{str(c[7]).removeprefix('torch.')}-p{c[8]}")
def test_matches_reference_with_the_regenerated_mask(case):
    name, *shape, p = case
    run_case(name, *shape, p, seed=sum(shape[:5]))


def test_blas_backend_applies_the_same_mask(monkeypatch):
    """FLASHGEN_CPU_GEMM=blas takes the kernels' other gemm path (read at every call)."""
    monkeypatch.setenv("FLASHGEN_CPU_GEMM", "blas")
    run_case("dropout", 1, 4, 2, 130, 200, 32, torch.float32, 0.3, seed=5)
    run_case("window_softcap", 1, 2, 1, 200, 200, 32, torch.float32, 0.3, seed=6)


def test_gradient_through_out_and_lse():
    """The LSE is the undropped softmax's: a gradient into it enters D like without dropout."""
    op = spec_op("alibi")
    q, k, v, dout = inputs(2, 4, 2, 100, 32, seed=3)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    dlse = torch.randn(2, 4, 100)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = op(qq, kk, vv, return_lse=True, dropout_p=0.25, dropout_seed=17, slopes=slopes)
    torch.autograd.backward((out, lse), (dout, dlse))
    gc = check.compare_grads(op.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), dlse=dlse,
                             params={"slopes": slopes}, param_grads={"slopes": slopes.grad},
                             dropout_p=0.25, dropout_seed=17)
    assert gc.ok, str(gc)


def test_same_seed_reproduces_outputs_and_gradients_bit_for_bit():
    op = spec_op("dropout")
    q, k, v, dout = inputs()
    a = fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=7)
    b = fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], fwd_bwd(op, q, k, v, dout, dropout_p=0.2, dropout_seed=8)[0])
    seed = 2**64 - 1  # the top of the seed range (stored as int64 -1)
    out, lse = op(q, k, v, return_lse=True, dropout_p=0.2, dropout_seed=seed)
    assert check.compare(op, q, k, v, out, lse, dropout_p=0.2, dropout_seed=seed).ok


def test_p_zero_is_the_plain_kernel(causal_op):
    """dropout_p = 0 on a spec with `dropout` computes exactly what the spec without it does."""
    q, k, v, dout = inputs(seed=1)
    a = fwd_bwd(spec_op("dropout"), q, k, v, dout)
    b = fwd_bwd(causal_op, q, k, v, dout)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_unseeded_calls_draw_from_torch_generator():
    op = spec_op("dropout")
    q, k, v, dout = inputs(seed=2)
    torch.manual_seed(11)
    a = fwd_bwd(op, q, k, v, dout, dropout_p=0.3)
    b = fwd_bwd(op, q, k, v, dout, dropout_p=0.3)
    assert not torch.equal(a[0], b[0])  # a fresh mask per call
    torch.manual_seed(11)
    c = fwd_bwd(op, q, k, v, dout, dropout_p=0.3)
    assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))  # torch.manual_seed reproduces
    # The state a call used, recovered by replaying the generator, regenerates its mask.
    torch.manual_seed(11)
    seed, offset = flashgen.dropout_state(None, "cpu").tolist()
    lse = op(q, k, v, return_lse=True)[1]  # the LSE is the undropped softmax's
    cmp = check.compare(op, q, k, v, a[0], lse, dropout_p=0.3, dropout_seed=seed, dropout_offset=offset)
    assert cmp.ok, str(cmp)
    assert not check.compare(op, q, k, v, a[0], lse, dropout_p=0.3, dropout_seed=seed).ok  # offset matters


def test_dropout_state():
    s = flashgen.dropout_state(5)
    assert s.dtype == torch.int64 and s.tolist() == [5, 0]
    assert flashgen.dropout_state(2**64 - 1).tolist() == [-1, 0]  # the uint64's bits
    torch.manual_seed(0)
    a = flashgen.dropout_state()
    b = flashgen.dropout_state()
    assert (a >= 0).all() and not torch.equal(a, b)


def extracted_mask(op, B, Hq, Hkv, N, p, seed):
    """The kernel's keep mask, read off the output: with q = 0 the causal row i spreads P = 1/(i+1)
    over keys j <= i, and with V = I out[.., i, j] = keep(i, j) / ((i + 1)(1 - p))."""
    q, k = torch.zeros(B, Hq, N, N), torch.zeros(B, Hkv, N, N)
    v = torch.eye(N).expand(B, Hkv, N, N)
    out = op(q, k, v, dropout_p=p, dropout_seed=seed)
    rows = torch.arange(1, N + 1, dtype=torch.float32).view(N, 1)
    torch.testing.assert_close(out * rows * (1 - p), (out > 0).float(), atol=1e-5, rtol=1e-5)
    return out > 0


def test_kernel_mask_is_the_reference_mask_and_unbiased():
    """The mask the forward applies equals flashgen.philox's at every (b, h, q, kv) — GQA, many
    tiles —, its keep fraction is within 4 sigma of 1 - p, and masks of different (b, h) are
    uncorrelated."""
    B, Hq, Hkv, N, p = 2, 4, 2, 256, 0.3
    got = extracted_mask(spec_op("dropout"), B, Hq, Hkv, N, p, seed=99)
    lower = torch.ones(N, N, dtype=torch.bool).tril()
    want = philox.keep_mask(99, 0, B, Hq, N, N, p) & lower
    assert torch.equal(got, want)
    n = int(lower.sum()) * B * Hq
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(int(got.sum()) - n * (1 - p)) < 4 * sigma
    flat = got.view(B * Hq, N, N)[:, lower].float()
    corr = torch.corrcoef(flat)
    off_diagonal = corr[~torch.eye(B * Hq, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 4 / math.sqrt(flat.shape[1])


def test_tiling_never_changes_the_mask(forced_cpu_tiles):
    """Other tile sizes (forward and backward) cut the rows and keys elsewhere: same mask."""
    forced_cpu_tiles("40,24", "33,16")
    got = extracted_mask(spec_op("dropout"), 1, 2, 1, 200, 0.5, seed=4)
    assert torch.equal(got, philox.keep_mask(4, 0, 1, 2, 200, 200, 0.5) & torch.ones(200, 200, dtype=torch.bool).tril())
    run_case("dropout", 2, 4, 2, 150, 150, 32, torch.float32, 0.5, seed=9)
    run_case("alibi", 1, 2, 2, 100, 140, 32, torch.float32, 0.1, seed=10)


def test_keep_fraction_and_independence_large():
    """Over 2^20 elements: the keep fraction is within 4 sigma of 1 - p for p in {0.1, 0.5}, and
    masks of different (b, h), of neighbouring rows and columns and of the elements sharing a
    Philox call (q ± 8, kv ± 1: the two halves of a word, kv ± 8) are uncorrelated (4 sigma)."""
    B, H, N, M = 2, 8, 256, 256
    for p in (0.1, 0.5):
        m = philox.keep_mask(2024, 3, B, H, N, M, p)
        n = m.numel()
        assert abs(int(m.sum()) - n * (1 - p)) < 4 * math.sqrt(n * p * (1 - p))
        x = m.float() - (1 - p)
        pairs = [(x[0, 0], x[0, 1]), (x[0, 0], x[1, 0])]  # other (b, h)
        for shift in (1, 8):  # neighbours (kv ± 1: one word's halves), and the words of a call (± 8)
            pairs += [(x[1, 5, shift:], x[1, 5, :-shift]), (x[0, 7, :, shift:], x[0, 7, :, :-shift])]
        for a, b in pairs:
            assert abs(float((a * b).mean())) < 4 * p * (1 - p) / math.sqrt(a.numel())


# ---------------------------------------------------------------- the vectorised CPU mask

DRIVER = r"""
#include "flashgen/cpu/dropout.h"
extern "C" int check(uint64_t seed, uint64_t offset, uint32_t thr, int64_t bh, int64_t q, int64_t kv0, int64_t n) {
  flashgen::cpu::Dropout dr;
  dr.on = true; dr.seed = seed; dr.offset = offset; dr.threshold = thr;
  float src[160], dst[160];
  for (int j = 0; j < 160; ++j) { src[j] = 1.f + j; dst[j] = -1.f; }
  flashgen::cpu::dropout_row(dr, bh, q, kv0, n, src, dst, 3.f);
  int bad = 0;
  for (int j = 0; j < 160; ++j) {
    const bool k = flashgen::fg_dropout_keep(seed, offset, bh, q, kv0 + j, thr);
    bad += dst[j] != (j >= n ? -1.f : (k ? 3.f * src[j] : 0.f));
  }
  return bad;
}
"""


@pytest.mark.parametrize("flags", [["-O2"], ["-O3", "-march=native"]], ids=["generic", "native"])
def test_vectorised_mask_matches_philox_h(tmp_path, flags):
    (tmp_path / "d.cpp").write_text(DRIVER)
    subprocess.run(["g++", "-std=c++17", *flags, "-shared", "-fPIC", f"-I{include_dir()}", str(tmp_path / "d.cpp"),
                    "-o", str(tmp_path / "d.so")], check=True)
    lib = ctypes.CDLL(str(tmp_path / "d.so"))
    lib.check.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32] + [ctypes.c_int64] * 4
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        seed, offset = (int(x) for x in torch.randint(0, 2**63 - 1, (2,), generator=g))
        seed, offset = seed * (1 + i % 2), offset * (1 + i % 3 // 2)  # past 2^63 too
        bh, q, kv0 = (int(x) for x in torch.randint(0, 2**31, (3,), generator=g))
        assert lib.check(seed % 2**64, offset % 2**64, philox.threshold(i / 200), bh, q, kv0, i % 160) == 0
    assert lib.check(1, 2, philox.threshold(1 - 2**-18), 3, 4, 5, 150) == 0  # threshold 2^16: none kept


# ---------------------------------------------------------------- the CUDA fragment bits

FRAGMENT_DRIVER = r"""
#include "flashgen/cuda/dropout.cuh"
using namespace flashgen;
// A warp's keep bits in the forward layout (rows q = q0 + 16 ma + g (+8), columns
// kv = kv0 + 16 jp + 2t (+1, +8, +9): dropout_bits8) and in the backward's transposed layout
// (rows kv = kv0 + g (+8), columns q = q0 + 16 jp + 2t + e0 (+8): dropout_bits_kv), against
// fg_dropout_keep at each element. Returns the number of mismatches.
extern "C" int check(uint64_t seed, uint64_t offset, uint32_t thr, uint32_t bh, int q0, int kv0) {
  cuda::DropoutKey k{seed, offset, bh, thr};
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int jp = 0; jp < 2; ++jp) {
      const uint32_t b8 = cuda::dropout_bits8(k, q0 + g, kv0 + jp * 16 + 2 * t);
      for (int i = 0; i < 2; ++i)
        for (int e = 0; e < 4; ++e) {
          const int q = q0 + g + (e >> 1) * 8, kv = kv0 + jp * 16 + i * 8 + 2 * t + (e & 1);
          bad += ((b8 >> (4 * i + e)) & 1u) != (uint32_t)fg_dropout_keep(seed, offset, bh, q, kv, thr);
        }
      // the lane pairs' shared calls (dropout_bits_kv_pair), the shuffle from lane ^ 4 emulated
      uint32_t own, other, p_own, p_other, pair[2];
      cuda::dropout_kv_pair_halves(k, q0 + jp * 16 + 2 * t, kv0 + g, own, other);
      cuda::dropout_kv_pair_halves(k, q0 + jp * 16 + 2 * t, kv0 + (g ^ 1), p_own, p_other);
      cuda::dropout_kv_pair_bits(kv0 + g, own, p_other, pair);
      for (int e0 = 0; e0 < 2; ++e0) {
        const uint32_t b4 = cuda::dropout_bits_kv(k, q0 + jp * 16 + 2 * t + e0, kv0 + g);
        bad += pair[e0] != b4;
        for (int w = 0; w < 4; ++w) {
          const int q = q0 + jp * 16 + 2 * t + e0 + (w & 1) * 8, kv = kv0 + g + (w >> 1) * 8;
          bad += ((b4 >> w) & 1u) != (uint32_t)fg_dropout_keep(seed, offset, bh, q, kv, thr);
        }
      }
    }
  }
  return bad;
}
"""


def test_cuda_fragment_bits_match_philox_h(tmp_path):
    """dropout.cuh's forward (8 elements per call) and backward (kv parity) bit layouts name the
    elements fg_dropout_keep decides, at the fragment positions the kernels read (host build);
    the backward's lane-pair sharing (FLASHGEN_DROPOUT_BWD_SHARE=1) gives the same bits."""
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    (tmp_path / "f.cu").write_text(FRAGMENT_DRIVER)
    subprocess.run([nvcc, "-std=c++17", "-O1", "-shared", "-Xcompiler", "-fPIC", f"-I{include_dir()}",
                    str(tmp_path / "f.cu"), "-o", str(tmp_path / "f.so")], check=True)
    lib = ctypes.CDLL(str(tmp_path / "f.so"))
    lib.check.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int,
                          ctypes.c_int]
    g = torch.Generator().manual_seed(1)
    for i in range(40):
        seed, offset = (int(x) * (1 + i % 2) for x in torch.randint(0, 2**63 - 1, (2,), generator=g))
        bh = int(torch.randint(0, 2**31, (1,), generator=g))
        q0, kv0 = (16 * int(x) for x in torch.randint(0, 2**26, (2,), generator=g))
        assert lib.check(seed, offset, philox.threshold(i / 40), bh, q0, kv0) == 0


# ---------------------------------------------------------------- interface

def test_abi_mirror_matches_args_h(tmp_path):
    """The ctypes blocks lay out like templates/include/flashgen/args.h (offsets of every field)."""
    from flashgen.abi import FgBlockLists, FgBwdArgs, FgClassifyArgs, FgFwdArgs, FgKvCache, FgWorkQueue

    lines = ['#include <stddef.h>', '#include "flashgen/args.h"']
    for struct in (FgFwdArgs, FgBwdArgs, FgBlockLists, FgClassifyArgs, FgKvCache, FgWorkQueue):
        names = [f[0] for f in struct._fields_]
        lines.append(f"extern \"C\" void {struct.__name__}_offsets(long* o) {{")
        lines += [f"  o[{i}] = offsetof({struct.__name__}, {n});" for i, n in enumerate(names)]
        lines.append(f"  o[{len(names)}] = sizeof({struct.__name__});\n}}")
    (tmp_path / "a.cpp").write_text("\n".join(lines) + "\n")
    subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", f"-I{include_dir()}", str(tmp_path / "a.cpp"),
                    "-o", str(tmp_path / "a.so")], check=True)
    lib = ctypes.CDLL(str(tmp_path / "a.so"))
    for struct in (FgFwdArgs, FgBwdArgs, FgBlockLists, FgClassifyArgs, FgKvCache, FgWorkQueue):
        n = len(struct._fields_)
        got = (ctypes.c_long * (n + 1))()
        getattr(lib, f"{struct.__name__}_offsets")(got)
        want = [getattr(struct, f[0]).offset for f in struct._fields_] + [ctypes.sizeof(struct)]
        assert list(got) == want, struct.__name__


def test_variant_declares_dropout():
    from flashgen.codegen import variant

    assert variant.hook_bodies(spec_op("dropout").spec)["has_dropout"]
    text = (SPECS.parent / "generated" / "dropout" / "cpu_fwd_fp32.cpp").read_text()
    assert "static constexpr bool kHasDropout = true;" in text


def test_errors_name_the_argument(causal_op):
    op = spec_op("dropout")
    q, k, v, _ = inputs(1, 2, 2, 16, 16)
    cases = [
        (ValueError, r"^dropout_p: expected a probability in \[0, 1\), got 1.0", {"dropout_p": 1.0}),
        (ValueError, r"^dropout_p: expected a probability in \[0, 1\), got -0.1", {"dropout_p": -0.1}),
        (ValueError, r"^dropout_p: expected a probability in \[0, 1\), got nan", {"dropout_p": float("nan")}),
        (TypeError, "^dropout_p: expected a float in", {"dropout_p": "0.1"}),
        (TypeError, "^dropout_p: expected a float in", {"dropout_p": True}),
        (ValueError, r"^dropout_seed: -1 is out of range \(expected 0 <= dropout_seed < 2\^64\)",
         {"dropout_p": 0.1, "dropout_seed": -1}),
        (ValueError, "^dropout_seed: 18446744073709551616 is out of range", {"dropout_p": 0.1, "dropout_seed": 2**64}),
        (TypeError, "^dropout_seed: expected None or an int, got float", {"dropout_p": 0.1, "dropout_seed": 1.5}),
        (TypeError, "^dropout_seed: expected None or an int, got bool", {"dropout_p": 0.1, "dropout_seed": True}),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            op(q, k, v, **kw)
    with pytest.raises(ValueError, match=r"^dropout_p=0.5: spec 'causal' declares no dropout; add a line `dropout`"):
        causal_op(q, k, v, dropout_p=0.5)
    with pytest.raises(ValueError, match="^dropout_seed: "):
        flashgen.dropout_state(-3)
    # integral types other than int (numpy) are seeds too, the same seed as the int
    import numpy as np

    assert torch.equal(op(q, k, v, dropout_p=0.3, dropout_seed=np.int64(7)), op(q, k, v, dropout_p=0.3, dropout_seed=7))
    assert torch.equal(flashgen.dropout_state(np.uint64(2**64 - 1)), flashgen.dropout_state(2**64 - 1))
    # the raw op checks the state it is handed
    with pytest.raises(ValueError, match=r"^dropout_state: expected an int64 tensor of shape \(2,\)"):
        op.torch_op(q, k, v, 0.25, False, 0.1, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="^dropout_state: .* got NoneType"):
        op.torch_op(q, k, v, 0.25, False, 0.1, None)


def test_families_without_dropout_raise_not_implemented(monkeypatch, request):
    """A family whose kernels do not apply dropout declines a call with dropout_p > 0, and the
    op raises NotImplementedError naming dropout_p, before any launch."""
    from flashgen import families

    assert ops.DROPOUT_BACKENDS == families.with_feature("dropout") and "cpu" in ops.DROPOUT_BACKENDS
    cpu = families.get("cpu")
    monkeypatch.setattr(cpu, "features", cpu.features - {"dropout"})
    ops.invalidate_libraries()
    request.addfinalizer(ops.invalidate_libraries)
    op = spec_op("dropout")
    q, k, v, _ = inputs(1, 2, 1, 40, 16)
    with pytest.raises(NotImplementedError, match="^dropout_p: dropout is not implemented for CPU in this version"):
        op(q, k, v, dropout_p=0.1, dropout_seed=1)
    with pytest.raises(NotImplementedError, match="^dropout_p: dropout is not implemented for CPU"):
        op.torch_op(q, k, v, 0.25, False, 0.1, flashgen.dropout_state(1))
    assert op(q, k, v).shape == q.shape  # p = 0 needs no dropout kernels


def test_opcheck_and_torch_compile():
    op = spec_op("dropout")
    q, k, v, _ = inputs(1, 2, 1, 40, 16)
    state = flashgen.dropout_state(3)
    torch.library.opcheck(op.torch_op, (q, k, v, 0.25, False, 0.2, state))
    torch.library.opcheck(op.torch_op, (q.requires_grad_(), k, v, 0.25, False, 0.2, state))
    q = q.detach()
    fn = torch.compile(lambda q, k, v: op(q, k, v, dropout_p=0.2, dropout_seed=3), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(q, k, v), op(q, k, v, dropout_p=0.2, dropout_seed=3))
    unseeded = torch.compile(lambda q, k, v: op(q, k, v, dropout_p=0.2), fullgraph=True, backend="aot_eager")
    assert not torch.equal(unseeded(q, k, v), unseeded(q, k, v))
