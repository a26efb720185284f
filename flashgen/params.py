"""Example values for a spec's parameters: what ``flashgen run`` / ``bench`` and tests call with.

Scalars default to ``max(1, seqlen_k // 8)`` (int) and ``1.0`` (float) unless given; tensors are
drawn at random in their declared shape (the full size of ``dim|1`` dims): float ones from a
standard normal, int ones uniformly in [0, seqlen_k] — except with a trailing seqlen dim, where
they are ids of 8 contiguous documents of random lengths —, bool ones with probability 1/2. A given value for a
tensor parameter may be a tensor (used as is) or a number (the tensor filled with it).
"""

from __future__ import annotations

import torch

from .lang import ir
from .runtime.checks import PARAM_TORCH_DTYPE, eval_dim


def shape_of(p: ir.Param, sizes: dict) -> tuple[int, ...]:
    """The full shape of tensor parameter ``p`` given batch/heads/seqlen_q/seqlen_k/int params."""
    return tuple(eval_dim(d.size, sizes) for d in p.shape)


def example_params(spec: ir.Spec, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device="cpu",
                   generator: torch.Generator | None = None, **given) -> dict:
    """Values for every parameter of ``spec`` (see the module docstring); ``given`` overrides."""
    unknown = set(given) - {p.name for p in spec.params}
    if unknown:
        raise TypeError(f"unknown parameter(s) {', '.join(sorted(unknown))} for spec '{spec.name}'")
    sizes = {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    gdev = generator.device if generator is not None else "cpu"  # draw where the generator lives
    out: dict = {}
    for p in spec.params:
        value = given.get(p.name)
        if p.kind == "int":
            out[p.name] = sizes[p.name] = int(value) if value is not None else max(1, seqlen_k // 8)
            continue
        if p.kind == "float":
            out[p.name] = float(value) if value is not None else 1.0
            continue
        if isinstance(value, torch.Tensor):
            out[p.name] = value
            continue
        shape = shape_of(p, sizes)
        if any(n < 1 for n in shape):
            raise ValueError(f"{p.name}: its shape {shape} for these sizes and parameters has a dim below 1")
        dtype = PARAM_TORCH_DTYPE[p.dtype]
        if value is not None:
            out[p.name] = torch.full(shape, value, dtype=dtype, device=device)
        elif p.dtype == "f32":
            out[p.name] = torch.randn(shape, generator=generator, device=gdev
                                      ).to(device)
        elif p.dtype == "bool":
            out[p.name] = (torch.rand(shape, generator=generator, device=gdev)
                           < 0.5).to(device)
        else:
            last = p.shape[-1].size if p.shape else None
            ids = isinstance(last, ir.Name) and last.id in ("seqlen_q", "seqlen_k")
            t = torch.randint(0, 8 if ids else seqlen_k + 1, shape, generator=generator,
                              device=gdev)
            if ids:
                t = t.sort(dim=-1).values
            out[p.name] = t.to(dtype).to(device)
    return out


def parse_params(spec: ir.Spec, items: list[str]) -> dict:
    """``--param name=value`` items (the command line's syntax) → {name: int | float}: an int for an
    int parameter or an integer / bool tensor, a float otherwise (a number fills a tensor
    parameter). Raises ValueError naming the item for a missing '=', an unknown name, a value
    that is not a number of the right kind, or an int beyond the parameter's range (|value| <
    2^31 for i32 tensors, 2^62 otherwise)."""
    out: dict = {}
    declared = {p.name: p for p in spec.params}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--param {item}: expected NAME=VALUE")
        p = declared.get(name)
        if p is None:
            names = ", ".join(declared) or "none"
            raise ValueError(f"--param {item}: spec '{spec.name}' has no parameter '{name}' (it declares: {names})")
        integral = p.kind == "int" or (p.is_tensor and p.dtype in ("i32", "i64", "bool"))
        try:
            out[name] = int(text) if integral else float(text)
        except ValueError:
            raise ValueError(f"--param {item}: '{text}' is not {'an int' if integral else 'a number'}") from None
        limit = 2**31 if p.is_tensor and p.dtype == "i32" else 2**62
        if integral and not -limit <= out[name] < limit:
            raise ValueError(f"--param {item}: {out[name]} is out of range for {name} (|value| < {limit})")
    return out
