"""Shared cases of the block-sparsity tests (CPU in CI, CUDA on a GPU): one forward + backward of a
spec with a ``block_mask`` against the float64 reference with the same block mask."""

import torch

import flashgen
from flashgen import check

from variant_cases import op


def random_pattern(B, H, nqb, nkb, density, seed, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    pat = torch.rand(B, H, nqb, nkb, generator=g) < density
    if empty_row and nqb > 1:
        pat[..., 1, :] = False  # a query block that sees nothing: out 0, lse -inf
    if nkb > 1:
        pat[..., :, -1] = False  # a key block nobody sees: dk = dv = 0
    return pat


def run_case(name, B, Hq, Hkv, Nq, Nk, d, dtype, *, device="cpu", seed=0, params=None, pattern=None,
             block_size=128, from_spec=False, dropout_p=0.0, deterministic=False, packed=None):
    """Forward and backward of spec ``name`` with a block mask (a random ``pattern`` of the given
    density / tensor, or ``from_spec``: flashgen.block_mask of the spec's own mask) checked against
    the reference. ``packed``: (lens_q, lens_k) for the varlen layout (Nq, Nk are then the max)."""
    fop = op(name)
    g = torch.Generator().manual_seed(seed)
    params = params or {}
    if packed is None:
        shapes = ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d), (B, Hq, Nq, d))
    else:
        lq, lk = packed
        B = len(lq)
        shapes = ((sum(lq), Hq, d), (sum(lk), Hkv, d), (sum(lk), Hkv, d), (sum(lq), Hq, d))
    q, k, v, dout = (torch.randn(s, generator=g).to(dtype).to(device) for s in shapes)
    varlen = {}
    if packed is not None:
        cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                       device=device)
        varlen = {"cu_seqlens_q": cu(packed[0]), "cu_seqlens_k": cu(packed[1]), "max_seqlen_q": Nq,
                  "max_seqlen_k": Nk}
    if from_spec:
        extra = {"cu_seqlens_q": varlen["cu_seqlens_q"], "cu_seqlens_k": varlen["cu_seqlens_k"]} if varlen else {}
        bm = flashgen.block_mask(fop, Nq, Nk, B, Hq, block_size=block_size, device=device, **extra, **params)
    else:
        bs = (block_size, block_size) if isinstance(block_size, int) else block_size
        pat = pattern if isinstance(pattern, torch.Tensor) else \
            random_pattern(B, Hq, -(-Nq // bs[0]), -(-Nk // bs[1]), pattern, seed)
        bm = flashgen.BlockMask.from_pattern(pat.to(device), block_size)
    where = f"{name} B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} {dtype} {bm}"
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    drop = {}
    if dropout_p:
        drop = {"dropout_p": dropout_p, "dropout_seed": 1234 + seed}
    out, lse = fop(qq, kk, vv, return_lse=True, block_mask=bm, deterministic=deterministic, **drop, **varlen,
                   **params)
    rdrop = {"dropout_p": dropout_p, "dropout_seed": 1234 + seed} if dropout_p else {}
    cmp = check.compare(fop.spec, q, k, v, out.detach(), lse.detach(), block_mask=bm, **rdrop, **varlen, **params)
    assert cmp.ok, f"{where}: forward {cmp}"
    out.backward(dout)
    gc = check.compare_grads(fop.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), params=params, block_mask=bm,
                             out=out.detach(), **rdrop, **varlen)
    assert gc.ok, f"{where}: backward {gc}"
    return bm, out.detach(), lse.detach(), (qq.grad, kk.grad, vv.grad)
