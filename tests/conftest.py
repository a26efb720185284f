import os
from pathlib import Path

import pytest
import torch

import flashgen
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
