"""The end-to-end scripts (scripts/e2e_gpt2.py, scripts/e2e_gemma2.py) in their --smoke mode:
tiny models on the CPU, a few steps, uncompiled (and GPT-2's compiled by dynamo alone); they run,
every measurement completes, the flashgen runs take flashgen's kernels (no fallback), and the JSON
and plots are written. The figures themselves measure nothing here; the GPU runs are not tested."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from flashgen.integrations import transformers as fg_hf

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _threads():
    """--smoke sets one torch thread; the test leaves the process as it found it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def check_environment(report: dict) -> None:
    env = report["environment"]
    assert report["smoke"] is True
    assert env["torch"] == torch.__version__ and env["transformers"] and env["device"] == "cpu"
    assert env["gpu"] is None  # never claims a GPU it did not use


def test_gpt2_smoke(tmp_path):
    mod = load("e2e_gpt2")
    rc = mod.main(["--smoke", "--out", str(tmp_path), "--data-cache", str(tmp_path / "data"), "--seqlens", "32",
                   "--curve", "fgen:0,sdpa:0,sdpa:1"])
    assert rc == 0
    report = json.loads((tmp_path / "gpt2-smoke.json").read_text())
    check_environment(report)
    assert report["corpus"]["tokenizer"] == "bytes" and report["corpus"]["vocab"] == 257
    runs = {(r["impl"], r["seed"]): r for r in report["runs"]}
    assert set(runs) == {("fgen", 0), ("sdpa", 0), ("sdpa", 1), ("eager", 0)}
    for r in runs.values():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and not r["compiled"], r
    assert set(runs["fgen", 0]["fgen_calls"]) <= set(fg_hf.SPECS)  # flashgen's kernels, no fallback
    for key in (("fgen", 0), ("sdpa", 0), ("sdpa", 1)):  # the loss curves: every step's loss
        assert runs[key]["curve"] and len(runs[key]["losses"]) == report["settings"]["curve_steps"]
    assert runs["fgen", 0]["losses"][0] == pytest.approx(runs["sdpa", 0]["losses"][0], rel=1e-4)  # same init, data
    for png in ("tokens", "loss"):
        assert (tmp_path / f"gpt2-smoke-{png}.png").stat().st_size > 0
    # --replot: the table and plots again from the JSON alone, into another folder
    again = tmp_path / "again"
    assert mod.main(["--out", str(again), "--replot", str(tmp_path / "gpt2-smoke.json")]) == 0
    assert json.loads((again / "gpt2-smoke.json").read_text()) == report
    for png in ("tokens", "loss"):
        assert (again / f"gpt2-smoke-{png}.png").stat().st_size > 0
    assert mod.main(["--out", str(again), "--replot", str(tmp_path / "missing.json")]) == 2


def test_gpt2_compiled_smoke(tmp_path):
    """--smoke with compiled runs (dynamo only: --compile-backend eager): flashgen's timed steps
    recompile nothing (the status would say "recompiled inside the timed steps"), without a
    fallback warning, and flashgen adds no graph break to those SDPA's run has (transformers' own);
    compiled attention calls are not counted in fgen_calls."""
    mod = load("e2e_gpt2")
    rc = mod.main(["--smoke", "--out", str(tmp_path), "--data-cache", str(tmp_path / "data"), "--seqlens", "32",
                   "--runs", "fgen,sdpa", "--curve", "none", "--steps", "6", "--warmup", "2",
                   "--compile-backend", "eager", "--profile-steps", "1"])
    assert rc == 0
    runs = {r["impl"]: r for r in json.loads((tmp_path / "gpt2-smoke.json").read_text())["runs"]}
    for r in runs.values():
        assert r["compiled"] and r["status"] == "ok" and r["tokens_per_s"] > 0 and "warnings" not in r, r
        # --profile-steps: the top entries by time (on the CPU, host operators) and their total
        prof = r["profile"]
        total = next(x for x in prof if x["name"] == "(all kernels)")
        top = [x for x in prof if not x["name"].startswith("(")]
        assert top and all(x["ms_per_step"] > 0 for x in top) and total["ms_per_step"] >= top[0]["ms_per_step"]
    # ... and the host time inside each flashgen op (fgen's run only)
    host = [x for x in runs["fgen"]["profile"] if x["name"].startswith("(host) flashgen::")]
    assert host and all(x["ms_per_step"] > 0 and x["calls_per_step"] > 0 for x in host), runs["fgen"]["profile"]
    assert not [x for x in runs["sdpa"]["profile"] if x["name"].startswith("(host) flashgen::")]
    assert runs["fgen"]["graph_breaks"] <= runs["sdpa"]["graph_breaks"], runs
    # no attention call counted; only the packed-sequence block classification, which runs at run
    # time: with dynamo alone (no AOTAutograd, so no common-subexpression pass) once per layer and
    # step, its lists reused by the layer's backward (2 layers, 2 warm-up + 6 timed steps)
    assert runs["fgen"]["fgen_calls"] == {"block_lists:transformers_packed": 16}, runs["fgen"]["fgen_calls"]


def test_gemma2_smoke(tmp_path):
    mod = load("e2e_gemma2")
    rc = mod.main(["--smoke", "--out", str(tmp_path), "--train-seqlens", "16", "--gen-batches", "2"])
    assert rc == 0
    report = json.loads((tmp_path / "gemma2-smoke.json").read_text())
    check_environment(report)
    assert {r["impl"] for r in report["train"]} == {r["impl"] for r in report["generate"]} == {"fgen", "eager", "sdpa"}
    for part in ("train", "generate"):
        for r in report[part]:
            assert r["status"] == "ok" and r["tokens_per_s"] > 0, r
            if r["impl"] == "fgen" and part == "train":
                assert set(r["fgen_calls"]) == {"transformers"}  # softcap: the general spec, no fallback
            elif r["impl"] == "fgen":  # decoding steps only (no prefill), each on op.with_kvcache
                calls = r["fgen_calls"]
                assert set(calls) == {"transformers", "kvcache:transformers"}, calls
                assert calls["kvcache:transformers"] == calls["transformers"] > 0, calls
    for r in report["train"] + report["generate"]:
        if r["impl"] == "sdpa":
            assert "different math" in r["label"]
    gen = {r["impl"]: r for r in report["generate"]}
    assert gen["fgen"]["tokens_row0"] == gen["eager"]["tokens_row0"]  # fp32, the same filled cache
    for png in ("train", "generate"):
        assert (tmp_path / f"gemma2-smoke-{png}.png").stat().st_size > 0
    again = tmp_path / "again"
    assert mod.main(["--out", str(again), "--replot", str(tmp_path / "gemma2-smoke.json")]) == 0
    assert (again / "gemma2-smoke-train.png").stat().st_size > 0


@pytest.mark.parametrize("script,argv,needle", [
    ("e2e_gpt2", ["--runs", "fgen,bogus"], "--runs"),
    ("e2e_gpt2", ["--seqlens", "32,x"], "--seqlens"),
    ("e2e_gemma2", ["--impls", "fgen,bogus"], "--impls"),
    ("e2e_gemma2", ["--part", "prefill"], "--part"),
])
def test_bad_arguments_are_named(tmp_path, script, argv, needle):
    with pytest.raises(SystemExit, match=needle):
        load(script).main(["--smoke", "--out", str(tmp_path), *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_no_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--device cuda: CUDA is not available"):
        load("e2e_gemma2").main(["--out", str(tmp_path), "--device", "cuda"])


def test_gpt2_loss_band():
    """loss_band: steps inside the SDPA seeds' band, the excursions of the others, the
    same-seed difference and the seeds' spread, on hand-made curves; None without two SDPA
    curves and one fgen curve."""
    band = load("e2e_gpt2").loss_band

    def run(impl, seed, losses):
        return {"impl": impl, "seed": seed, "curve": True, "losses": losses, "val_loss": losses[-1]}

    report = {"runs": [run("fgen", 0, [3.0, 2.5, 2.0, 1.9]), run("sdpa", 0, [3.0, 2.4, 2.1, 1.8]),
                       run("sdpa", 1, [3.2, 2.6, 2.2, 1.85]),
                       {"impl": "fgen", "seed": 0, "curve": False, "losses": [9.0]}]}
    b = band(report)
    assert b["steps"] == 4 and b["sdpa_seeds"] == [0, 1]
    assert b["inside"] == 2  # steps 1 (3.0 in [3.0, 3.2]) and 2 (2.5 in [2.4, 2.6])
    assert b["excursion_max"] == pytest.approx(0.1)  # step 3: 2.0 below 2.1
    assert b["same_seed_max"] == pytest.approx(0.1)
    assert b["seed_spread_max"] == pytest.approx(0.2)
    assert b["val_loss"] == {"fgen:0": 1.9, "sdpa:0": 1.8, "sdpa:1": 1.85}
    assert band({"runs": report["runs"][:2]}) is None
