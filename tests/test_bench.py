"""flashgen bench --block-mask: row flashgen-bm, our op given the spec's own block mask built once
per shape outside the timing (as FlexAttention's), next to the per-call row flashgen."""

import json
import math
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import bench, reference
from flashgen.cli import main
from flashgen.lang import ir

SPECS = Path(__file__).resolve().parent.parent / "specs"
CPU = torch.device("cpu")


@pytest.fixture
def built_masks(monkeypatch):
    """Records every block mask bench.run builds, with the arguments it was built from."""
    made = []
    real = bench.block_masks.block_mask

    def recording(op, *args, **kwargs):
        bm = real(op, *args, **kwargs)
        made.append((bm, args, kwargs))
        return bm

    monkeypatch.setattr(bench.block_masks, "block_mask", recording)
    return made


@pytest.mark.parametrize("spec, params", [("sliding_window", {"window": 64}), ("document", None)])
def test_block_mask_row_is_the_spec_own_mask(built_masks, spec, params):
    op = flashgen.compile(SPECS / f"{spec}.attn")
    B, H, N, d = 2, 2, 384, 16
    rows = bench.run(op, [(B, H, N, d)], ir.DType.FP32, CPU, reps=1, include={"flashgen"}, params=params,
                     block_mask=True, log=lambda s: None)
    assert [r.impl for r in rows] == ["flashgen", "flashgen-bm"]
    bm_row = rows[1]
    assert bm_row.note == "" and math.isfinite(bm_row.ms) and bm_row.ms > 0 and bm_row.tflops > 0
    assert bm_row.as_dict()["impl"] == "flashgen-bm" and bench.format_row(bm_row).startswith("flashgen-bm ")
    assert len(built_masks) == 1  # once per shape, not per call
    bm, args, kwargs = built_masks[0]
    assert args == (N, N) and kwargs["batch"] == B and kwargs["heads"] == H and kwargs["block_size"] == 128
    assert bm.density() < 1  # some blocks skipped: the comparison below is not a dense one
    pv = {k: v for k, v in kwargs.items() if k not in ("batch", "heads", "block_size", "device")}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))
    with torch.no_grad():
        plain = op(q, k, v, **pv)
        given = op(q, k, v, block_mask=bm, **pv)
    torch.testing.assert_close(given, plain)
    torch.testing.assert_close(given.double(), reference.attention(op.spec, q.double(), k.double(), v.double(), **pv),
                               atol=1e-4, rtol=1e-4, check_dtype=False)


class _ReferenceOp:
    """Stands in for a compiled op: the reference's output (no kernel build, for row counts)."""

    def __init__(self, name):
        self.spec = flashgen.compile(SPECS / f"{name}.attn").spec
        self.name = self.spec.name

    def __call__(self, q, k, v, dropout_p=0.0, block_mask=None, **params):
        return reference.attention(self.spec, q, k, v, block_mask=block_mask, **params)


def test_no_block_mask_row_for_a_spec_without_a_mask(built_masks):
    rows = bench.run(_ReferenceOp("dense"), [(1, 2, 64, 16)], ir.DType.FP32, CPU, reps=1, block_mask=True,
                     log=lambda s: None)
    assert "flashgen" in {r.impl for r in rows} and "flashgen-bm" not in {r.impl for r in rows}
    assert not built_masks


def test_a_block_mask_that_cannot_be_built_is_reported_on_its_row(monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("heads: refused\nsecond line")

    monkeypatch.setattr(bench.block_masks, "block_mask", refuse)
    rows = bench.run(_ReferenceOp("causal"), [(1, 2, 64, 16)], ir.DType.FP32, CPU, reps=1, include={"flashgen"},
                     block_mask=True, log=lambda s: None)
    plain, bm = rows
    assert plain.impl == "flashgen" and plain.ms is not None
    assert bm.impl == "flashgen-bm" and bm.ms is None and bm.note == "failed: block_mask: ValueError: heads: refused"


def test_cli_block_mask(capsys, tmp_path):
    out = tmp_path / "rows.json"
    argv = ["bench", str(SPECS / "sliding_window.attn"), "--seqlen", "256", "--head-dim", "16", "--batch", "1",
            "--heads", "2", "--reps", "1", "--peers", "sdpa", "--param", "window=64", "--json", str(out)]
    assert main(argv + ["--block-mask"]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["flashgen", "flashgen-bm", "sdpa"]
    assert all(math.isfinite(r["ms"]) for r in rows)
    assert any(line.startswith("flashgen-bm ") for line in text.splitlines())
    assert main(argv) == 0  # without the flag: no such row
    assert "flashgen-bm" not in {r["impl"] for r in json.loads(out.read_text())}
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "--block-mask" in capsys.readouterr().out


@pytest.mark.gpu
def test_time_fn_do_bench_method_on_cuda():
    """flashgen bench's timing (DESIGN.md, Measuring): the warm-up calls, five calls to estimate,
    then at least min_ms of timed calls, each after the L2 flush."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flashgen import bench

    calls = []
    x = torch.zeros(1 << 20, device="cuda")

    def fn():
        calls.append(1)
        x.add_(1)

    ms = bench.time_fn(fn, torch.device("cuda"), warmup=25, reps=10, flush_l2=True, min_ms=20)
    assert ms > 0
    timed = len(calls) - 25 - 5
    assert timed >= 10 and timed * ms >= 20 * 0.5, (timed, ms)
    assert bench._l2_flush_buffer(torch.device("cuda")).numel() == 256 << 20
    assert float(x[0]) == len(calls)
