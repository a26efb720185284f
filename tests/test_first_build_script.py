"""scripts/first_build.py on the CPU: option errors in one line, and one run whose cached process
builds nothing (the script's purpose on a GPU machine: first build and cached load)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("first_build_script", ROOT / "scripts" / "first_build.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


@pytest.mark.parametrize("argv, message", [
    (["--spec", "nope"], "--spec: no spec named 'nope'"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--device", "cpu", "--seqlen", "0"], "--seqlen: expected >= 1"),
    (["--device", "cpu", "--head-dim", "7"], "--head-dim: 7 is not a head dim"),
    (["--device", "cpu", "--json", "/nonexistent-dir/x.json"], "--json: no folder"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cpu_run_reports_a_cached_load_that_builds_nothing(tmp_path):
    out = tmp_path / "fb.json"
    assert script.main(["--device", "cpu", "--head-dim", "16", "--seqlen", "32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    for r in rows:
        assert r["family"] == "cpu" and r["finite"] and r["first_s"] > 0 and r["cached_s"] > 0
        assert r["built_first"] and r["built_cached"] == []


def test_cpu_run_of_a_spec_with_parameters(tmp_path):
    """Parameters are drawn as flashgen.params.example_params draws them (the child used to call
    the op without them: a TypeError for every spec with parameters)."""
    out = tmp_path / "fb.json"
    assert script.main(["--device", "cpu", "--spec", "sliding_window", "--head-dim", "16", "--seqlen", "32",
                        "--json", str(out)]) == 0
    assert all(r["finite"] for r in json.loads(out.read_text())["rows"])
