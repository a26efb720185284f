"""scripts/trace_kernels.py on the CPU: option errors in one line, and a traced prefill (forward
and backward, with and without a block mask, next to SDPA) and decode whose tables name the
flashgen operators that ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trace_kernels_script", ROOT / "scripts" / "trace_kernels.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


@pytest.mark.parametrize("argv, message", [
    (["--spec", "nope", "--device", "cpu"], "--spec: no spec named 'nope'"),
    (["--impls", "flashgen,bogus", "--device", "cpu"], "--impls: unknown implementation 'bogus'"),
    (["--decode", "4x0", "--device", "cpu"], "--decode: expected BxL"),
    (["--heads", "6", "--kv-heads", "4", "--device", "cpu"], "--kv-heads: 4 does not divide 6"),
    (["--steps", "0", "--device", "cpu"], "--steps: expected >= 1"),
    (["--spec", "sliding_window", "--param", "nope=3", "--device", "cpu"], "has no parameter 'nope'"),
    (["--device", "3"], "--device: expected cpu or cuda[:N], got '3'"),
    (["--device", "meta"], "--device: expected cpu or cuda[:N], got 'meta'"),
    (["--device", "cpu", "--head-dim", "7"], "--head-dim: 7 is not a head dim of spec 'causal' on cpu"),
    (["--device", "cpu", "--impls", ","], "--impls: expected at least one"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_prefill_trace_names_the_forward_and_backward_operators(capsys):
    assert script.main(["--device", "cpu", "--spec", "causal", "--seqlen", "64", "--head-dim", "16",
                        "--backward", "--impls", "flashgen,flashgen-bm,sdpa,flex", "--steps", "1",
                        "--warmup", "1", "--rows", "40"]) == 0
    out = capsys.readouterr().out
    sections = {line.split(":")[0].removeprefix("=== "): line for line in out.splitlines() if line.startswith("=== ")}
    assert set(sections) == {"flashgen", "flashgen-bm", "sdpa", "flex"}
    assert "skipped (not available here)" in sections["flex"]  # no FlexAttention on the CPU
    assert "median" in sections["flashgen"] and "median" in sections["flashgen-bm"]
    ours = out.split("=== flashgen:")[1].split("=== flashgen-bm")[0]
    assert "flashgen::causal_" in ours and "_bwd" in ours  # the forward op and the backward op ran, traced
    theirs = out.split("=== sdpa:")[1].split("=== flex")[0]
    assert "flashgen::" not in theirs and "scaled_dot_product" in theirs


def test_a_refused_parameter_value_is_a_one_line_error(tmp_path, capsys):
    spec = tmp_path / "chunks.attn"
    spec.write_text("attention chunks {\n    param n: int\n    mask = chunked(n)\n}\n")
    assert script.main(["--device", "cpu", "--spec", str(spec), "--seqlen", "32", "--head-dim", "16",
                        "--param", "n=0", "--impls", "flashgen", "--steps", "1", "--warmup", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trace_kernels.py: error: n: 0"), err


def test_decode_of_a_spec_with_query_positions_in_a_parameter(capsys):
    """A parameter with a seqlen_q dim (bias[b, h, q, kv]) is sized for positions up to the
    capacity, as with_kvcache takes it."""
    assert script.main(["--device", "cpu", "--spec", "bias", "--decode", "1x16", "--head-dim", "16", "--heads",
                        "4", "--kv-heads", "2", "--steps", "1", "--warmup", "0", "--rows", "40"]) == 0
    assert "flashgen::bias_" in capsys.readouterr().out


def test_decode_trace_names_the_kvcache_operator(capsys):
    assert script.main(["--device", "cpu", "--spec", "sliding_window", "--decode", "1x64,2x128", "--param",
                        "window=32", "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--steps", "1",
                        "--warmup", "0", "--rows", "40"]) == 0
    out = capsys.readouterr().out
    assert "=== with_kvcache B=1 L=64" in out and "=== with_kvcache B=2 L=128" in out
    for section in out.split("=== with_kvcache")[1:]:
        assert "flashgen::sliding_window_" in section and "_kvcache" in section
