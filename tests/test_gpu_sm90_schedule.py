"""The sm90 forward's dynamic schedule on packed batches (sm90/fwd.cuh ``dynamic``,
flashgen/families/sm90_schedule.py) on a Hopper GPU: mixed lengths with empty and length-1
sequences against the float64 reference (outputs poisoned with NaN before every launch, so an
item no CTA ran shows), bitwise equal to the static schedule (each item is computed alike
whichever CTA takes it), a fresh counter per call, and CUDA graph replays (the counter's zero
fill is captured). The whole module skips on devices that are not compute capability 9.0."""

import pytest
import torch
from conftest import SPECS
from variant_cases import make_params
from varlen_cases import cu_seqlens, inputs

import flashgen
from flashgen import check
from flashgen.runtime import checks

pytestmark = pytest.mark.gpu

MIXED_Q = [1, 0, 1000, 37, 512, 1, 2048, 0, 77, 1500, 129, 200, 1, 384]
MIXED_K = [1, 5, 1000, 0, 512, 1, 2048, 0, 300, 1500, 129, 7, 1, 385]


@pytest.fixture(scope="module", autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family runs on compute capability 9.0 only")


def _varlen(lq, lk):
    return {"cu_seqlens_q": cu_seqlens(lq, "cuda"), "cu_seqlens_k": cu_seqlens(lk, "cuda"),
            "max_seqlen_q": max(lq), "max_seqlen_k": max(lk)}


def _queued(q, k, varlen) -> bool:
    """Whether the call's validated layout holds an sm90 work-order table (the dynamic schedule
    ran; the layout is the cached one the op used)."""
    return any(key[0] == "sm90-fwd" for key in checks.packed_layout(q, k, **varlen).schedules)


@pytest.mark.parametrize("name, d", [("causal", 128), ("dense", 128), ("dense", 64), ("sliding_window", 128),
                                     ("document", 128), ("causal", 256)])
def test_dynamic_schedule_matches_reference_and_static(name, d, monkeypatch):
    lq = MIXED_Q
    lk = MIXED_Q if name == "document" else MIXED_K  # ids compare query and key positions
    varlen = _varlen(lq, lk)
    q, k, v, _ = inputs(lq, lk, 4, 2, d, torch.bfloat16, device="cuda", seed=d + len(name))
    op = flashgen.compile(SPECS / f"{name}.attn")
    params = make_params(name, len(lq), 4, max(lq), max(lk), "cuda", torch.Generator().manual_seed(d), 2) \
        if op.spec.params else {}
    with flashgen.use_family("sm90"):
        assert op.family_for("cuda", torch.bfloat16, d, layout="packed").family.name == "sm90"
        out, lse = op(q, k, v, return_lse=True, **varlen, **params)
        assert _queued(q, k, varlen)
        monkeypatch.setenv("FLASHGEN_SM90_SCHEDULE", "static")
        out_s, lse_s = op(q, k, v, return_lse=True, **varlen, **params)
    cmp = check.compare(op.spec, q, k, v, out, lse, **varlen, **params)
    assert cmp.ok, f"{name} d{d}: {cmp}"
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s)


def test_many_sequences_and_heads():
    """Hundreds of work items per multiprocessor's worth of CTAs: the ring's slots turn over many
    times per CTA (short sequences), and lengths straddle the 128-row query tiles."""
    g = torch.Generator().manual_seed(3)
    lens = [int(x) for x in torch.randint(0, 300, (160,), generator=g)] + [0, 1, 127, 128, 129]
    varlen = _varlen(lens, lens)
    q, k, v, _ = inputs(lens, lens, 8, 8, 128, torch.float16, device="cuda", seed=3)
    op = flashgen.compile(SPECS / "causal.attn")
    with flashgen.use_family("sm90"):
        out, lse = op(q, k, v, return_lse=True, **varlen)
    assert _queued(q, k, varlen)
    cmp = check.compare(op.spec, q, k, v, out, lse, **varlen)
    assert cmp.ok, str(cmp)


def test_counter_is_fresh_per_call():
    """Two calls in a row on the same layout both run every item (a counter left at the first
    call's count would give the second nothing to draw: its poisoned outputs would stay NaN),
    and the second, with the layout and its table cached, does not synchronise the host."""
    varlen = _varlen(MIXED_Q, MIXED_K)
    q, k, v, _ = inputs(MIXED_Q, MIXED_K, 4, 4, 128, torch.bfloat16, device="cuda", seed=11)
    op = flashgen.compile(SPECS / "causal.attn")
    with flashgen.use_family("sm90"):
        first = op(q, k, v, return_lse=True, **varlen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            second = op(q, k, v, return_lse=True, **varlen)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    cmp = check.compare(op.spec, q, k, v, *second, **varlen)
    assert cmp.ok, str(cmp)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_cuda_graph_capture_and_replays():
    """A packed call captured after a warm-up call (which validated the layout and built its
    table) replays correctly twice with new inputs: the counter's zero fill is part of the graph."""
    varlen = _varlen(MIXED_Q, MIXED_K)
    q, k, v, _ = inputs(MIXED_Q, MIXED_K, 4, 2, 128, torch.bfloat16, device="cuda", seed=21)
    op = flashgen.compile(SPECS / "causal.attn")
    with flashgen.use_family("sm90"):
        op(q, k, v, **varlen)  # warm: builds the library, validates the layout, builds the table
        assert _queued(q, k, varlen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = op(q, k, v, return_lse=True, **varlen)
        for seed in (22, 23):
            q2, k2, v2, _ = inputs(MIXED_Q, MIXED_K, 4, 2, 128, torch.bfloat16, device="cuda", seed=seed)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            graph.replay()
            torch.cuda.synchronize()
            want = op(q2, k2, v2, return_lse=True, **varlen)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"replay with inputs {seed}"
            cmp = check.compare(op.spec, q2, k2, v2, out, lse, **varlen)
            assert cmp.ok, str(cmp)
