"""Load and soak (scripts/soak.py, issue 22 item 5), in CI's short form on the CPU: processes
compiling the same specs on one fresh cache at once, threads calling one op at once, and a soak
of calls with random shapes, layouts and block masks whose memory must not grow; every output
(every n-th in the soak) checked against the float64 reference. The full runs (8 processes x 4
specs, 16 threads, 10,000 calls) and their figures are in docs/reliability.md."""

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_processes_compiling_the_same_specs_at_once(soak, capsys):
    assert soak.main(["load", "--procs", "3", "--specs", "causal", "--dtypes", "fp32"]) == 0
    assert "3 processes x 1 specs" in capsys.readouterr().out


def test_threads_calling_one_op_at_once(soak, capsys):
    assert soak.main(["threads", "--threads", "8", "--calls", "3", "--dtypes", "fp32"]) == 0
    assert "8 threads x 3 checked calls" in capsys.readouterr().out


def test_soak_memory_does_not_grow(soak, capsys):
    assert soak.main(["soak", "--calls", "600", "--check-every", "40", "--specs", "dense,causal",
                      "--dtypes", "fp32", "--max-growth", "2"]) == 0
    out = capsys.readouterr().out
    assert "soak: 600 calls (15 checked)" in out and out.rstrip().endswith("ok")


def test_a_wrong_result_fails_the_check(soak, monkeypatch):
    """The check can fail: a kernel output perturbed after the call is reported."""
    import torch

    import flashgen

    op = flashgen.compile(ROOT / "specs" / "causal.attn")
    real = type(op).__call__

    def wrong(self, *args, **kw):
        out, lse = real(self, *args, **kw)
        return out + 0.5, lse

    monkeypatch.setattr(type(op), "__call__", wrong)
    with pytest.raises(AssertionError, match="causal padded"):
        soak.checked_call(op, random.Random(0), "cpu", dtypes="fp32")
    assert torch.is_grad_enabled()


def test_launch_plans_are_bounded():
    """Eager calls of ever new shapes keep at most caches.LIMIT entries in each per-call cache
    (launch plans, validated inputs, CPU tile decisions), the newest."""
    import torch

    import flashgen
    from flashgen.caches import LIMIT, Bounded

    op = flashgen.compile(ROOT / "specs" / "causal.attn")
    op.plans.clear()
    for n in range(1, LIMIT + 41):
        q = torch.randn(1, 1, n, 8)
        op(q, q, q)
    assert len(op.plans) == LIMIT and len(op.checked_inputs) <= LIMIT
    assert any(key[0] == torch.Size([1, 1, LIMIT + 40, 8]) for key in op.plans)
    assert next(iter(op.plans))[0] == torch.Size([1, 1, 41, 8])  # the oldest went first
    b = Bounded(2)
    b.add(1), b.add(2), b.add(3)
    assert list(b) == [2, 3] and 1 not in b


@pytest.mark.parametrize("args, message", [
    (["soak", "--specs", "nosuch"], "--specs: no spec 'nosuch'"), (["soak", "--calls", "0"], "--calls: expected"),
    (["soak", "--dtypes", "fp64"], "--dtypes: unknown dtype 'fp64'"), (["load", "--procs", "0"], "--procs: expected"),
    (["threads", "--specs", "causal,dense"], "--specs: the threads phase calls one op"),
    (["soak", "--device", "nosuch"], "--device: expected cpu or cuda"),
])
def test_bad_options_are_one_line_errors(soak, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        soak.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
