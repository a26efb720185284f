"""Build cache: keys, double-checked locking across processes, killed builds, corrupt entries,
cached loads that neither render nor compile, and build errors that point at the source."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashgen import families
from flashgen.build import artifact
from flashgen.build import cache as build_cache
from flashgen.errors import BuildError
from flashgen.lang import frontend, ir
from flashgen.runtime import loader

ROOT = Path(__file__).resolve().parent.parent

# A spec of its own, so these builds never share cache entries with other tests' specs.
SPEC = "attention buildprobe {\n    mask = causal\n    dtype fp32\n}\n"

RUN = """
import sys, time
import torch
t0 = time.perf_counter()
import flashgen
op = flashgen.compile(sys.argv[1])
q = torch.randn(1, 2, 16, 32)
out = op(q, q, q)
dt = time.perf_counter() - t0
assert torch.isfinite(out).all()
print(f"first-result-seconds {dt:.3f}")
"""

NO_COMPILE = """
import sys, time
import torch
import torch.utils.cpp_extension as ce
def forbidden(*a, **k):
    raise AssertionError("the compiler ran on a cached load")
ce.load = forbidden
t0 = time.perf_counter()
import flashgen
from flashgen.codegen import render
render.render = render.render_instantiation = forbidden
op = flashgen.compile(sys.argv[1])
q = torch.randn(1, 2, 16, 32)
out = op(q, q, q)
print(f"first-result-seconds {time.perf_counter() - t0:.3f}")
"""


def spawn(code, cache, spec_path, **kw):
    env = os.environ | {"FLASHGEN_CACHE_DIR": str(cache), "FLASHGEN_QUIET": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, str(spec_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out, err


@pytest.fixture
def spec_path(tmp_path):
    p = tmp_path / "buildprobe.attn"
    p.write_text(SPEC)
    return p


def entries(cache):
    return [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("fg_")]


def test_two_processes_build_once_then_cached_load_compiles_nothing(tmp_path, spec_path):
    cache = tmp_path / "cache"
    procs = [spawn(RUN, cache, spec_path) for _ in range(2)]
    results = [finish(p) for p in procs]
    compiles = sum(err.count("compiling fg_buildprobe") for _, err in results)
    assert compiles == 1, [err for _, err in results]  # one built, the other waited and loaded
    [entry] = entries(cache)
    assert {p.name for p in entry.iterdir()} == {"lib.so", "manifest.json", "src"}
    # A new process loads from the cache: no render, no compiler (both are booby-trapped).
    out, err = finish(spawn(NO_COMPILE, cache, spec_path))
    assert "compiling" not in err
    print(out.strip())  # the cached-load time, reported with -s


def test_killed_build_leaves_no_blocking_lock(tmp_path, spec_path):
    cache = tmp_path / "cache"
    proc = spawn(RUN, cache, spec_path, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any((cache / ".tmp").glob("fg_buildprobe*/src")):
        time.sleep(0.05)
    time.sleep(0.5)  # the compiler is running now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert not entries(cache)
    out, err = finish(spawn(RUN, cache, spec_path), timeout=300)
    assert "compiling fg_buildprobe" in err and len(entries(cache)) == 1


@pytest.mark.parametrize("damage", ["truncate", "manifest", "garbage"])
def test_corrupt_entry_is_rebuilt(tmp_path, spec_path, damage):
    cache = tmp_path / "cache"
    finish(spawn(RUN, cache, spec_path))
    [entry] = entries(cache)
    lib = entry / "lib.so"
    if damage == "truncate":
        lib.write_bytes(lib.read_bytes()[:1000])
    elif damage == "manifest":
        (entry / "manifest.json").unlink()
    else:
        lib.write_bytes(b"not a shared library")
    out, err = finish(spawn(RUN, cache, spec_path))
    why = "no manifest.json" if damage == "manifest" else "checksum mismatch"
    assert f"cache entry {entry} is damaged ({why}); rebuilding" in err
    assert build_cache._entry_ok(entry, __import__("json").loads((entry / "manifest.json").read_text())["key"])


def test_build_error_shows_compiler_output_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = frontend.parse("attention broken { dtype fp32 }")
    inst = families.get("cpu").instantiation(spec, artifact.cpu_arch(), ir.DType.FP32, None)
    monkeypatch.setattr(artifact.Instantiation, "sources", lambda self: {"broken.cpp": "int main( { this is not C++ }\n"})
    with pytest.raises(BuildError) as e:
        loader.load(inst)
    text = str(e.value)
    assert f"failed to build {inst.name}" in text
    source = Path(text.split("generated sources: ")[1].splitlines()[0]) / "broken.cpp"
    assert source.is_file() and "this is not C++" in source.read_text()
    assert "error" in text.split("spec:")[1]  # the compiler's own message follows


def test_cpu_build_command(tmp_path, spec_path):
    env = os.environ | {"FLASHGEN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "flashgen", "build", str(spec_path)], env=env, text=True,
                         capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "buildprobe: 1 instantiation(s) ready in" in res.stdout
    assert str(tmp_path / "cache") in res.stdout and "lib.so" in res.stdout
    assert torch.__version__  # build used this torch
