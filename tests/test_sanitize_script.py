"""scripts/sanitize.py without a GPU: its options, the calls it makes of each spec (run here on
the CPU family, so a call built wrong fails here rather than inside a sanitizer on the GPU), the
skip path of a family that does not serve a call, the log parser and the summary it writes."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import flashgen

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sanitize_script", ROOT / "scripts" / "sanitize.py")
sanitize = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sanitize  # dataclasses look their module up there
_spec.loader.exec_module(sanitize)

KINDS = ["forward d64 1x2/2x128x128", "forward d64 2x4/2x77x200", "forward d128 1x2/2x128x128",
         "forward d128 2x4/2x77x200", "packed forward d128", "block-sparse forward d128", "backward d128",
         "backward GQA 4/2 d128", "deterministic backward d128", "packed backward d128",
         "block-sparse backward d128"]
DROPOUT = ["dropout 0.1 forward d128", "dropout 0.1 backward d128"]
DECODE = ["decode contiguous cache d128", "decode paged cache d128"]


def test_help_runs_without_a_gpu():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sanitize.py"), "--help"], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "memcheck,racecheck,initcheck,synccheck" in " ".join(res.stdout.split())


def test_options():
    a, fams, tools, specs = sanitize.options([])
    assert fams == ["sm90", "sm80"] and tools == ["memcheck", "racecheck", "initcheck", "synccheck"] and specs is None
    _, fams, tools, specs = sanitize.options(["--family", "sm80", "--tools", "racecheck", "--specs", "causal,dense"])
    assert fams == ["sm80"] and tools == ["racecheck"] and specs == ["causal", "dense"]


@pytest.mark.parametrize("argv, message", [
    (["--family", "cpu"], "--family: cpu runs on cpu"),
    (["--family", "sm70"], "unknown family 'sm70'; compute-sanitizer checks CUDA families"),
    (["--tools", "memcheck,leakcheck"], "--tools: unknown tool(s) 'leakcheck'"),
    (["--specs", "causl"], "--specs: no spec 'causl' in specs/"),
    (["--jobs", "0"], "--jobs: 0 is out of range"),
])
def test_bad_options_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        sanitize.options(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_calls_of_each_spec():
    for path in sanitize.spec_paths():
        op = flashgen.compile(path)
        labels = [c.label for c in sanitize.calls_for(op)]
        want = KINDS + (DROPOUT if op.spec.dropout else []) + DECODE
        assert labels == [f"{op.spec.name} {w}" for w in want]
    assert [p.stem for p in sanitize.spec_paths(["dropout", "causal"])] == ["causal", "dropout"]


def test_list_needs_no_gpu(capsys):
    assert sanitize.main(["--list", "--specs", "dropout"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"dropout {w}" for w in KINDS + DROPOUT + DECODE]


@pytest.mark.parametrize("name", ["causal", "dropout"])
def test_every_call_runs_on_the_cpu_family(name):
    """The same calls the sanitized workers make, on CPU tensors (fp32): none may fail or be
    skipped where the family serves everything."""
    op = flashgen.compile(ROOT / "specs" / f"{name}.attn")
    records = sanitize.run_calls(sanitize.calls_for(op, "cpu", torch.float32), "cpu", "cpu")
    assert [r["status"] for r in records] == ["ran"] * len(records) and len(records) == 13 + 2 * op.spec.dropout


def test_a_call_the_forced_family_does_not_serve_is_skipped_with_its_reason():
    op = flashgen.compile(ROOT / "specs" / "causal.attn")
    said = []
    records = sanitize.run_calls(sanitize.calls_for(op, "cpu", torch.float32)[:1], "sm80", "cpu", log=said.append)
    assert records[0]["status"] == "skipped" and "runs on cuda tensors, not cpu" in records[0]["reason"]
    assert said and said[0].startswith("skip causal forward d64")


def test_other_errors_are_not_skips():
    def wrong():
        raise ValueError("q: bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        sanitize.run_calls([sanitize.Call("causal", "wrong", wrong)], None, "cpu")


CLEAN = {
    "memcheck": "========= COMPUTE-SANITIZER\nsanitize worker: 3 calls ran\n========= ERROR SUMMARY: 0 errors\n",
    "racecheck": "========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
}
DIRTY = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at void flashgen::fwd_kernel<Variant>(FgFwdArgs)+0x1a30
=========     by thread (5,0,0) in block (1,0,0)
=========     Address 0x7f3a00001000 is out of bounds
========= Invalid __global__ read of size 16 bytes
=========     at void flashgen::fwd_kernel<Variant>(FgFwdArgs)+0x1a30
=========     by thread (6,0,0) in block (1,0,0)
=========     Address 0x7f3a00001010 is out of bounds
========= ERROR SUMMARY: 2 errors
"""


def test_parse_log():
    assert sanitize.parse_log(CLEAN["memcheck"]) == {"errors": 0, "warnings": 0, "summary": "ERROR SUMMARY: 0 errors",
                                                     "reports": []}
    assert sanitize.parse_log(CLEAN["racecheck"])["errors"] == 0
    got = sanitize.parse_log(DIRTY)
    assert got["errors"] == 2
    assert got["reports"] == ["Invalid __global__ read of size 16 bytes at void flashgen::fwd_kernel<Variant>(FgFwdArgs)"]
    assert sanitize.parse_log("Traceback ...\n")["errors"] is None


def test_parse_log_counts_past_the_print_limit_and_racecheck_warnings():
    # Past --print-limit the tool adds a second summary line for the reports it left out: the
    # total is the first line's count, not their sum.
    got = sanitize.parse_log(DIRTY.replace("ERROR SUMMARY: 2 errors", "ERROR SUMMARY: 5000 errors\n"
                                           "========= ERROR SUMMARY: 3000 errors were not printed. Use "
                                           "--print-limit option to adjust the number of printed errors"))
    assert (got["errors"], got["summary"]) == (5000, "ERROR SUMMARY: 5000 errors")
    # racecheck's intra-warp hazards are warnings: counted apart from its errors, both reports.
    race = ("========= Warning: Race reported between Read access at void flashgen::cuda::fwd_kernel<V>(P)+0x3ae0\n"
            "=========     and Write access at void flashgen::cuda::fwd_kernel<V>(P)+0xb360 [372 hazards]\n"
            "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n")
    got = sanitize.parse_log(race)
    assert (got["errors"], got["warnings"]) == (0, 1)
    assert got["reports"] == ["Warning: Race reported between Read access at void flashgen::cuda::fwd_kernel<V>(P)+0x…"]
    assert sanitize.parse_log(race.replace("(0 errors, 1 warning)", "(2 errors, 7 warnings)"))["warnings"] == 7


def test_tool_env():
    base = {"PATH": "/bin", "FLASHGEN_SM90_TMA_STORE": "1"}
    assert sanitize.tool_env("sm80", "racecheck", base) == base
    assert sanitize.tool_env("sm80", "initcheck", base) == base | {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    # initcheck does not see TMA stores: on sm90 it runs the forward's direct-store epilogue
    assert sanitize.tool_env("sm90", "initcheck", base) == {"PATH": "/bin", "FLASHGEN_SM90_TMA_STORE": "0",
                                                            "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    assert sanitize.tool_env("sm90", "memcheck", base)["FLASHGEN_SM90_TMA_STORE"] == "1"
    assert base == {"PATH": "/bin", "FLASHGEN_SM90_TMA_STORE": "1"}  # not modified


def test_sanitize_command():
    cmd = sanitize.sanitize_cmd("/cuda/bin/compute-sanitizer", "racecheck", "sm90", ["causal"], Path("/tmp/r.json"))
    assert cmd[:6] == ["/cuda/bin/compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1",
                       "--racecheck-report"]
    assert cmd[-7:] == ["--worker", "--family", "sm90", "--record", "/tmp/r.json", "--specs", "causal"]
    assert "--racecheck-report" not in sanitize.sanitize_cmd("cs", "memcheck", "sm80", None, Path("r"))


def test_summary_of_a_run(monkeypatch, tmp_path):
    """main() end to end with the GPU, the builds and the processes faked: on an sm_80 GPU the sm90
    family is skipped with its reason, each tool of sm80 runs once with its allocator setting,
    and summary.json has per family and tool the error count and the skipped calls."""
    from flashgen.build import artifact

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake A100")
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: "sm_80")
    monkeypatch.setattr(sanitize, "prebuild", lambda specs: 1.0)
    monkeypatch.setattr(sanitize, "sanitizer", lambda: "/cuda/bin/compute-sanitizer")
    ran = []
    skip = {"call": "causal decode paged cache d128", "status": "skipped", "reason": "family sm80 ... decode"}

    def run(cmd, env=None, **kw):
        record = Path(cmd[cmd.index("--record") + 1])
        record.write_text(json.dumps([{"call": "causal forward d64", "status": "ran", "seconds": 0.1}, skip]))
        tool = cmd[cmd.index("--tool") + 1] if "--tool" in cmd else None
        ran.append((tool, (env or {}).get("PYTORCH_NO_CUDA_MEMORY_CACHING")))
        text = "========= ERROR SUMMARY: 1 error\n" if tool == "synccheck" else "========= ERROR SUMMARY: 0 errors\n"
        return types.SimpleNamespace(returncode=1 if tool == "synccheck" else 0, stdout=text, stderr="")

    monkeypatch.setattr(sanitize.subprocess, "run", run)
    assert sanitize.main(["--family", "all", "--specs", "causal", "--out", str(tmp_path)]) == 1  # synccheck's error
    assert sorted(ran, key=str) == sorted([(None, None), ("memcheck", "1"), ("racecheck", None), ("initcheck", "1"),
                                           ("synccheck", None)], key=str)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["families"]["sm90"]["skipped"].startswith("sm90 needs compute capability 9.0")
    tools = summary["families"]["sm80"]["tools"]
    assert {t: r["errors"] for t, r in tools.items()} == {"memcheck": 0, "racecheck": 0, "initcheck": 0, "synccheck": 1}
    assert all(r["skipped"] == [skip] and r["ran"] == 1 for r in tools.values())
    assert summary["ok"] is False and (tmp_path / "sm80-memcheck.log").exists()
