"""Philox4x32-10 in PyTorch, bit-identical to templates/include/flashgen/philox.h.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011)
is counter-based: a pure function of a 128-bit counter and a 64-bit key. The dropout stream of
flashgen (v2, see philox.h) is keyed by (seed, offset, b, h, q, kv) with absolute positions: one
call per group of eight elements q in {qb, qb + 8} x kv in {kb, kb + 1, kb + 8, kb + 9}
(qb = q & ~8, kb = kv & ~9), counter {kb, qb, b * heads_q + h, offset mod 2^32}, key
{seed mod 2^32, (seed >> 32) ^ (offset >> 32)}; element (q, kv) takes word
(q bit 3) | (kv bit 3) << 1 and of it the 16-bit half kv bit 0 selects (0: low), and is kept iff
that half >= ``threshold(p)`` = round(p * 2^16). So the reference — and a user who wants to see
the mask — regenerates exactly the keep mask a kernel uses, on any device, from the seed and
offset alone. Arithmetic is done in int64 on values below 2^32 (32×32-bit products split in
16-bit halves so nothing overflows).
"""

from __future__ import annotations

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a · b for a constant a and int64 tensor b, both below 2^32."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p1 = b * a_lo  # < 2^48
    p2 = b * a_hi  # < 2^48
    lo = (((p2 & 0xFFFF) << 16) + p1) & MASK32
    hi = (p2 + (p1 >> 16)) >> 16
    return hi & MASK32, lo


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> list[torch.Tensor]:
    """The four output words for counters c0..c3 (int64 tensors or ints below 2^32, broadcast)
    and key (k0, k1)."""
    device = next((x.device for x in (c0, c1, c2, c3) if isinstance(x, torch.Tensor)), None)
    c = list(torch.broadcast_tensors(*(torch.as_tensor(x, dtype=torch.int64, device=device)
                                       for x in (c0, c1, c2, c3))))
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(M0, c[0])
        hi1, lo1 = _mulhilo(M1, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def threshold(dropout_p: float) -> int:
    """The 16-bit threshold round(dropout_p * 2^16): an element is kept iff its 16-bit half of
    the Philox word is >= threshold (2^16, for p within 2^-17 of 1, keeps nothing)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
    return round(dropout_p * (1 << 16))


def keep_mask(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
              dropout_p: float, device=None, batch_offset: int = 0) -> torch.Tensor:
    """Bool [batch, heads, seqlen_q, seqlen_k]: True where dropout keeps the probability
    (b, h: batch index and query head; absolute positions q, kv). One Philox call serves the
    eight elements q in {qb, qb + 8} x kv in {kb, kb + 1, kb + 8, kb + 9} (qb = q & ~8,
    kb = kv & ~9); the element takes word (q bit 3) | (kv bit 3) << 1 and its 16-bit half
    kv bit 0 (philox.h). ``batch_offset``: the index of the first batch element (one sequence of
    a packed batch is batch element b)."""
    if not 0 <= seed < 2**64 or not 0 <= offset < 2**64:
        raise ValueError("seed and offset must lie in [0, 2^64)")
    ar = lambda n: torch.arange(n, dtype=torch.int64, device=device)  # noqa: E731
    kv = ar(seqlen_k).view(1, 1, 1, -1) & MASK32
    q = ar(seqlen_q).view(1, 1, -1, 1) & MASK32
    bh = ((ar(batch) + batch_offset).view(-1, 1, 1, 1) * heads + ar(heads).view(1, -1, 1, 1)) & MASK32
    out = philox4x32_10(kv & ~9, q & ~8, bh, offset & MASK32, seed & MASK32,
                        ((seed >> 32) ^ (offset >> 32)) & MASK32)
    word = ((q >> 3) & 1) | (((kv >> 3) & 1) << 1)
    picked = torch.where(word == 0, out[0], torch.where(word == 1, out[1], torch.where(word == 2, out[2], out[3])))
    return ((picked >> ((kv & 1) * 16)) & 0xFFFF) >= threshold(dropout_p)
