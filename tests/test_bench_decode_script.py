"""scripts/bench_decode.py on the CPU family with tiny shapes: --param reaching ours and the peers'
masks, several --sq with the Sq ratio, cache-length time ratios, --mixed next to its uniform batch
(flashgen/bench_decode.py's run_mixed, mixed_lengths, sequence_bytes), the JSON of each, the
output without the new options, and the option errors."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

import flashgen
from flashgen import bench_decode

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
_spec = importlib.util.spec_from_file_location("bench_decode_script", ROOT / "scripts" / "bench_decode.py")
script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = script
_spec.loader.exec_module(script)

FP32 = 4
TINY = ["--device", "cpu", "--dtype", "fp32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--reps", "2"]


def run(tmp_path, capsys, *argv) -> tuple[dict, str]:
    out = tmp_path / "rows.json"
    assert script.main([*TINY, *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_without_new_options_the_json_is_as_before(tmp_path, capsys):
    data, text = run(tmp_path, capsys, "--shapes", "2x64")
    assert data.keys() == {"device", "torch", "rows"}
    assert [r["impl"] for r in data["rows"]] == ["flashgen", "sdpa", "read-only"]
    ours = data["rows"][0]
    assert ours["vs_read_only"] > 0 and "vs_cudnn" in ours and ours["vs_cudnn"] is None
    assert "over Sq" not in text and "mixed" not in text and "time at" not in text


def test_param_sq_list_and_cache_len_ratios(tmp_path, capsys):
    W, d, Hkv = 16, 16, 2
    data, text = run(tmp_path, capsys, "--spec", str(SPECS / "sliding_window.attn"), "--param", f"window={W}",
                     "--shapes", "1x64,1x256", "--sq", "1,4")
    rows = data["rows"]
    assert [(r["impl"], r["seqlen_q"], r["cache_len"]) for r in rows] == [
        (n, sq, L) for sq in (1, 4) for L in (64, 256) for n in ("flashgen", "sdpa", "read-only")]
    for r in rows:  # the window, not the cache: --param reached the byte count and every row ran
        assert r["bytes"] == Hkv * 2 * (W + r["seqlen_q"] - 1) * d * FP32 and r["gbps"] > 0 and r["note"] == "", r
    sq = data["sq_ratios"]
    assert [(r["impl"], r["cache_len"], r["seqlen_q"], r["over_seqlen_q"]) for r in sq] == [
        ("flashgen", 64, 4, 1), ("flashgen", 256, 4, 1)]
    by = {(r["seqlen_q"], r["cache_len"]): r for r in rows if r["impl"] == "flashgen"}
    for r in sq:
        L = r["cache_len"]
        assert r["ratio"] > 0 and math.isclose(r["ratio"], by[4, L]["gbps"] / by[1, L]["gbps"])
    lens = data["cache_len_ratios"]
    assert [(r["seqlen_q"], r["cache_len"], r["over_cache_len"]) for r in lens] == [(1, 256, 64), (4, 256, 64)]
    assert all(math.isclose(r["time_ratio"], by[r["seqlen_q"], 256]["ms"] / by[r["seqlen_q"], 64]["ms"])
               for r in lens)
    assert text.count("Sq 4 over Sq 1 GB/s: flashgen B=1 ") == 2 and text.count("time at L=256 over L=64: ") == 2


def test_peers_that_cannot_express_the_spec_are_left_out_with_a_note(tmp_path, capsys):
    data, _ = run(tmp_path, capsys, "--spec", str(SPECS / "softcap.attn"), "--param", "softcap=30",
                  "--shapes", "1x64")
    ours, sdpa, ro = data["rows"]
    assert ours["gbps"] > 0 and ro["gbps"] > 0 and ours["vs_read_only"] > 0
    assert sdpa["impl"] == "sdpa" and sdpa["ms"] is None and sdpa["note"].startswith("unavailable: score")


def test_mixed_next_to_uniform(tmp_path, capsys):
    B, cap, d, Hkv = 8, 256, 16, 2
    data, text = run(tmp_path, capsys, "--shapes", "1x64", "--mixed", f"{B}:{cap}", "--paged", "0,16", "--sq", "1,2")
    lengths = bench_decode.mixed_lengths(B, cap)
    assert lengths == bench_decode.mixed_lengths(B, cap, 0) and all(1 <= n <= cap for n in lengths)
    uniform = math.floor(sum(lengths) / B + 0.5)
    mixed = data["mixed"]
    assert [m["seqlen_q"] for m in mixed] == [1, 2]
    for m in mixed:
        assert (m["batch"], m["capacity"], m["seed"], m["distribution"]) == (B, cap, 0, "log-uniform")
        assert m["lengths"] == lengths and m["uniform_length"] == uniform
        assert m["ratios"].keys() == {"flashgen", "flashgen-paged16"} and all(x > 0 for x in m["ratios"].values())
    assert mixed[0]["mixed_bytes"] == sum(lengths) * Hkv * 2 * d * FP32  # causal at Sq = 1: every cached key
    assert mixed[0]["uniform_bytes"] == B * uniform * Hkv * 2 * d * FP32
    rows = [r for r in data["rows"] if r["batch"] == B]
    assert [r["impl"] for r in rows] == ["flashgen-mixed", "flashgen-uniform", "flashgen-mixed-paged16",
                                         "flashgen-uniform-paged16"] * 2
    for r in rows:
        assert r["cache_len"] == cap and r["gbps"] > 0 and r["note"].startswith("cache_seqlens "), r
    for m, u in zip(rows[::2], rows[1::2]):
        assert m["vs_uniform"] > 0 and math.isclose(m["vs_uniform"], m["gbps"] / u["gbps"])
        assert mixed[m["seqlen_q"] - 1]["ratios"][m["impl"].replace("-mixed", "")] == m["vs_uniform"]
    assert f"seed 0: min {min(lengths)} " in text and f"cache_seqlens all {uniform}" in text
    assert text.count(f"mixed over uniform GB/s: flashgen B={B} MAX={cap} Sq=1 (log-uniform, seed 0, ") == 1
    assert any(r["impl"] == "flashgen-mixed" and r["seqlen_q"] == 2 for r in data["sq_ratios"])


def test_mixed_lengths_are_log_uniform_and_bytes_follow_each_length():
    lengths = bench_decode.mixed_lengths(4096, 32768)
    assert min(lengths) >= 1 and max(lengths) <= 32768 and lengths != bench_decode.mixed_lengths(4096, 32768, 1)
    median, mean = sorted(lengths)[2048], sum(lengths) / len(lengths)
    assert 120 < median < 240 and 2500 < mean < 3800  # sqrt(32768) = 181; 32767 / ln 32768 = 3151
    op = flashgen.compile(SPECS / "sliding_window.attn")
    nbytes = bench_decode.sequence_bytes(op.spec, [3, 40, 100], 4, 2, 1, {"window": 10}, 8, 2)
    assert nbytes == (3 + 10 + 10) * 2 * 2 * 8 * 2  # each sequence: min(its length, the window)
    assert bench_decode.sequence_bytes(op.spec, [1, 40], 4, 2, 3, {"window": 10}, 8, 2) == (1 + 12) * 2 * 2 * 8 * 2
    with pytest.raises(ValueError, match="mixed: batch 0"):
        bench_decode.mixed_lengths(0, 10)


@pytest.mark.parametrize("argv, message", [
    (["--mixed", "0:10"], "argument --mixed: expected B:MAX with B ≥ 1"),
    (["--mixed", "4"], "argument --mixed: expected B:MAX"),
    (["--mixed", "4:0"], "argument --mixed: expected B:MAX"),
    (["--param", "nosuch=1"], "argument --param nosuch=1: spec 'causal' has no parameter 'nosuch'"),
    (["--param", "window"], "argument --param window: expected NAME=VALUE"),
    (["--sq", "0"], "argument --sq: expected distinct ints ≥ 1, got '0'"),
    (["--sq", "1,x"], "argument --sq: expected comma-separated ints"),
    (["--sq", "1,1"], "argument --sq: expected distinct ints"),
    (["--sq", "65"], "argument --sq: 65 queries exceed the shortest cache length 64"),
    (["--mixed", "2:8", "--sq", "9"], "argument --sq: 9 queries exceed the shortest cache length 8"),
    (["--shapes", "2x"], "argument --shapes: expected BxCACHE"),
    (["--kv-heads", "3"], "argument --kv-heads: 3 does not divide 4 query heads"),
])
def test_bad_values_are_usage_errors_naming_the_option(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        script.main([*TINY, "--shapes", "2x64", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_bad_page_sizes_specs_and_failed_rows_are_reported(tmp_path, capsys):
    """A page size that is out of range or does not divide a cache length is an error naming
    --paged (it used to be skipped silently); --spec takes a name in specs/; a run whose every
    flashgen row failed exits 1."""
    for paged, what in (("0,48", "does not divide the cache length 100"), ("300", "out of range")):
        with pytest.raises(SystemExit) as e:
            script.options(["--device", "cpu", "--shapes", "2x100", "--paged", paged])
        assert e.value.code == 2 and what in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.options(["--device", "cpu", "--spec", "nosuch"])
    assert "no spec of that name in specs/" in capsys.readouterr().err
    assert script.options(["--device", "cpu", "--spec", "alibi"]).op.spec.name == "alibi"
    assert script.main(["--device", "cpu", "--shapes", "1x64", "--head-dim", "7", "--reps", "1",
                              "--dtype", "fp32"]) == 1
