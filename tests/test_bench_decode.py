"""flashgen bench --decode (flashgen/bench_decode.py): op.with_kvcache timed next to SDPA on the
same cache and a read-only pass over the same K and V bytes; the byte count of the attended
positions, the peers' masks at the decode positions, and the option errors."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flashgen
from flashgen import bench_decode, reference
from flashgen.lang import ir
from flashgen.cli import main

SPECS = Path(__file__).resolve().parent.parent / "specs"
FP32 = 4


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_decode_table_json_and_bandwidth(capsys, tmp_path):
    out = tmp_path / "rows.json"
    B, Hq, Hkv, d, lens = 2, 4, 2, 16, (64, 128)
    rc, text, _ = cli(capsys, "bench", str(SPECS / "causal.attn"), "--decode", "--device", "cpu", "--cache-len",
                      *map(str, lens), "--batch", str(B), "--heads", str(Hq), "--kv-heads", str(Hkv), "--head-dim",
                      str(d), "--reps", "1", "--json", str(out))
    assert rc == 0
    rows = json.loads(out.read_text())
    impls = ("flashgen", "sdpa", "read-only")
    assert [(r["impl"], r["cache_len"]) for r in rows] == [(n, L) for L in lens for n in impls]
    for r in rows:
        L = r["cache_len"]
        assert (r["batch"], r["heads"], r["kv_heads"], r["seqlen_q"], r["head_dim"], r["dtype"], r["mask"],
                r["page_size"], r["device"]) == (B, Hq, Hkv, 1, d, "fp32", "causal", 0, "cpu")
        assert r["bytes"] == B * Hkv * 2 * L * d * FP32  # causal at Sq = 1 attends every cached key
        assert r["ms"] > 0 and math.isclose(r["gbps"], r["bytes"] / (r["ms"] * 1e-3) / 1e9), r
    for L in lens:
        ours, sdpa, ro = (r for r in rows if r["cache_len"] == L)
        assert ours["ratios"].keys() == {"sdpa", "read-only"} and sdpa["ratios"] == ro["ratios"] == {}
        assert math.isclose(ours["ratios"]["sdpa"], ours["gbps"] / sdpa["gbps"])
        assert math.isclose(ours["ratios"]["read-only"], ours["gbps"] / ro["gbps"])
    lines = text.splitlines()
    assert lines[0].startswith("# ") and " decode (Sq=1, contiguous cache, num_splits 0) " in lines[0]
    table = [ln for ln in lines[1:] if not ln.startswith("  ")]
    assert [ln.split()[0] for ln in table] == ["flashgen", "sdpa", "read-only"] * 2
    assert all(" GB/s" in ln and f"H={Hq}/{Hkv}" in ln for ln in table)
    ratios = [ln for ln in lines if ln.startswith("  flashgen GB/s over: ")]
    assert len(ratios) == 2 and "sdpa " in ratios[0] and "read-only " in ratios[0]


def test_cli_decode_sliding_window_counts_the_window(capsys, tmp_path):
    """Bytes count the positions attended: the window, not the cache; the read-only pass reads
    the same slice; a paged cache and Sq = 2 (one more position in the hull of the rows)."""
    out = tmp_path / "rows.json"
    B, Hkv, d, L, W = 1, 2, 16, 128, 16
    rc, text, _ = cli(capsys, "bench", str(SPECS / "sliding_window.attn"), "--decode", "--device", "cpu",
                      "--cache-len", str(L), "--batch", str(B), "--heads", "4", "--head-dim", str(d), "--sq", "2",
                      "--page-size", "16", "--num-splits", "1", "--param", f"window={W}", "--peers", "sdpa",
                      "--reps", "1", "--json", str(out))
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["flashgen-paged16-s1", "sdpa", "read-only"]
    assert rows[0]["page_size"] == 16 and rows[0]["kv_heads"] == 1  # --kv-heads default: heads // 4
    assert {r["bytes"] for r in rows} == {B * 1 * 2 * (W + 1) * d * FP32}
    assert all(r["note"] == "" and r["gbps"] > 0 for r in rows)


def test_attended_ranges_hull_over_rows_and_gqa_group():
    op = flashgen.compile(SPECS / "sliding_window.attn")
    lo, hi = bench_decode.attended_ranges(op.spec, 2, 4, 2, 1, 64, {"window": 10})
    assert lo.tolist() == [[54, 54]] * 2 and hi.tolist() == [[64, 64]] * 2
    lo, hi = bench_decode.attended_ranges(op.spec, 2, 4, 2, 3, 64, {"window": 10})
    assert lo.tolist() == [[52, 52]] * 2 and hi.tolist() == [[64, 64]] * 2
    assert bench_decode.kv_bytes(lo, hi, 8, 2) == 2 * 2 * 12 * 2 * 8 * 2
    lo, hi = bench_decode.attended_ranges(op.spec, 1, 4, 4, 1, 8, {"window": 100})  # window beyond the cache
    assert lo.tolist() == [[0] * 4] and hi.tolist() == [[8] * 4]

    per_head = flashgen.compile("attention per_head_window {\n    param w: i32[heads]\n    mask = kv <= q + "
                                "(seqlen_k - seqlen_q) and kv > q + (seqlen_k - seqlen_q) - w[h]\n}\n")
    lo, hi = bench_decode.attended_ranges(per_head.spec, 1, 4, 2, 1, 64, {"w": torch.tensor([4, 8, 12, 16])})
    assert lo.tolist() == [[56, 48]] and hi.tolist() == [[64, 64]]  # kv head j: the widest of its two heads
    k = v = torch.zeros(1, 2, 64, 8)
    fn, nbytes, note = bench_decode.read_only(k, v, lo, hi)
    assert nbytes == 2 * 2 * 16 * 8 * FP32 and "attended ranges differ" in note
    fn()

    doc = flashgen.compile(SPECS / "document.attn")  # no closed-form range: every position is walked
    ids = torch.zeros(2, 32, dtype=torch.int32)
    lo, hi = bench_decode.attended_ranges(doc.spec, 2, 2, 2, 1, 32, {"document_id": ids})
    assert lo.tolist() == [[0, 0]] * 2 and hi.tolist() == [[32, 32]] * 2


@pytest.mark.parametrize("spec, sq, params", [("causal", 1, {}), ("causal", 3, {}),
                                              ("sliding_window", 2, {"window": 5}), ("alibi", 2, None)])
def test_peer_masks_give_the_decode_result(spec, sq, params):
    """SDPA given peer_mask computes what with_kvcache returns: the last Sq rows of the prefill
    attention over the whole sequence."""
    op = flashgen.compile(SPECS / f"{spec}.attn")
    B, Hq, Hkv, L, d = 2, 4, 2, 24, 8
    g = torch.Generator().manual_seed(0)
    q_full = torch.randn(B, Hq, L, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, L, d, generator=g, dtype=torch.float64) for _ in range(2))
    pv = flashgen.params.example_params(op.spec, B, Hq, L, L, "cpu", g, **(params or {}))
    want = reference.attention(op.spec, q_full, k, v, **pv)[:, :, L - sq:]
    q = q_full[:, :, L - sq:]
    mask = bench_decode.peer_mask(op.spec, B, Hq, sq, L, "cpu", torch.float64, pv)
    assert (mask is None) == (spec == "causal" and sq == 1)
    fn, note = bench_decode.sdpa_peer(None, q, k, v, mask)
    assert note == ""
    torch.testing.assert_close(fn(), want, atol=1e-5, rtol=1e-5)  # an additive bias is evaluated in fp32
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), fn())


@pytest.mark.parametrize("argv, message", [
    (["--decode", "--backward"], "--backward: not with --decode (decode calls are inference only)"),
    (["--decode", "--block-mask"], "--block-mask: not with --decode"),
    (["--decode", "--dropout-p", "0.1"], "--dropout-p: not with --decode"),
    (["--decode", "--seqlen", "128"], "--seqlen: not with --decode (the cache lengths are --cache-len)"),
    (["--cache-len", "128"], "--cache-len: applies with --decode only"),
    (["--sq", "2"], "--sq: applies with --decode only"),
    (["--page-size", "16"], "--page-size: applies with --decode only"),
    (["--graphs"], "--graphs: applies with --decode only"),
    (["--decode", "--peers", "eager"], "--peers: 'eager' is a prefill peer, not a decode one (the decode peers on "
                                       "cpu: sdpa)"),
    (["--decode", "--peers", "spda"], "--peers: unknown peer 'spda' (the decode peers on cpu: sdpa); did you mean "
                                      "'sdpa'?"),
    (["--decode", "--peers", "sdpa-cudnn"], "--peers: peer 'sdpa-cudnn' runs on cuda, not cpu"),
    (["--decode", "--heads", "4", "--kv-heads", "3"], "--kv-heads: 3 does not divide 4 query heads (--heads)"),
    (["--decode", "--cache-len", "64", "--page-size", "48"], "--page-size: 48 must be 0 (contiguous) or 1 to 256 "
                                                             "dividing every --cache-len"),
    (["--decode", "--cache-len", "64", "--sq", "65"], "--sq: 65 queries exceed the shortest cache length 64"),
    (["--decode", "--num-splits", "-1"], "--num-splits: -1 is out of range"),
    (["--decode", "--cache-len", "0"], "--cache-len: expected positive values"),
])
def test_decode_option_errors_are_one_line_naming_the_option(capsys, argv, message):
    rc, out, err = cli(capsys, "bench", str(SPECS / "causal.attn"), "--device", "cpu", *argv)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("flashgen: error: ValueError: ") and message in err, err


def test_bench_help_mentions_decode(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for option in ("--decode", "--cache-len", "--kv-heads", "--sq", "--page-size", "--num-splits"):
        assert option in text


def test_graphs_is_a_no_op_on_the_cpu():
    """--graphs captures CUDA graphs; on the CPU the rows are timed as without it (no note)."""
    op = flashgen.compile(SPECS / "causal.attn")
    rows = bench_decode.run(op, [(1, 32, 16)], ir.DType.FP32, torch.device("cpu"), heads=2, kv_heads=1, reps=1,
                            graphs=True, log=lambda s: None)
    assert rows and all(r.ms is not None and r.ms > 0 and "CUDA graph" not in r.note for r in rows)
