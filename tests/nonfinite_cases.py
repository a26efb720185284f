"""Non-finite inputs (DESIGN.md, "Non-finite values"), shared by the CPU tests (test_nonfinite.py)
and the GPU tests (test_gpu_nonfinite.py).

The rule: NaN or +inf in a score at a kept key makes that row's out and LSE NaN; a score of −inf
counts as masked; NaN/inf in V at a kept key reaches the rows that keep it (out only: the LSE does
not read V); masked keys and memory past seqlen_k never reach a row, except that NaN/inf in V at a
key masked for only some rows of a tile may reach those rows as 0 × NaN.

A case runs the op on clean inputs and on poisoned ones and checks the poisoned result row by row
(rows: (b, h, i); the packed layout is seen as one batch element of total_q rows):

- rows whose float64 reference LSE is NaN (poisoned q and K, clean V: the reference's own
  0 × NaN through V is not the rule's): out all NaN and LSE NaN;
- rows that keep a poisoned V key (reference probability > 0): out not finite, LSE as below;
- rows of the same (b, h) and sequence within TILE_SLACK rows of those: the documented 0 × NaN
  may reach their out (not checked);
- every other row finite: bitwise the clean run's where the reference row did not change (the
  poison was at keys it masks), else within twice the clean call's tolerance of the reference.

Backward (loss Σ out·dout): the gradients must be non-finite where the rule puts NaN (dq of the NaN
rows; dk of the keys those rows keep, with a probability above 1e-30; dv of the keys the NaN-LSE
rows keep), may be non-finite only in gradient rows where torch autograd of the float64 reference
has a NaN or inf too, and are finite and within twice the clean call's tolerance of that reference elsewhere.
Poison that changes no row of the reference leaves the gradients bitwise those of the clean run
(deterministic backward).
"""

from __future__ import annotations

import torch

import flashgen
from flashgen import check, reference

NAN, INF = float("nan"), float("inf")
# The tallest query tile of any family (sm90: 3 consumer warpgroups of 64 rows): a row further
# than this from every row that keeps a poisoned V key never shares a tile with one.
TILE_SLACK = 192


def as_rows(t: torch.Tensor | None, packed: bool) -> torch.Tensor | None:
    """out / dq / dk-like tensors as [B, H, N, d]: the packed [total, H, d] as [1, H, total, d]."""
    if t is None:
        return None
    return t.transpose(0, 1).unsqueeze(0) if packed else t


def as_lse(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """LSE as [B, H, N]: the packed [H, total] as [1, H, total]."""
    return t.unsqueeze(0) if packed else t


def probabilities(spec, q, k, *, packed: bool, scale=None, **ref_kw) -> torch.Tensor:
    """The float64 reference's P as [B, Hq, Nq, Nk] (packed: [1, Hq, total_q, total_k]), by
    attention over one-hot values."""
    q, k = q.double(), k.double()
    if packed:
        tk, hkv = k.shape[0], k.shape[1]
        eye = torch.eye(tk, dtype=torch.float64, device=k.device).unsqueeze(1).expand(tk, hkv, tk)
    else:
        B, hkv, nk = k.shape[0], k.shape[1], k.shape[2]
        eye = torch.eye(nk, dtype=torch.float64, device=k.device).expand(B, hkv, nk, nk)
    scale = reference.default_scale(reference._as_spec(spec), q.shape[-1]) if scale is None else scale
    p = reference.attention(spec, q, k, eye.contiguous(), scale=scale, **ref_kw)
    return as_rows(p, packed)


def _near(rows: torch.Tensor, segment: torch.Tensor, slack: int) -> torch.Tensor:
    """rows [B, H, N] bool -> rows of the same (b, h) and segment within ``slack`` of a True one."""
    N = rows.shape[-1]
    idx = torch.arange(N, device=rows.device)
    near = (idx[:, None] - idx[None, :]).abs() < slack
    same = segment[:, None] == segment[None, :]
    reach = (near & same).to(torch.float64)
    return (rows.to(torch.float64) @ reach) > 0


def _group_any(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, Hq, ...] bool -> [B, Hkv, ...]: any over the query heads of each kv head."""
    B, hq = x.shape[:2]
    return x.reshape(B, hkv, hq // hkv, *x.shape[2:]).any(2)


class Expect:
    """What the rule says about one poisoned call, from the float64 reference."""

    def __init__(self, spec, clean, poisoned, *, packed=False, segment=None, scale=None, ref_kw=None,
                 params64=None, poisoned_params64=None):
        ref_kw, params64 = dict(ref_kw or {}), dict(params64 or {})
        params1 = params64 if poisoned_params64 is None else dict(poisoned_params64)
        q, k, v = clean
        q2, k2, v2 = poisoned
        kw = {"scale": scale} | ref_kw
        ref0, lse0 = reference.attention(spec, q.double(), k.double(), v.double(), return_lse=True, **kw,
                                         **params64)
        ref1, lse1 = reference.attention(spec, q2.double(), k2.double(), v.double(), return_lse=True, **kw,
                                         **params1)
        self.ref0, self.lse0 = as_rows(ref0, packed), as_lse(lse0, packed)
        self.ref1, self.lse1 = as_rows(ref1, packed), as_lse(lse1, packed)
        self.p = probabilities(spec, q, k, packed=packed, scale=scale, **ref_kw, **params64)
        vbad = ~torch.isfinite(as_rows(v2, packed)).all(-1)  # [B, Hkv, Nk]
        if not torch.equal(~torch.isfinite(as_rows(v, packed)).all(-1), torch.zeros_like(vbad)):
            raise ValueError("the clean v holds non-finite values")
        group = self.p.shape[1] // vbad.shape[1]
        vbad_q = vbad.repeat_interleave(group, dim=1)  # [B, Hq, Nk]
        self.score_nan = torch.isnan(self.lse1)  # [B, Hq, Nq]
        self.v_reach = ((self.p > 0) & vbad_q[:, :, None, :]).any(-1) & ~self.score_nan
        N = self.lse1.shape[-1]
        seg = torch.zeros(N, dtype=torch.int64, device=self.p.device) if segment is None else segment
        self.slack = _near(self.v_reach, seg, TILE_SLACK) & ~self.v_reach & ~self.score_nan
        self.hkv = vbad.shape[1]
        self.ref_kw, self.params64, self.scale, self.packed, self.spec = ref_kw, params1, scale, packed, spec
        self.poisoned = poisoned

    @property
    def reachable(self) -> bool:
        """Some row must show the poison (a NaN row)."""
        return bool(self.score_nan.any() or self.v_reach.any())

    @property
    def changed(self) -> bool:
        """The poison changes something: a NaN row, or a finite row's reference (a −inf score; a
        score expression that maps +inf to a finite score)."""
        same_lse = (self.lse1 == self.lse0) | (torch.isneginf(self.lse1) & torch.isneginf(self.lse0))
        return self.reachable or not (bool(same_lse.all()) and torch.equal(self.ref1, self.ref0))

    def check_forward(self, out, lse, out0, lse0, bound: float, lse_bound: float, where: str = ""):
        """out, lse: the poisoned call's; out0, lse0: the clean call's (all in the op's layout);
        bound, lse_bound: the clean call's tolerance (flashgen.check.compare)."""
        out, lse = as_rows(out, self.packed).double(), as_lse(lse, self.packed).double()
        out0, lse0 = as_rows(out0, self.packed).double(), as_lse(lse0, self.packed).double()
        S, R, Z = self.score_nan, self.v_reach, self.slack
        assert torch.isnan(lse[S]).all(), f"{where}: rows with a NaN/+inf score at a kept key: LSE not NaN"
        assert torch.isnan(out[S]).all(), f"{where}: rows with a NaN/+inf score at a kept key: out not all NaN"
        assert not torch.isfinite(out[R]).all(-1).any(), f"{where}: rows keeping a NaN V row: out finite"
        # LSE of every other row: finite where the reference's is (−inf for rows without keys).
        rest = ~S
        assert torch.equal(torch.isneginf(lse[rest]), torch.isneginf(self.lse1[rest])), \
            f"{where}: -inf LSE rows differ from the reference's"
        assert not torch.isnan(lse[rest]).any() and not torch.isposinf(lse[rest]).any(), \
            f"{where}: NaN/+inf LSE in a row the poison must not reach"
        same_l = rest & ((self.lse1 == self.lse0) | (torch.isneginf(self.lse1) & torch.isneginf(self.lse0)))
        assert torch.equal(lse[same_l], lse0[same_l]), f"{where}: LSE of rows the poison does not reach changed"
        fin = rest & torch.isfinite(self.lse1)
        err = ((lse - self.lse1).abs() - 1e-6 * self.lse1.abs())[fin]
        assert err.numel() == 0 or float(err.max()) <= 2 * lse_bound, f"{where}: LSE error {float(err.max())}"
        # out of every row that neither keeps the poison nor may see 0 × NaN.
        U = ~(S | R | Z)
        assert torch.isfinite(out[U]).all(), f"{where}: non-finite out in a row the poison must not reach"
        same_o = U & (self.ref1 == self.ref0).all(-1)
        assert torch.equal(out[same_o], out0[same_o]), f"{where}: out of rows the poison does not reach changed"
        e = (out - self.ref1).abs()[U]
        assert e.numel() == 0 or float(e.max()) <= 2 * bound, f"{where}: out error {float(e.max())}"

    def reference_grads(self, dout) -> dict:
        """torch autograd's gradients of the float64 reference at the poisoned inputs."""
        q2, k2, v2 = self.poisoned
        return check.reference_grads(self.spec, q2.double(), k2.double(), v2.double(), dout.double(),
                                     scale=self.scale, params=self.params64,
                                     dropout={"block_mask": self.ref_kw["block_mask"]} if "block_mask" in self.ref_kw
                                     else None,
                                     varlen={n: x for n, x in self.ref_kw.items() if n != "block_mask"} or None)

    def check_backward(self, grads, bounds: dict, dout, where: str = ""):
        """grads: the poisoned call's (dq, dk, dv) in the op's layout; bounds: the clean call's
        flashgen.check.compare_grads bounds; dout: the upstream gradient."""
        g64 = self.reference_grads(dout)
        A = self.score_nan | self.v_reach  # [B, Hq, Nq]
        P = self.p
        keep_s = (P > 0) & self.score_nan[..., None]          # [B, Hq, Nq, Nk]
        keep_a = (P > 1e-30) & A[..., None]
        must = {"dq": A, "dk": _group_any(keep_a.any(2), self.hkv), "dv": _group_any(keep_s.any(2), self.hkv)}
        for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
            g = as_rows(g, self.packed).double()
            ref = as_rows(g64[name], self.packed)
            m = must[name]
            # Non-finite: NaN, or ±inf where an inf in V meets finite factors (dS = P·(dP − D)
            # with D = ±inf).
            assert (~torch.isfinite(g)).any(-1)[m].all(), f"{where}: {name}: rows the rule makes NaN are finite"
            # Row by row: a kernel may spread a NaN over a gradient row that autograd puts in some
            # of its elements (a 0 × NaN inside a product with the row).
            may = (~torch.isfinite(ref)).any(-1) | m
            bad = (~torch.isfinite(g)).any(-1) & ~may
            assert not bad.any(), f"{where}: {name}: NaN/inf where the reference's autograd has none " \
                                  f"(rows {bad.nonzero()[:4].tolist()})"
            fin = ~may[..., None].expand(g.shape)
            e = (g - ref).abs()[fin]
            assert e.numel() == 0 or float(e.max()) <= 2 * bounds[name] + 1e-5, \
                f"{where}: {name}: error {float(e.max())} (bound {bounds[name]})"


    def check_unreached_backward(self, grads, clean, bounds: dict, dout, where: str = ""):
        """Poison no row reaches: grads (dq, dk, dv) must be the clean call's within 2 x bounds,
        except rows that are non-finite in the float64 reference's autograd too (0 x inf)."""
        g64 = self.reference_grads(dout)
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, clean, strict=True):
            g, g0 = as_rows(g, self.packed).double(), as_rows(g0, self.packed).double()
            may = (~torch.isfinite(as_rows(g64[name], self.packed))).any(-1)
            bad = (~torch.isfinite(g)).any(-1) & ~may
            assert not bad.any(), f"{where}: {name}: poison no row can reach gave non-finite values " \
                                  f"where the reference's autograd has none (rows {bad.nonzero()[:4].tolist()})"
            e = (g - g0).abs()[~may[..., None].expand(g.shape)]
            assert e.numel() == 0 or float(e.max()) <= 2 * bounds[name] + 1e-5, \
                f"{where}: {name} changed by poison no row can reach"


def poison(t: torch.Tensor, index, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def float64_params(params: dict) -> dict:
    return {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in params.items()}


def segments(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """The sequence of each packed query row, [total_q]."""
    cu = cu_seqlens_q.to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(len(lens)), lens)


def run_case(fop, clean, poisoned, *, params=None, poisoned_params=None, call=None, backward=True,
             where="", seed=0, family=None, bwd_family=None, deterministic=True):
    """The clean and the poisoned call of ``fop`` (forward, and backward with a random dout),
    the clean one against the reference, the poisoned one by the rule (Expect). ``call``: the
    layout and block-mask keywords (cu_seqlens_q, ..., block_mask). ``family`` / ``bwd_family``:
    the families forced for the forward / the backward (flashgen.use_family; None: the default
    choice); ``deterministic``: the backward's mode (bitwise comparisons need it)."""
    params = dict(params or {})
    params1 = params if poisoned_params is None else dict(poisoned_params)
    call = dict(call or {})
    packed = "cu_seqlens_q" in call
    q = clean[0]
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=g).to(q.dtype).to(q.device)

    def go(tensors, prm):
        leaves = [t.clone().requires_grad_(backward) for t in tensors]
        with flashgen.use_family(family):
            out, lse = fop(*leaves, return_lse=True, deterministic=deterministic, **call, **prm)
        grads = None
        if backward:
            with flashgen.use_family(bwd_family if bwd_family is not None else family):
                out.backward(dout)
            grads = tuple(t.grad for t in leaves)
        return out.detach(), lse.detach(), grads

    o0, l0, g0 = go(clean, params)
    cmp = check.compare(fop.spec, *clean, o0, l0, **call, **params)
    assert cmp.ok, f"{where}: clean forward {cmp}"
    o1, l1, g1 = go(poisoned, params1)
    ex = Expect(fop.spec, clean, poisoned, packed=packed,
                segment=segments(call["cu_seqlens_q"]).to(q.device) if packed else None, ref_kw=call,
                params64=float64_params(params), poisoned_params64=float64_params(params1))
    ex.check_forward(o1, l1, o0, l0, cmp.bound, cmp.lse_bound, where)
    if not backward:
        return ex
    gc = check.compare_grads(fop.spec, *clean, dout, g0, params=params, out=o0, **call)
    assert gc.ok, f"{where}: clean backward {gc}"
    if ex.changed:
        ex.check_backward(g1, gc.bounds, dout, where)
    elif deterministic:  # nothing reaches a row: the gradients are the clean call's, bit for bit
        for name, a, b in zip(("dq", "dk", "dv"), g1, g0, strict=True):
            assert torch.equal(a, b), f"{where}: {name} changed by poison no row can reach"
    else:  # the clean call's gradients; non-finite only in rows where the reference's autograd has
        # them: an inf in K at a key masked for every row still meets dS = 0 in dQ = dS·K (0 × inf)
        # wherever the kernel's tile pairs that key with a row, as in autograd's dense product
        ex.check_unreached_backward(g1, g0, gc.bounds, dout, where)
    return ex
