"""flashgen.lang.keyrange.key_range as the one source of a mask's per-row key range: codegen prints it as
C++ (tests/test_codegen.py keeps those renders fixed), explain evaluates it, and both agree with
the reference mask row by row."""

from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import explain as ex
from flashgen import reference
from flashgen.lang import ir, keyrange
from flashgen.params import example_params
from flashgen.sparsity import mask_extents

SPECS = Path(__file__).resolve().parent.parent / "specs"
ALL_SPECS = sorted(SPECS.glob("*.attn"))


def random_params(spec: ir.Spec, batch: int, heads: int, nq: int, nk: int, gen: torch.Generator) -> dict:
    """Parameter values with random int scalars (≥ 1 where the spec needs it) and tensors."""
    given = {}
    for p in spec.params:
        if p.kind == "int":
            low = 1 if p.name in spec.positive else 0
            given[p.name] = int(torch.randint(low, nk + 3, (), generator=gen))
    return example_params(spec, batch, heads, nq, nk, "cpu", gen, **given)


def closed_form_specs():
    out = []
    for path in ALL_SPECS:
        spec = flashgen.compile(path).spec
        if keyrange.key_range(spec).exact:
            out.append(path)
    return out


def test_most_example_specs_have_a_closed_form():
    names = {p.stem for p in closed_form_specs()}
    assert {"dense", "causal", "sliding_window", "prefix_lm", "key_padding", "gemma", "alibi"} <= names
    assert "document" not in names


@pytest.mark.parametrize("path", closed_form_specs(), ids=lambda p: p.stem)
def test_explain_row_bounds_match_the_reference_mask(path):
    spec = flashgen.compile(path).spec
    gen = torch.Generator().manual_seed(7)
    for trial in range(4):
        B, H = 2, 3
        nq, nk = (int(torch.randint(1, 70, (), generator=gen)) for _ in range(2))
        params = random_params(spec, B, H, nq, nk, gen)
        per_b, per_h = mask_extents(spec)
        bp, hp = (B if per_b else 1), (H if per_h else 1)
        lo, hi = ex.row_bounds(spec, nq, nk, bp, hp, params)
        assert lo.shape == hi.shape == (bp, hp, nq)
        keep = reference.keep_mask(spec, nq, nk, batch=B, heads=H, **params)
        if keep is None:
            keep = torch.ones(1, 1, nq, nk, dtype=torch.bool)
        keep = torch.broadcast_to(keep, (B, H, nq, nk))
        kv = torch.arange(nk)
        for b in range(B):
            for h in range(H):
                lo_r = lo[b if per_b else 0, h if per_h else 0].clamp(min=0)
                hi_r = hi[b if per_b else 0, h if per_h else 0].clamp(max=nk)
                want = (kv >= lo_r.view(-1, 1)) & (kv < hi_r.view(-1, 1))
                assert torch.equal(want, keep[b, h]), (path.stem, trial, b, h, params)


def test_explain_takes_its_bounds_from_key_range(monkeypatch):
    spec = flashgen.compile(SPECS / "sliding_window.attn").spec
    before = ex.explain(spec, 256, head_dim=64, arch="sm_90a", params={"window": 32})
    real = keyrange.key_range

    def shifted(s):  # the same range with the upper bound 10 keys lower
        rng = real(s)
        return keyrange.KeyRange(rng.lo, keyrange.JoinBound("min", rng.hi, keyrange.RowBound(ir.Name("q"), -9, keyrange.Mono.INC)),
                             rng.full, True)

    monkeypatch.setattr(keyrange, "key_range", shifted)
    after = ex.explain(spec, 256, head_dim=64, arch="sm_90a", params={"window": 32})
    assert after.visible_pairs < before.visible_pairs
    lo, hi = ex.row_bounds(spec, 256, 256, 1, 1, {"window": 32})
    assert int(hi[0, 0, 100]) == 100 - 9  # min(q + 1, q - 9)


def test_row_width_of_the_example_specs():
    """keyrange.row_width: the bounded widths the closed forms give (a sliding window's
    ``window``; window(left, right)'s ``left + right + 1``), none for masks whose rows grow with
    q (causal, ALiBi, prefix-LM) or that have no lower bound."""
    width = {p.stem: keyrange.row_width(flashgen.compile(p).spec) for p in ALL_SPECS}
    assert width["sliding_window"] == ({"window": 1},)
    assert width["gemma"] == ({"window": 1},)
    assert width["transformers_window"] == ({"left": 1, "right": 1, None: 1},)
    for name in ("dense", "causal", "alibi", "prefix_lm", "document", "key_padding", "softcap"):
        assert width[name] == (), name


WIDTH_SPECS = [p for p in ALL_SPECS if keyrange.row_width(flashgen.compile(p).spec)]


@pytest.mark.parametrize("path", WIDTH_SPECS, ids=lambda p: p.stem)
def test_row_width_bounds_every_rows_kept_keys(path):
    """The width forms bound the keys the reference mask keeps in every row, for random int
    parameters, odd shapes and seqlen_q ≠ seqlen_k (what decode's key_span relies on)."""
    spec = flashgen.compile(path).spec
    forms = keyrange.row_width(spec)
    gen = torch.Generator().manual_seed(7)
    for nq, nk in ((1, 1), (7, 29), (40, 40), (33, 70)):
        for _ in range(4):
            params = random_params(spec, 2, 2, nq, nk, gen)
            kept = reference.keep_mask(spec, nq, nk, batch=2, heads=2, **params).sum(-1).max().item()
            for form in forms:
                bound = sum(c * (1 if k is None else params[k]) for k, c in form.items())
                assert kept <= max(0, bound), (nq, nk, params, form, kept)


def test_row_width_of_unions_and_intersections():
    """A union of a window and a prefix keeps more than the window: no width; an intersection of
    two windows keeps at most the narrower: both widths; a window of length-dependent bounds
    (left = seqlen_k / 2) is no host-known width."""
    union = flashgen.compile("attention u {\n    param window: int\n    param prefix: int\n"
                             "    mask = (kv <= q and kv > q - window) or kv < prefix\n}\n").spec
    assert keyrange.row_width(union) == ()
    both = flashgen.compile("attention i {\n    param w1: int\n    param w2: int\n"
                            "    mask = kv <= q and kv > q - w1 and kv > q - w2\n}\n").spec
    assert sorted(keyrange.row_width(both), key=str) == [{"w1": 1}, {"w2": 1}]
    moving = flashgen.compile("attention m {\n    mask = kv <= q and kv > q - seqlen_k / 2\n}\n").spec
    assert keyrange.row_width(moving) == ()
    # rows whose range moves two keys per row, or differs per head: a row keeps w keys, but a
    # decode tile of consecutive rows (or of a GQA group's heads) more than w + rows - 1
    for mask in ("kv <= 2*q - seqlen_k and kv > 2*q - seqlen_k - w", "kv <= q - h and kv > q - h - w"):
        spec = flashgen.compile("attention s {\n    param w: int\n    mask = %s\n}\n" % mask).spec
        assert keyrange.row_width(spec) == (), mask


@pytest.mark.parametrize("path", WIDTH_SPECS, ids=lambda p: p.stem)
def test_row_width_bounds_a_tile_of_consecutive_rows(path):
    """n consecutive rows, over every head, keep at most width + n - 1 keys in all: what decode's
    key_span counts for a tile of the last Sq positions of a GQA group."""
    spec = flashgen.compile(path).spec
    gen = torch.Generator().manual_seed(11)
    for n_rows in (1, 3, 16):
        nk = 60
        params = random_params(spec, 2, 4, nk, nk, gen)
        keep = reference.keep_mask(spec, nk, nk, batch=2, heads=4, **params)
        keep = torch.broadcast_to(keep, (2, 4, nk, nk))
        for end in range(n_rows, nk + 1, 7):
            union = keep[:, :, end - n_rows:end].any(2).any(1).sum(-1).max().item()
            for form in keyrange.row_width(spec):
                bound = sum(c * (1 if k is None else params[k]) for k, c in form.items())
                assert union <= max(0, bound) + n_rows - 1, (end, n_rows, params, form, union)
