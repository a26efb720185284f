"""The dropout stream's generator: Philox4x32-10 in C++ (philox.h) and PyTorch (philox.py) against
Random123's known-answer vectors, bit-identical to each other, with the keep statistics dropout
needs. (The kernels' dropout uses philox.h; the reference regenerates masks with philox.py.)"""

import ctypes
import subprocess

import pytest
import torch

from flashgen import philox
from flashgen.paths import include_dir

# Random123 kat_vectors, philox4x32 10: counter (4 words), key (2 words) → output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

DRIVER = r"""
#include "flashgen/philox.h"
extern "C" void philox(const uint32_t* c, const uint32_t* k, uint32_t* out) {
  flashgen::FgPhilox4 r = flashgen::fg_philox4x32_10(c[0], c[1], c[2], c[3], k[0], k[1]);
  for (int i = 0; i < 4; ++i) out[i] = r.x[i];
}
extern "C" void keep_grid(uint64_t seed, uint64_t offset, int B, int H, int nq, int nk, uint32_t thr,
                          uint8_t* out) {
  for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nk; ++j)
      *out++ = flashgen::fg_dropout_keep(seed, offset, (int64_t)b * H + h, i, j, thr);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("philox")
    (d / "p.cpp").write_text(DRIVER)
    subprocess.run(["g++", "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{include_dir()}", str(d / "p.cpp"),
                    "-o", str(d / "p.so")], check=True)
    lib = ctypes.CDLL(str(d / "p.so"))
    lib.keep_grid.argtypes = [ctypes.c_uint64, ctypes.c_uint64] + [ctypes.c_int] * 4 + [ctypes.c_uint32,
                                                                                         ctypes.c_void_p]
    return lib


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_known_answers_python(ctr, key, want):
    assert [int(x) for x in philox.philox4x32_10(*ctr, *key)] == list(want)


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_known_answers_cpp(lib, ctr, key, want):
    c, k, out = (ctypes.c_uint32 * 4)(*ctr), (ctypes.c_uint32 * 2)(*key), (ctypes.c_uint32 * 4)()
    lib.philox(c, k, out)
    assert list(out) == list(want)


@pytest.mark.parametrize("seed, offset, p", [(0, 0, 0.1), (2**63 + 12345, 2**32 + 7, 0.5), (42, 2**64 - 1, 0.9)])
def test_cpp_and_python_masks_are_identical(lib, seed, offset, p):
    B, H, nq, nk = 2, 3, 37, 45
    got = (ctypes.c_uint8 * (B * H * nq * nk))()
    lib.keep_grid(seed, offset, B, H, nq, nk, philox.threshold(p), ctypes.cast(got, ctypes.c_void_p))
    cpp = torch.tensor(list(got), dtype=torch.bool).view(B, H, nq, nk)
    assert torch.equal(cpp, philox.keep_mask(seed, offset, B, H, nq, nk, p))


def test_keep_statistics():
    p = 0.3
    m = philox.keep_mask(1234, 0, 4, 8, 256, 256, p)
    n = m.numel()
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(int(m.sum()) - n * (1 - p)) < 4 * sigma
    # different (b, h), offsets and seeds give unrelated masks
    a, b = m[0, 0].float(), m[1, 3].float()
    assert abs(float(((a - a.mean()) * (b - b.mean())).mean())) < 0.01
    assert not torch.equal(m, philox.keep_mask(1234, 1, 4, 8, 256, 256, p))
    assert not torch.equal(m, philox.keep_mask(1235, 0, 4, 8, 256, 256, p))
    assert philox.keep_mask(7, 0, 1, 1, 9, 9, 0.0).all()


def test_bad_probability():
    with pytest.raises(ValueError, match="dropout_p"):
        philox.threshold(1.0)


def test_reference_dropout_uses_the_regenerated_mask():
    from flashgen import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, generator=g, dtype=torch.float64) for _ in range(3))
    spec = "attention c { mask = causal }"
    out, lse = reference.attention(spec, q, k, v, dropout_p=0.25, dropout_seed=99, dropout_offset=5,
                                   return_lse=True)
    base, base_lse = reference.attention(spec, q, k, v, return_lse=True)
    pr = torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(
        ~torch.ones(17, 17, dtype=torch.bool).tril(), float("-inf")), -1)
    kept = philox.keep_mask(99, 5, 2, 3, 17, 17, 0.25)
    torch.testing.assert_close(out, (pr * kept / 0.75) @ v)
    torch.testing.assert_close(lse, base_lse)  # the LSE is that of P, before dropout
    assert not torch.allclose(out, base)
    with pytest.raises(ValueError, match="dropout_seed"):
        reference.attention(spec, q, k, v, dropout_p=0.25)


def test_keep_mask_stays_on_the_requested_device():
    """Scalar counters (the offset word) join the position tensors on their device (meta here;
    the GPU tests compare CUDA kernels with masks made on CUDA)."""
    m = philox.keep_mask(3, 2**40 + 5, 2, 2, 20, 20, 0.3, device="meta")
    assert m.device.type == "meta" and m.shape == (2, 2, 20, 20)
