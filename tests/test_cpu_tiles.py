"""The CPU family's tile choice (flashgen/families/cpu_tiles.py): the tiles its rule gives equal
those the C++ choosers gave before the rule moved out of templates/include/flashgen/cpu/tiles.h,
the tiles a kernel receives are those explain reports, the overrides reach the kernel, and an
unset tile is refused."""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import SPECS

import flashgen
from flashgen import check, env
from flashgen import explain as ex
from flashgen.families import cpu_tiles
from flashgen.lang import frontend
from flashgen.runtime import launch


def values_for(name: str, nq: int, nk: int) -> dict:
    """The parameter values of the recorded cases (TABLE)."""
    if name == "sliding_window":
        return {"window": 256}
    if name == "gemma":
        return {"window": 100, "softcap": 30.0}
    if name == "key_padding":
        return {"kv_len": torch.tensor([nk // 3, nk], dtype=torch.int32)}
    if name == "prefix_lm":
        return {"prefix_len": torch.tensor([nk // 4, 7], dtype=torch.int32)}
    if name == "document":
        return {"document_id": (torch.arange(nk, dtype=torch.int32) // 300).repeat(2, 1)}
    if name == "alibi":
        return {"slopes": torch.ones(4)}
    return {}


# (spec, seqlen_q, seqlen_k, head_dim, batch·heads, threads, L2 KiB, forward (qb, kvb), backward
# (qb, kvb); the dropout spec's backward with its mask regenerated): what choose_tiles and
# bwd_choose_tiles of cpu/tiles.h returned for these calls, recorded from the C++ before the rule
# moved to Python (and compared there on ~40,000 random cases of every example spec).
TABLE = [
    ('dense', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('dense', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('dense', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('dense', 100, 140, 64, 16, 2, 2048, (100, 144), (100, 128)),
    ('dense', 100, 140, 128, 1, 8, 512, (32, 144), (100, 64)),
    ('dense', 100, 140, 256, 4, 1, 1024, (100, 144), (100, 64)),
    ('dense', 1000, 257, 64, 16, 2, 2048, (256, 264), (128, 128)),
    ('dense', 1000, 257, 128, 1, 8, 512, (128, 264), (128, 64)),
    ('dense', 1000, 257, 256, 4, 1, 1024, (256, 264), (128, 64)),
    ('dense', 1024, 1024, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('dense', 1024, 1024, 128, 1, 8, 512, (128, 512), (128, 64)),
    ('dense', 1024, 1024, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('dense', 2048, 512, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('dense', 2048, 512, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('dense', 2048, 512, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('dense', 300, 2000, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('dense', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('dense', 300, 2000, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('dense', 4096, 4096, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('dense', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('dense', 4096, 4096, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('causal', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('causal', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('causal', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('causal', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('causal', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('causal', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('causal', 1000, 257, 64, 16, 2, 2048, (32, 264), (32, 128)),
    ('causal', 1000, 257, 128, 1, 8, 512, (64, 264), (32, 64)),
    ('causal', 1000, 257, 256, 4, 1, 1024, (32, 264), (32, 64)),
    ('causal', 1024, 1024, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('causal', 1024, 1024, 128, 1, 8, 512, (128, 512), (64, 64)),
    ('causal', 1024, 1024, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('causal', 2048, 512, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('causal', 2048, 512, 128, 1, 8, 512, (64, 512), (64, 64)),
    ('causal', 2048, 512, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('causal', 300, 2000, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('causal', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('causal', 300, 2000, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('causal', 4096, 4096, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('causal', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('causal', 4096, 4096, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('sliding_window', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('sliding_window', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('sliding_window', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('sliding_window', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('sliding_window', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('sliding_window', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('sliding_window', 1000, 257, 64, 16, 2, 2048, (32, 264), (32, 128)),
    ('sliding_window', 1000, 257, 128, 1, 8, 512, (64, 264), (32, 64)),
    ('sliding_window', 1000, 257, 256, 4, 1, 1024, (32, 264), (32, 64)),
    ('sliding_window', 1024, 1024, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('sliding_window', 1024, 1024, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('sliding_window', 1024, 1024, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('sliding_window', 2048, 512, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('sliding_window', 2048, 512, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('sliding_window', 2048, 512, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('sliding_window', 300, 2000, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('sliding_window', 300, 2000, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('sliding_window', 300, 2000, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('sliding_window', 4096, 4096, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('sliding_window', 4096, 4096, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('sliding_window', 4096, 4096, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('key_padding', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('key_padding', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('key_padding', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('key_padding', 100, 140, 64, 16, 2, 2048, (100, 144), (100, 128)),
    ('key_padding', 100, 140, 128, 1, 8, 512, (32, 144), (100, 64)),
    ('key_padding', 100, 140, 256, 4, 1, 1024, (100, 144), (100, 64)),
    ('key_padding', 1000, 257, 64, 16, 2, 2048, (256, 264), (128, 128)),
    ('key_padding', 1000, 257, 128, 1, 8, 512, (128, 264), (128, 64)),
    ('key_padding', 1000, 257, 256, 4, 1, 1024, (256, 264), (128, 64)),
    ('key_padding', 1024, 1024, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('key_padding', 1024, 1024, 128, 1, 8, 512, (128, 512), (128, 64)),
    ('key_padding', 1024, 1024, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('key_padding', 2048, 512, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('key_padding', 2048, 512, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('key_padding', 2048, 512, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('key_padding', 300, 2000, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('key_padding', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('key_padding', 300, 2000, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('key_padding', 4096, 4096, 64, 16, 2, 2048, (256, 512), (128, 128)),
    ('key_padding', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('key_padding', 4096, 4096, 256, 4, 1, 1024, (256, 512), (128, 64)),
    ('document', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('document', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('document', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('document', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('document', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('document', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('document', 1000, 257, 64, 16, 2, 2048, (128, 264), (128, 128)),
    ('document', 1000, 257, 128, 1, 8, 512, (128, 264), (128, 64)),
    ('document', 1000, 257, 256, 4, 1, 1024, (128, 264), (128, 64)),
    ('document', 1024, 1024, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('document', 1024, 1024, 128, 1, 8, 512, (128, 512), (64, 64)),
    ('document', 1024, 1024, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('document', 2048, 512, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('document', 2048, 512, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('document', 2048, 512, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('document', 300, 2000, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('document', 300, 2000, 128, 1, 8, 512, (64, 512), (32, 64)),
    ('document', 300, 2000, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('document', 4096, 4096, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('document', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('document', 4096, 4096, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('prefix_lm', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('prefix_lm', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('prefix_lm', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('prefix_lm', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('prefix_lm', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('prefix_lm', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('prefix_lm', 1000, 257, 64, 16, 2, 2048, (64, 264), (64, 128)),
    ('prefix_lm', 1000, 257, 128, 1, 8, 512, (64, 264), (64, 64)),
    ('prefix_lm', 1000, 257, 256, 4, 1, 1024, (64, 264), (64, 64)),
    ('prefix_lm', 1024, 1024, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('prefix_lm', 1024, 1024, 128, 1, 8, 512, (128, 512), (64, 64)),
    ('prefix_lm', 1024, 1024, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('prefix_lm', 2048, 512, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('prefix_lm', 2048, 512, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('prefix_lm', 2048, 512, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('prefix_lm', 300, 2000, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('prefix_lm', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('prefix_lm', 300, 2000, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('prefix_lm', 4096, 4096, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('prefix_lm', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('prefix_lm', 4096, 4096, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('gemma', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('gemma', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('gemma', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('gemma', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('gemma', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('gemma', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('gemma', 1000, 257, 64, 16, 2, 2048, (32, 264), (32, 128)),
    ('gemma', 1000, 257, 128, 1, 8, 512, (32, 264), (32, 64)),
    ('gemma', 1000, 257, 256, 4, 1, 1024, (32, 264), (32, 64)),
    ('gemma', 1024, 1024, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('gemma', 1024, 1024, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('gemma', 1024, 1024, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('gemma', 2048, 512, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('gemma', 2048, 512, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('gemma', 2048, 512, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('gemma', 300, 2000, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('gemma', 300, 2000, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('gemma', 300, 2000, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('gemma', 4096, 4096, 64, 16, 2, 2048, (32, 512), (32, 128)),
    ('gemma', 4096, 4096, 128, 1, 8, 512, (32, 512), (32, 64)),
    ('gemma', 4096, 4096, 256, 4, 1, 1024, (32, 512), (32, 64)),
    ('alibi', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('alibi', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('alibi', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('alibi', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('alibi', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('alibi', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('alibi', 1000, 257, 64, 16, 2, 2048, (32, 264), (32, 128)),
    ('alibi', 1000, 257, 128, 1, 8, 512, (64, 264), (32, 64)),
    ('alibi', 1000, 257, 256, 4, 1, 1024, (32, 264), (32, 64)),
    ('alibi', 1024, 1024, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('alibi', 1024, 1024, 128, 1, 8, 512, (128, 512), (64, 64)),
    ('alibi', 1024, 1024, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('alibi', 2048, 512, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('alibi', 2048, 512, 128, 1, 8, 512, (64, 512), (64, 64)),
    ('alibi', 2048, 512, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('alibi', 300, 2000, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('alibi', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('alibi', 300, 2000, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('alibi', 4096, 4096, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('alibi', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('alibi', 4096, 4096, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('dropout', 20, 30, 64, 16, 2, 2048, (20, 32), (20, 32)),
    ('dropout', 20, 30, 128, 1, 8, 512, (20, 32), (20, 32)),
    ('dropout', 20, 30, 256, 4, 1, 1024, (20, 32), (20, 32)),
    ('dropout', 100, 140, 64, 16, 2, 2048, (32, 144), (32, 128)),
    ('dropout', 100, 140, 128, 1, 8, 512, (32, 144), (32, 64)),
    ('dropout', 100, 140, 256, 4, 1, 1024, (32, 144), (32, 64)),
    ('dropout', 1000, 257, 64, 16, 2, 2048, (32, 264), (32, 128)),
    ('dropout', 1000, 257, 128, 1, 8, 512, (64, 264), (32, 64)),
    ('dropout', 1000, 257, 256, 4, 1, 1024, (32, 264), (32, 64)),
    ('dropout', 1024, 1024, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('dropout', 1024, 1024, 128, 1, 8, 512, (128, 512), (64, 64)),
    ('dropout', 1024, 1024, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('dropout', 2048, 512, 64, 16, 2, 2048, (64, 512), (64, 128)),
    ('dropout', 2048, 512, 128, 1, 8, 512, (64, 512), (64, 64)),
    ('dropout', 2048, 512, 256, 4, 1, 1024, (64, 512), (64, 64)),
    ('dropout', 300, 2000, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('dropout', 300, 2000, 128, 1, 8, 512, (64, 512), (128, 64)),
    ('dropout', 300, 2000, 256, 4, 1, 1024, (128, 512), (128, 64)),
    ('dropout', 4096, 4096, 64, 16, 2, 2048, (128, 512), (128, 128)),
    ('dropout', 4096, 4096, 128, 1, 8, 512, (256, 512), (128, 64)),
    ('dropout', 4096, 4096, 256, 4, 1, 1024, (128, 512), (128, 64)),
]


@pytest.mark.parametrize("name", sorted({row[0] for row in TABLE}))
def test_tiles_equal_the_former_cpp_choice(name):
    spec = frontend.parse(SPECS / f"{name}.attn")
    for _, nq, nk, d, bh, threads, l2_kib, fwd, bwd in (row for row in TABLE if row[0] == name):
        values = values_for(name, nq, nk)
        case = (nq, nk, d, bh, threads, l2_kib)
        assert cpu_tiles.derived_fwd_tiles(spec, bh, nq, nk, d, values, threads=threads, l2=l2_kib << 10) == fwd, case
        assert cpu_tiles.derived_bwd_tiles(spec, nq, nk, d, spec.dropout, values, l2=l2_kib << 10) == bwd, case


@pytest.fixture
def received(monkeypatch):
    """The (kind, tile_q, tile_kv) of every kernel launch while the test runs."""
    seen = []
    real = launch._launch

    def spy(entry, args, q):
        seen.append(("fwd" if isinstance(args, launch.FgFwdArgs) else "bwd", args.tile_q, args.tile_kv))
        return real(entry, args, q)

    monkeypatch.setattr(launch, "_launch", spy)
    return seen


# Specs and the parameters passed to both the op and explain: dense, causal, a sliding window,
# a tensor parameter the key range reads (key padding), a mask without a closed form (document).
CASES = {
    "dense": lambda nq, nk: {},
    "causal": lambda nq, nk: {},
    "sliding_window": lambda nq, nk: {"window": 96},
    "key_padding": lambda nq, nk: {"kv_len": torch.tensor([nk // 2, nk], dtype=torch.int32)},
    "document": lambda nq, nk: {"document_id": (torch.arange(nk, dtype=torch.int32) // 70).repeat(2, 1)},
}
SHAPES = [(200, 200), (1000, 257), (257, 700), (40, 1500)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_receives_the_tiles_explain_reports(name, received):
    """Forward and backward, padded layout: the tiles in the argument blocks are explain's, and
    the results match the float64 reference."""
    op = flashgen.compile(SPECS / f"{name}.attn")
    B, H, Hkv, d = 2, 4, 2, 32
    for nq, nk in SHAPES:
        if name == "document" and nq > nk:
            continue  # the ids [batch, seqlen_k] are indexed by q too: nq > nk reads out of their bounds
        params = CASES[name](nq, nk)
        g = torch.Generator().manual_seed(nq + nk)
        q = torch.randn(B, H, nq, d, generator=g)
        k, v = (torch.randn(B, Hkv, nk, d, generator=g) for _ in range(2))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        received.clear()
        out, lse = op(qg, kg, vg, return_lse=True, **params)
        dout = torch.randn(out.shape, generator=g)
        out.backward(dout)
        rep = ex.explain(op, nq, nk, head_dim=d, batch=B, heads=H, kv_heads=Hkv, params=params, dtype="fp32")
        want = {kind: (rep.tiles[kind].block_m, rep.tiles[kind].block_n) for kind in ("fwd", "bwd")}
        got = {kind: (tq, tkv) for kind, tq, tkv in received}
        assert got == want and len(received) == 2, (name, nq, nk, received, want)
        assert check.compare(op.spec, q, k, v, out.detach(), lse.detach(), **params).ok
        assert check.compare_grads(op.spec, q, k, v, dout, (qg.grad, kg.grad, vg.grad), params=params).ok


def test_decisions_follow_the_values_the_key_range_reads(received):
    """A repeated call reuses the cached decision, a new window value makes a new one (the tiles
    depend on it), each equal to explain's; block-list calls take the lists' block sizes."""
    op = flashgen.compile(SPECS / "sliding_window.attn")
    q, k, v = (torch.randn(1, 2, 600, 32) for _ in range(3))
    got = []
    for window in (16, 600, 16):
        received.clear()
        op(q, k, v, window=window)
        rep = ex.explain(op, 600, head_dim=32, heads=2, params={"window": window}, dtype="fp32")
        assert received == [("fwd", rep.tiles["fwd"].block_m, rep.tiles["fwd"].block_n)]
        got.append(received[0])
    assert got[0] == got[2]
    lib = op.library(flashgen.families.get("cpu"), q.device, flashgen.lang.ir.DType.FP32, 32)
    assert len([key for key in op.launch_fields(lib).cache if key[:4] == ("fwd", 2, 600, 600)]) == 2  # per window
    dense = flashgen.compile(SPECS / "dense.attn")
    bm = flashgen.BlockMask.from_pattern(torch.ones(1, 1, 10, 5, dtype=torch.bool), block_size=(64, 128))
    q, k, v = (torch.randn(1, 2, 600, 32, requires_grad=True) for _ in range(3))
    received.clear()
    dense(q, k, v, block_mask=bm).sum().backward()
    fr, fc, br, bc, _, _ = flashgen.families.get("cpu").block_tiles(None, (64, 128))
    assert received == [("fwd", *cpu_tiles.sparse_fwd_tiles(fr, fc, 600, 32)), ("bwd", bc, br)]


def test_decision_cache_keys_on_the_elements_read():
    """The cached decision is keyed by what the key range reads at b = h = 0: a short vector's
    content, else the one element (clamped as the kernels clamp); equal keys give equal tiles."""
    spec = frontend.parse("attention lim {\n param lim: i32[batch, heads]\n param n: i32[batch]\n"
                          " mask = kv < lim[b, h] + 3 and kv >= n[b] - 500\n}")
    chooser = cpu_tiles.CpuTiles(spec)
    lim = torch.tensor([[40, 7], [9, 9]], dtype=torch.int32)
    short, long = torch.tensor([3, 600], dtype=torch.int32), torch.arange(100, dtype=torch.int32) + 500
    # the lower bound's read n[b] first, then the upper bound's lim[b, h] (one element: 2-D)
    assert chooser.key_values([lim, short], 64, 64) == ((3, 600), 40)
    assert chooser.key_values([lim, long], 64, 64) == (500, 40)  # a long vector: its element n[0]
    args = launch.FgFwdArgs()
    args.batch, args.heads_q, args.seqlen_q, args.seqlen_k, args.head_dim = 2, 2, 300, 2000, 64
    for values in ([lim, short], [lim * 40, short], [lim, long]):
        chooser.fwd(args, values)
        named = dict(zip(("lim", "n"), values, strict=True))
        want = cpu_tiles.derived_fwd_tiles(spec, 4, 300, 2000, 64, named, threads=torch.get_num_threads(),
                                           l2=cpu_tiles.l2_bytes())
        assert (args.tile_q, args.tile_kv) == cpu_tiles.override_fwd(want, 300, 2000, cpu_tiles.overrides()[0])


def test_overrides_reach_the_kernel(forced_cpu_tiles, received):
    """FLASHGEN_CPU_TILES / FLASHGEN_CPU_BWD_TILES (read once per process) become the tiles the
    kernels receive, capped by the sizes as before; explain reports them with origin 'env'."""
    op = flashgen.compile(SPECS / "causal.attn")
    forced_cpu_tiles("40,24", "33,17")
    q, k, v = (torch.randn(1, 2, 100, 32, requires_grad=True) for _ in range(3))
    op(q, k, v).sum().backward()
    assert received == [("fwd", 40, 24), ("bwd", 33, 24)]
    rep = ex.explain(op, 100, head_dim=32, heads=2, dtype="fp32")
    assert [(t.block_m, t.block_n, t.origin) for t in rep.tiles.values()] == [(40, 24, "env"), (33, 24, "env")]
    forced_cpu_tiles("5000,4", "")  # out of range: the rule's own tiles stay
    received.clear()
    op(q, k, v).sum().backward()
    rep = ex.explain(op, 100, head_dim=32, heads=2, dtype="fp32")
    assert received == [(kind, t.block_m, t.block_n) for kind, t in rep.tiles.items()]
    assert {t.origin for t in rep.tiles.values()} == {"derived (L2 cache)"}


def test_override_parsing():
    """The variables are read as C's strtol read them in the kernels before: "qb,kvb", a missing
    or unreadable number 0; the family applies only values in range and caps them by the sizes."""
    cases = {"40,24": (40, 24), " 7 , 9": (7, 0), "+8,-3": (8, -3), "abc": (0, 0), ",64": (0, 64), "12": (12, 0),
             "3x4": (3, 0), "": (0, 0)}
    for raw, want in cases.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASHGEN_CPU_TILES", raw)
            assert env.cpu_tiles() == want, raw
    assert env.cpu_bwd_tiles() is None or isinstance(env.cpu_bwd_tiles(), tuple)
    assert cpu_tiles.override_fwd((64, 512), 1000, 1000, (40, 21)) == (40, 24)  # kvb rounded up to 8
    assert cpu_tiles.override_fwd((64, 512), 30, 20, (40, 100)) == (30, 24)  # capped by the sizes
    assert cpu_tiles.override_fwd((64, 512), 1000, 1000, (0, 9000)) == (64, 512)  # out of range: kept
    assert cpu_tiles.override_bwd((64, 128), 1000, 1000, (2000, 2000)) == (64, 128)  # bwd kvb at most 1024
    assert cpu_tiles.override_bwd((64, 128), 0, 1000, (16, 0)) == (1, 128)  # no queries: 1 row


def test_kernels_refuse_tiles_out_of_range():
    """0 means "not set" and is refused (FG_ERR_BAD_SHAPE), as are tiles outside the rule's range."""
    op = flashgen.compile(SPECS / "dense.attn")
    q, k, v = (torch.randn(1, 1, 64, 32) for _ in range(3))
    lib = op.library(flashgen.families.get("cpu"), q.device, flashgen.lang.ir.DType.FP32, 32)
    out, lse = torch.empty_like(q), torch.empty(1, 1, 64)
    args = launch.FgFwdArgs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 1, 1, 1, 64,
                            64, 32, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], 0.1, 0,
                            None, None)
    for tiles, status in (((0, 0), 5), ((64, 12), 5), ((2000, 64), 5), ((64, 64), 0)):
        args.tile_q, args.tile_kv = tiles
        assert lib.fwd(ctypes.byref(args)) == status, tiles
