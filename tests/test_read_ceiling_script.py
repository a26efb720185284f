"""scripts/read_ceiling.py without a GPU: its argument errors, the clear exit without one, the
per-CTA checksum fold, and (where nvcc is present) that its kernels compile for sm_90a with the
loads they are named for (cp.async with and without the L2 prefetch qualifier, TMA bulk copies)."""

import functools
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("read_ceiling_script", ROOT / "scripts" / "read_ceiling.py")
script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = script
_spec.loader.exec_module(script)

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def test_argument_errors(capsys):
    with pytest.raises(SystemExit):
        script.main(["--rows", "48", "--stages", "3"])
    assert "48x3 is not one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--methods", "ldg,tma"])
    assert "unknown method 'tma'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit")
def test_no_gpu_exit(capsys):
    assert script.main(["--shapes", "1x64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_xor_rows():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 128):
        t = torch.randint(-2**31, 2**31 - 1, (3, n), generator=g, dtype=torch.int32)
        want = [functools.reduce(lambda a, b: a ^ b, row.tolist()) for row in t]
        assert script._xor_rows(t).tolist() == want


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_build_sm90a(tmp_path):
    lib = script.build("sm_90a", tmp_path, NVCC)
    assert lib.exists() and script.build("sm_90a", tmp_path, NVCC) == lib  # kept by the source's hash
    from flashgen.tune.resources import find_cuobjdump

    wheels = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin/cuobjdump"))
    cuobjdump = find_cuobjdump() or (str(wheels[-1]) if wheels else None)  # the test extra's wheel
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (the compile passed)")
    sass = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "UBLKCP" in sass  # cp.async.bulk
    assert "LDGSTS.E.BYPASS.LTC256B.128" in sass and "LDGSTS.E.BYPASS.128" in sass  # cp.async +- L2::256B
    assert "LDG.E.NA.128.CONSTANT" in sass  # ld.global.nc.L1::no_allocate.v4
