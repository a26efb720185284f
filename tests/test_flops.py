"""flashgen.flops: one FLOP counter, and every place that reports FLOPs counts through it."""

import ast
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import bench, cli, flops, reference
from flashgen import explain as ex
from flashgen.lang import ir
from flashgen.tune import timing

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def test_convention():
    assert flops.attention_flops(10, 64) == 4 * 64 * 10
    assert flops.attention_flops(10, 64, "bwd") == 10 * 64 * 10  # 2.5x
    assert flops.attention_flops(10, 64, "fwd+bwd") == 14 * 64 * 10  # 3.5x
    assert isinstance(flops.attention_flops(3, 8, "bwd"), int)
    with pytest.raises(ValueError, match="^kind:"):
        flops.attention_flops(1, 8, "backward")
    spec = flashgen.compile(SPECS / "causal.attn").spec
    assert flops.call_flops(spec, 10, 10, 16, batch=2, heads=3) == 4 * 16 * 2 * 3 * 55


@pytest.fixture
def marked(monkeypatch):
    """attention_flops made to return a recognisable number (and record its calls)."""
    calls = []

    def fake(pairs, head_dim, kind="fwd"):
        calls.append((pairs, head_dim, kind))
        return 1e12 + (1 if kind == "bwd" else 0)

    monkeypatch.setattr(flops, "attention_flops", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return calls


def test_explain_counts_through_it(marked):
    rep = ex.explain(SPECS / "causal.attn", 64, head_dim=32, batch=2, heads=3, arch="sm_80", backward=True)
    assert rep.fwd.flops == 1e12 and rep.bwd.flops == 1e12 + 1
    assert (2 * 3 * 64 * 65 // 2, 32, "fwd") in marked


class _ReferenceOp:
    """Stands in for a compiled op: the reference's output (no kernel build)."""

    def __init__(self, path):
        self.spec = flashgen.compile(path).spec
        self.name = self.spec.name

    def __call__(self, q, k, v, return_lse=False, dropout_p=0.0, **params):
        return reference.attention(self.spec, q, k, v, return_lse=return_lse, **params)


def test_bench_counts_through_it(marked):
    rows = bench.run(_ReferenceOp(SPECS / "causal.attn"), [(1, 2, 32, 16)], ir.DType.FP32, torch.device("cpu"),
                     reps=1, include={"flashgen"}, log=lambda s: None)
    row = next(r for r in rows if r.impl == "flashgen")
    assert row.tflops == pytest.approx(1e12 / row.ms / 1e9)
    assert marked[-1][2] == "fwd"


def test_cli_run_counts_through_it(marked, monkeypatch, capsys):
    monkeypatch.setattr(flashgen.ops, "compile", _ReferenceOp)
    cli.main(["run", str(SPECS / "causal.attn"), "--batch", "1", "--heads", "2", "--seqlen", "32", "--head-dim",
              "16", "--dtype", "fp32", "--device", "cpu", "--reps", "1"])
    out = capsys.readouterr().out
    ms = float(out.split("time: ")[1].split(" ms")[0])
    tflops = float(out.split("(")[-1].split(" TFLOP/s")[0])
    assert tflops == pytest.approx(1e12 / ms / 1e9, rel=0.01)
    assert marked[-1][1:] == (16, "fwd")


def test_tune_counts_through_it():
    # The tuner's workloads need a GPU to build; check its source instead: its one FLOP count is
    # a call of flashgen.flops.attention_flops, and no other FLOP formula is left in it.
    tree = ast.parse(inspect.getsource(timing))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "attention_flops"]
    assert len(calls) == 1 and ast.unparse(calls[0].func.value) == "flop_count"
    assert "from .. import flops as flop_count" in inspect.getsource(timing)
    assert not re.search(r"\b4(\.0)? \* B \* H \* d\b", inspect.getsource(timing))


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scripts_count_through_it(marked):
    sparsity = _script("bench_sparsity")
    assert sparsity.tflops(100, 1.0, "fwd+bwd") == pytest.approx(1e12 / 1e-3 / 1e12)
    assert marked[-1] == (sparsity.B * sparsity.H * 100, sparsity.D, "fwd+bwd")
    varlen = _script("bench_varlen")
    spec = flashgen.compile(SPECS / "causal.attn").spec
    assert varlen.workload_flops(spec, [3, 4, 3], 2, 16, "fwd") == 1e12
    assert marked[-1] == (2 * (6 + 6 + 10), 16, "fwd")
