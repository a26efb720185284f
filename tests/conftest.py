import os
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.families import cpu_tiles
from flashgen.runtime import launch

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every kernel output starts as NaN, so an element the kernel does not write shows."""
    old = launch.poison_outputs
    launch.poison_outputs = True
    yield
    launch.poison_outputs = old


@pytest.fixture
def forced_cpu_tiles(monkeypatch):
    """Sets FLASHGEN_CPU_TILES / FLASHGEN_CPU_BWD_TILES ("qb,kvb") for one test: they are read once
    per process, so the CPU family's reading of them is cleared on the way in and out."""
    def force(fwd: str, bwd: str) -> None:
        monkeypatch.setenv("FLASHGEN_CPU_TILES", fwd)
        monkeypatch.setenv("FLASHGEN_CPU_BWD_TILES", bwd)
        cpu_tiles.overrides.cache_clear()

    yield force
    cpu_tiles.overrides.cache_clear()  # monkeypatch restores the environment after this


@pytest.fixture(scope="session")
def dense_op():
    return flashgen.compile(SPECS / "dense.attn")


@pytest.fixture(scope="session")
def causal_op():
    return flashgen.compile(SPECS / "causal.attn")


@pytest.fixture(scope="session")
def top_left_op():
    return flashgen.compile("attention causal_tl {\n    mask = causal_top_left\n}\n")


@pytest.fixture(scope="session", autouse=True)
def _quiet_builds():
    os.environ.setdefault("FLASHGEN_QUIET", "1")
