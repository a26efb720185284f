"""scripts/ab_paged_decode.py on the CPU family with tiny shapes (the arms' switches are the sm80
decode launcher's; the CPU kernels ignore them, so every arm's result is the old arm's): the JSON
it writes to --out, the rounds per arm, the equality checks, and the environment it leaves."""

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ab_paged_decode_script", ROOT / "scripts" / "ab_paged_decode.py")
script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = script
_spec.loader.exec_module(script)


def test_json_rounds_and_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(script.ROWS, "1")
    monkeypatch.delenv(script.ORDER, raising=False)
    out = tmp_path / "sub" / "ab.json"
    argv = ["--device", "cpu", "--dtype", "fp32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--shapes", "2x64,1x80", "--paged", "16,32", "--rounds", "5", "--reps", "2", "--out", str(out)]
    assert script.main(argv) == 0
    data = json.loads(out.read_text())
    assert data.keys() == {"device", "torch", "config", "arms", "checks", "rows", "summary"}
    assert list(data["arms"]) == ["old", "rows", "heads", "new"]
    # 2x64: contiguous, pages of 16 and 32; 1x80: 32 does not divide 80 (skipped)
    cases = [(2, 64, 0), (2, 64, 16), (2, 64, 32), (1, 80, 0), (1, 80, 16)]
    assert [(s["batch"], s["cache_len"], s["page_size"]) for s in data["summary"]] == cases
    assert len(data["checks"]) == len(data["rows"]) == 4 * len(cases)
    assert all(c["equal_old"] and c["equal_contiguous"] for c in data["checks"])
    for r in data["rows"]:
        assert len(r["ms"]) == 5 and r["gbps"] > 0 and r["bytes"] == 2 * r["batch"] * 2 * r["cache_len"] * 16 * 4
    s = data["summary"][1]
    assert s["new_over_old"] == s["gbps"]["new"] / s["gbps"]["old"]
    assert s["over_contiguous"]["old"] == s["gbps"]["old"] / data["summary"][0]["gbps"]["old"]
    assert "does not divide" in capsys.readouterr().out
    assert os.environ[script.ROWS] == "1" and script.ORDER not in os.environ  # restored


def test_arm_env_sets_and_clears_the_switches(monkeypatch):
    monkeypatch.setenv(script.ORDER, "1")
    with script.arm_env("old"):
        assert os.environ[script.ROWS] == "0" and os.environ[script.ORDER] == "0"
    with script.arm_env("new"):
        assert script.ROWS not in os.environ and script.ORDER not in os.environ
    assert os.environ[script.ORDER] == "1"
