"""Reads of tensor parameters at computed indices (t[h + 1], t[100], rel[h, clamp(kv - q, ...) + m])
are checked against the call's shapes before any launch, as flashgen.reference would fail on
them (the kernels would clamp the index instead); their ranges come from exact interval
arithmetic (flashgen/lang/intervals.py), checked here against brute force."""

import itertools
import random

import pytest
import torch

import flashgen
from flashgen.lang import frontend, intervals


def _index_of(text: str):
    spec = frontend.parse("attention t {\n param t: f32[heads]\n param m: int\n score = score + t[" + text + "]\n}")
    reads = intervals.reads(spec)
    return spec, reads


EXPRS = ["h + 1", "100", "kv - q + seqlen_q - 1", "clamp(kv - q, -m, m) + m", "(h + 3) % 4", "-q // 3 + 7",
         "abs(kv - 5) * 2", "min(q, 3) + max(kv, m)", "sign(q - 2) + 1", "b * 4 + h", "(q - 7) % 5",
         "kv // (m + 1)", "clamp(q * 3, 2, m)"]


@pytest.mark.parametrize("text", EXPRS)
def test_intervals_are_exact(text):
    _, reads = _index_of(text)
    assert len(reads) == 1
    e = reads[0].index
    rnd = random.Random(text)
    for _ in range(20):
        sizes = {"b": rnd.randint(1, 3), "h": rnd.randint(1, 4), "q": rnd.randint(1, 9), "kv": rnd.randint(1, 9)}
        m = rnd.randint(0, 6)
        env = {p: (0, n - 1) for p, n in sizes.items()} | {"seqlen_q": (sizes["q"],) * 2,
                                                            "seqlen_k": (sizes["kv"],) * 2, "m": (m, m)}
        values = []
        for b, h, q, kv in itertools.product(*(range(sizes[p]) for p in ("b", "h", "q", "kv"))):
            point = {"b": (b, b), "h": (h, h), "q": (q, q), "kv": (kv, kv)}
            values.append(intervals.interval(e, env | point)[0])
        assert intervals.interval(e, env) == (min(values), max(values)), (text, sizes, m)


def test_reads_left_to_runtime_clamping():
    """Bare positions are checked by size elsewhere; data-dependent indices and indices using a
    position twice (whose interval would not be exact) are not checked here."""
    for text in ("h", "q - q", "where(q < 3, q, 0)"):
        assert intervals.reads(_index_of(text)[0]) == ()
    spec = frontend.parse("attention t {\n param t: f32[heads]\n param d: i32[seqlen_k]\n"
                          " score = score + t[d[kv]]\n}")
    assert [(r.name, r.dim) for r in intervals.reads(spec)] == []


@pytest.mark.parametrize("index, message", [("100", r"reaches 100\.\.100"), ("h + 1", r"reaches 1\.\.8")])
def test_out_of_range_reads_raise_before_launch(index, message):
    op = flashgen.compile("attention a {\n param t: f32[heads]\n score = score + t[" + index + "]\n}")
    q = torch.randn(1, 8, 16, 8)
    t = torch.randn(8)
    with pytest.raises(ValueError, match=rf"^t: dim 0 has size 8 but the spec's index at .*:3:\d+ {message}"):
        op(q, q, q, t=t)  # raises in the call's validation: nothing is built
    with pytest.raises(IndexError):
        flashgen.reference.attention(op.spec, q.double(), q.double(), q.double(), t=t)


def test_in_range_computed_reads_pass():
    op = flashgen.compile("specs/relative_bias.attn")
    q = torch.randn(1, 2, 7, 8)
    rel = torch.randn(2, 9)
    values = op.check_params(q, q, {"rel": rel, "max_distance": 4})  # clamp(kv - q, -4, 4) + 4 in [0, 8]
    assert values[1] is rel
    with pytest.raises(ValueError, match="rel: dim 1 has size 8, expected 9"):
        op.check_params(q, q, {"rel": torch.randn(2, 8), "max_distance": 4})
