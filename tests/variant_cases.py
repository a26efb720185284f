"""The example specs' test cases, shared by the CPU tests (test_variants.py) and the GPU tests.

Each case runs forward and backward through the op and compares out, lse, dq, dk, dv and the
gradients of float tensor parameters that require grad with the float64 reference
(flashgen.check: FlashAttention's tolerance rule).
"""

from __future__ import annotations

from pathlib import Path

import torch

import flashgen
from flashgen import check

SPECS = Path(__file__).resolve().parent.parent / "specs"
EXAMPLES = ("sliding_window", "alibi", "softcap", "prefix_lm", "document", "key_padding", "bias",
            "relative_bias", "gemma")
# document / sequence ids index both q and kv: seqlen_q must equal seqlen_k
EQUAL_SEQLENS_ONLY = {"document", "transformers_packed", "transformers_packed_plain"}

_ops: dict[str, flashgen.AttentionOp] = {}


def op(name: str):
    if name not in _ops:
        _ops[name] = flashgen.compile(SPECS / f"{name}.attn")
    return _ops[name]


def alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 i / H), i = 1..H (Press et al., 2022)."""
    return torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], dtype=torch.float32, device=device)


def make_params(name: str, B: int, Hq: int, Nq: int, Nk: int, device, g: torch.Generator, variant: int = 0):
    """Parameters for spec ``name``; ``variant`` picks among a few settings (windows, shapes)."""
    cpu = {"device": "cpu", "generator": g}
    if name in ("causal", "dense"):
        return {}
    if name == "sliding_window":
        return {"window": (1, 16, 1000)[variant % 3]}
    if name == "alibi":
        return {"slopes": alibi_slopes(Hq, device)}
    if name == "softcap":
        return {"softcap": (2.0, 30.0)[variant % 2]}
    if name == "prefix_lm":
        return {"prefix_len": torch.randint(0, Nk + 1, (B,), **cpu).to(torch.int32).to(device)}
    if name == "document":
        ids = torch.randint(0, 4, (B, Nk), **cpu).sort(-1).values.to(torch.int32)
        return {"document_id": ids.to(device)}
    if name == "key_padding":
        lens = torch.randint(0, Nk + 1, (B,), **cpu)
        lens[0] = Nk if variant % 2 else 0  # a batch element with no keys at all, or none padded
        return {"kv_len": lens.to(torch.int32).to(device)}
    if name == "bias":
        shape = ((B, Hq), (1, Hq), (B, 1), (1, 1))[variant % 4] + (Nq, Nk)
        return {"bias": torch.randn(shape, **cpu).to(device)}
    if name == "relative_bias":
        md = (8, 1)[variant % 2]
        return {"max_distance": md, "rel": torch.randn(Hq, 2 * md + 1, **cpu).to(device)}
    if name == "gemma":
        return {"window": (32, 5)[variant % 2], "softcap": (2.0, 50.0)[variant % 2]}
    if name in ("transformers_packed", "transformers_packed_plain"):  # up to 3 packed sequences per row
        ids = torch.randint(0, 3, (B, Nk), **cpu).sort(-1).values.to(torch.int32)
        p = {"seq_id": ids.to(device), "left": (1 << 30, 40)[variant % 2], "right": (0, 0, 1 << 30)[variant % 3]}
        return p | {"softcap": (0.0, 20.0)[variant % 2]} if name == "transformers_packed" else p
    raise KeyError(name)


def run_case(name, B, Hq, Hkv, Nq, Nk, d, dtype, *, device="cpu", seed=0, variant=0, q_scale=1.0,
             backward=True):
    """One forward(+backward) of spec ``name`` checked against the float64 reference."""
    fop = op(name)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, h, n, d, generator=g).mul(s).to(dtype).to(device)
                     for h, n, s in ((Hq, Nq, q_scale), (Hkv, Nk, 1.0), (Hkv, Nk, 1.0), (Hq, Nq, 1.0)))
    params = make_params(name, B, Hq, Nq, Nk, device, g, variant)
    where = f"{name} B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} d={d} {dtype} variant={variant}"
    qq, kk, vv = (t.clone().requires_grad_(backward) for t in (q, k, v))
    grad_names = [n for n in fop.grad_params] if backward else []
    call = {n: (x.clone().requires_grad_() if n in grad_names else x) for n, x in params.items()}
    out, lse = fop(qq, kk, vv, return_lse=True, **call)
    cmp = check.compare(fop.spec, q, k, v, out.detach(), lse.detach(), **params)
    assert cmp.ok, f"{where}: forward {cmp}"
    if not backward:
        return
    out.backward(dout)
    pgrads = {n: call[n].grad for n in grad_names}
    for n, gr in pgrads.items():
        assert gr is not None and gr.shape == params[n].shape, f"{where}: gradient of {n} missing or mis-shaped"
    gc = check.compare_grads(fop.spec, q, k, v, dout, (qq.grad, kk.grad, vv.grad), params=params,
                             param_grads=pgrads)
    assert gc.ok, f"{where}: backward {gc}"
