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


@pytest.mark.parametrize("seed, offset, p", [(0, 0, 0.1), (2**63 + 12345, 2**32 + 7, 0.5), (42, 2**64 - 1, 0.9),
                                             (2**64 - 1, 2**63 + 2**40 + 3, 1 - 2**-18)])
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


# ---------------------------------------------------------------- the v2 stream, element by element

def _philox_scalar(c, k):
    """Philox4x32-10 on Python ints (Salmon et al., SC 2011), independent of flashgen.philox."""
    c, (k0, k1) = list(c), k
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 % 2**32, (p0 >> 32) ^ c[3] ^ k1, p0 % 2**32]
    return c


def _keep_v2(seed, offset, bh, q, kv, p):
    """The v2 definition for one element: the call of group (q & ~8, kv & ~9), word
    (q bit 3) | (kv bit 3) << 1, its 16-bit half kv bit 0, kept iff >= round(p * 65536)."""
    q32, kv32 = q % 2**32, kv % 2**32
    out = _philox_scalar([kv32 & ~9, q32 & ~8, bh % 2**32, offset % 2**32],
                         [seed % 2**32, ((seed >> 32) ^ (offset >> 32)) % 2**32])
    word = out[((q32 >> 3) & 1) | (((kv32 >> 3) & 1) << 1)]
    half = (word >> 16) if kv32 & 1 else (word & 0xFFFF)
    return half >= round(p * 65536)


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_scalar_philox_known_answers(ctr, key, want):
    assert _philox_scalar(ctr, key) == list(want)


@pytest.mark.parametrize("seed, offset, p", [(5, 0, 0.3), (2**63 + 2**33 + 1, 2**40 + 9, 0.5),
                                             (2**64 - 1, 2**64 - 2, 0.1)])
def test_keep_mask_is_the_v2_definition(seed, offset, p):
    """philox.keep_mask equals the element-by-element evaluation of the stream's definition (odd
    sequence lengths that cut groups, seeds and offsets with high bits set, a batch offset)."""
    B, H, nq, nk, b0 = 2, 3, 19, 27, 4
    got = philox.keep_mask(seed, offset, B, H, nq, nk, p, batch_offset=b0)
    want = torch.tensor([[[[_keep_v2(seed, offset, (b + b0) * H + h, q, kv, p) for kv in range(nk)]
                           for q in range(nq)] for h in range(H)] for b in range(B)])
    assert torch.equal(got, want)


def test_threshold_is_16_bit():
    assert philox.threshold(0.1) == 6554
    assert philox.threshold(0.0) == 0 and philox.threshold(0.5) == 32768 and philox.threshold(0.9) == 58982
    assert philox.threshold(1 - 2**-18) == 65536  # keeps nothing (no 16-bit value reaches it)
    assert not philox.keep_mask(3, 1, 1, 2, 40, 40, 1 - 2**-18).any()
    assert philox.keep_mask(3, 1, 1, 2, 40, 40, 0.0).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    """The keep fraction is within 4 sigma of 1 - p (the 16-bit threshold moves the probability
    by at most 2^-17, far below sigma here)."""
    m = philox.keep_mask(77, 2**35 + 1, 2, 4, 256, 256, p)
    n = m.numel()
    assert abs(int(m.sum()) - n * (1 - p)) < 4 * (n * p * (1 - p)) ** 0.5
    # every member of a group (each half of each word of the call) keeps at that rate
    for qbit in (0, 1):
        for kvbit in (0, 1):
            for h in (0, 1):
                sub = m[:, :, qbit * 8::16, 8 * kvbit + h::16]
                k = sub.numel()
                assert abs(int(sub.sum()) - k * (1 - p)) < 4 * (k * p * (1 - p)) ** 0.5


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
