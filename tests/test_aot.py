"""Ahead-of-time directories (`flashgen build SPEC --out DIR`): a fresh process with JIT disabled
and an empty cache loads and runs them with the compiler, the renderer and process creation
booby-trapped; missing variants, tampered artifacts and indexes of other versions are refused
with an error naming the variant."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import families
from flashgen.build import aot, artifact, cache
from flashgen.lang import ir
from flashgen.runtime import loader
from flashgen.tools import aot_build

CPU, SM80 = families.get("cpu"), families.get("sm80")

ROOT = Path(__file__).resolve().parent.parent
# The causal spec's fp32 CPU kernel: other tests compile it too, so this is usually a cache hit.
SPEC = ROOT / "specs" / "causal.attn"

# Runs in a new interpreter: every way to compile, render or start a process raises once the
# imports are done; the op runs forward and backward against the float64 reference; a variant
# that was not built must raise NotBuiltError.
FRESH = r"""
import json, os, subprocess, sys
import jinja2
import torch
import torch.utils.cpp_extension as ce
import flashgen
from flashgen import check
from flashgen.build import artifact, cache
from flashgen.codegen import render

cfg = json.loads(sys.argv[1])

def forbidden(*a, **k):
    raise AssertionError("a compiler, the renderer, a cache key or a new process was asked for with JIT disabled")

ce.load = ce.load_inline = ce._jit_compile = forbidden
jinja2.Environment.get_template = forbidden
render.render = render.render_instantiation = forbidden
cache._build_and_publish = cache.load_cached = forbidden
artifact.Instantiation.key_fields = forbidden  # the cache key (it may run nvcc --version)
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = forbidden
for name in ("system", "popen", "fork", "posix_spawn", "posix_spawnp", "execv", "execve"):
    setattr(os, name, forbidden)

device, dtype = cfg["device"], getattr(torch, cfg["dtype"])
op = flashgen.compile(cfg["spec"])
g = torch.Generator(device=device).manual_seed(0)
B, H, N, d = 2, 3, cfg["seqlen"], cfg["head_dim"]
q, k, v, dout = (torch.randn(B, H, N, d, generator=g, device=device).to(dtype) for _ in range(4))
params = {}
if "document_id" in cfg.get("params", []):
    params["document_id"] = torch.sort(torch.randint(0, 3, (B, N), generator=g, device=device), dim=1).values.int()
with torch.no_grad():
    out, lse = op(q, k, v, return_lse=True, **params)
cmp = check.compare(op.spec, q, k, v, out, lse, **params)
assert cmp.ok, str(cmp)
qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
op(qg, kg, vg, **params).backward(dout)
gcmp = check.compare_grads(op.spec, q, k, v, dout, (qg.grad, kg.grad, vg.grad), params=params)
assert gcmp.ok, str(gcmp)
print("forward:", cmp)
print("backward:", gcmp)
if cfg.get("decode"):  # a decode step on a cache holding the first N - 1 keys, appending the last
    kc, vc = (torch.zeros(B, H, N + 3, d, device=device, dtype=dtype) for _ in range(2))
    kc[:, :, :N - 1], vc[:, :, :N - 1] = k[:, :, :N - 1], v[:, :, :N - 1]
    lens = torch.full((B,), N - 1, dtype=torch.int32, device=device)
    with torch.no_grad():
        got = op.with_kvcache(q[:, :, -1:], kc, vc, cache_seqlens=lens, k=k[:, :, -1:], v=v[:, :, -1:], **params)
    torch.testing.assert_close(got.float(), out[:, :, -1:].float(), atol=2e-2, rtol=2e-2)
    print("decode: ok")
missing = cfg["missing"]
x = torch.randn(B, H, N, missing["head_dim"], device=device).to(getattr(torch, missing["dtype"]))
try:
    op(x, x, x, **params)
except flashgen.BuildError as e:
    print("NOT BUILT", type(e).__name__)
    print(e)
else:
    raise AssertionError("a variant that was not built ran")
"""


def _pythonpath() -> str:
    """The checkout first, then whatever path the test process was given (its packages)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_fresh(aot_dir: Path, cache: Path, **cfg) -> str:
    cache.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"FLASHGEN_JIT": "0", "FLASHGEN_AOT_DIR": str(aot_dir), "FLASHGEN_CACHE_DIR": str(cache),
                        "FLASHGEN_AUTOTUNE": "0", "PYTHONPATH": _pythonpath()}
    res = subprocess.run([sys.executable, "-c", FRESH, json.dumps(cfg)], env=env, text=True, capture_output=True,
                         timeout=600, check=False)
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert list(cache.iterdir()) == [], "the cache was written with JIT disabled"
    return res.stdout


@pytest.fixture(autouse=True)
def _fresh_lookup():
    aot.reload()
    yield
    aot.reload()


@pytest.fixture(scope="module")
def cpu_dir(tmp_path_factory):
    """An AOT directory with the causal spec's fp32 CPU kernel (compiled once, or a cache hit)."""
    out = tmp_path_factory.mktemp("aot") / "kernels"
    entries = aot_build.build_dir([SPEC], out, device="cpu", dtypes=["fp32"])
    return out, entries


def fp32_cpu(spec_path=SPEC, dtype=ir.DType.FP32) -> artifact.Instantiation:
    return CPU.instantiation(flashgen.compile(spec_path).spec, artifact.cpu_arch(), dtype, None)


def jit_off(monkeypatch, aot_dirs, cache: Path) -> None:
    monkeypatch.setenv("FLASHGEN_JIT", "0")
    monkeypatch.setenv("FLASHGEN_AOT_DIR", os.pathsep.join(str(d) for d in aot_dirs))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cache))


def test_directory_layout_and_index(cpu_dir):
    out, entries = cpu_dir
    [entry] = entries
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == aot.FORMAT == 2 and index["flashgen"] == flashgen.__version__
    assert index["torch"] == torch.__version__ and index["python"] == list(sys.version_info[:2])
    assert index["entries"] == [entry]
    inst = fp32_cpu()
    assert entry["variant"] == inst.variant_id() and entry["artifact"] == inst.name
    assert entry["target"] == ["cpu", artifact.cpu_arch(), "cpu"] and entry["dtype"] == "fp32"
    assert entry["kinds"] == ["fwd", "bwd"] and entry["spec"] == "causal"
    folder = out / entry["artifact"]
    assert {p.name for p in folder.iterdir()} == {"lib.so", "manifest.json", "src"}
    assert cache.sha256_of(folder / "lib.so") == entry["sha256"]
    assert not list(out.glob(".*.tmp")) and not list(out.glob(".*.old"))


def test_fresh_process_with_jit_disabled_compiles_nothing(cpu_dir, tmp_path):
    out, _ = cpu_dir
    stdout = run_fresh(out, tmp_path / "empty-cache", spec=str(SPEC), device="cpu", dtype="float32", seqlen=77,
                       head_dim=40, decode=True, missing={"dtype": "bfloat16", "head_dim": 40})
    assert "forward: ok" in stdout and "backward: ok" in stdout and "decode: ok" in stdout
    assert "NOT BUILT NotBuiltError" in stdout
    assert "causal: cpu" in stdout and "bf16" in stdout and str(out) in stdout
    assert "flashgen build" in stdout and "--dtype bf16" in stdout


def test_missing_variant_error_names_it(cpu_dir, tmp_path, monkeypatch):
    out, _ = cpu_dir
    jit_off(monkeypatch, [out], tmp_path / "cache")
    inst = fp32_cpu(dtype=ir.DType.BF16)
    with pytest.raises(aot.NotBuiltError) as e:
        loader.load(inst)
    text = str(e.value)
    assert isinstance(e.value, flashgen.BuildError)
    assert f"causal: cpu {artifact.cpu_arch()}, bf16" in text
    assert inst.variant_id() in text and str(out) in text
    assert "hold for spec 'causal'" in text and "fp32" in text  # what the directory does have
    assert "flashgen build " in text and f"causal.attn --out {out} --device cpu --dtype bf16" in text
    assert not (tmp_path / "cache").exists()


def test_jit_disabled_without_any_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHGEN_AOT_DIR", raising=False)
    monkeypatch.setenv("FLASHGEN_JIT", "0")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(aot.NotBuiltError, match="FLASHGEN_AOT_DIR is not set"):
        loader.load(fp32_cpu())
    assert not (tmp_path / "cache").exists()


def test_found_in_directory_without_a_cache_key(cpu_dir, tmp_path, monkeypatch):
    """JIT on: the directory is searched first, and a hit needs no cache key."""
    out, _ = cpu_dir
    monkeypatch.setenv("FLASHGEN_AOT_DIR", str(out))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(artifact.Instantiation, "key_fields", lambda self: pytest.fail("cache key computed"))
    lib = loader.load(fp32_cpu())
    assert lib.path.parent.parent == out and lib.fwd is not None and lib.bwd is not None
    assert not (tmp_path / "cache").exists()


def copy_dir(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_tampered_library_is_not_loaded(cpu_dir, tmp_path, monkeypatch):
    out, [entry] = cpu_dir
    bad = copy_dir(out, tmp_path / "bad")
    lib = bad / entry["artifact"] / "lib.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    jit_off(monkeypatch, [bad], tmp_path / "cache")
    with pytest.warns(aot.AOTWarning, match="sha256"), pytest.raises(aot.NotBuiltError) as e:
        loader.load(fp32_cpu())
    assert "does not match the index's sha256" in str(e.value) and entry["artifact"] in str(e.value)
    # A second directory with a good copy is used instead.
    aot.reload()
    jit_off(monkeypatch, [bad, out], tmp_path / "cache")
    with pytest.warns(aot.AOTWarning):
        assert loader.load(fp32_cpu()).path.parent.parent == out


@pytest.mark.parametrize("field, value", [("torch", "0.0.1"), ("flashgen", "0.0.0"), ("python", [2, 7]),
                                          ("abi", -1)])
def test_index_of_other_versions_is_ignored(cpu_dir, tmp_path, monkeypatch, field, value):
    out, _ = cpu_dir
    other = copy_dir(out, tmp_path / "other")
    index = json.loads((other / "index.json").read_text())
    index[field] = value
    (other / "index.json").write_text(json.dumps(index))
    jit_off(monkeypatch, [other], tmp_path / "cache")
    with pytest.warns(aot.AOTWarning, match=f"ignoring ahead-of-time directory .*built for {field}"), \
            pytest.raises(aot.NotBuiltError) as e:
        loader.load(fp32_cpu())
    assert f"skipped, built for {field}" in str(e.value)


def test_index_of_an_older_format_is_ignored_with_a_clear_reason(cpu_dir, tmp_path, monkeypatch):
    """Format 1 directories (before kernel families were part of every artifact) are skipped,
    with a message that says to rebuild them."""
    out, _ = cpu_dir
    old = copy_dir(out, tmp_path / "old")
    index = json.loads((old / "index.json").read_text())
    index["format"] = 1
    (old / "index.json").write_text(json.dumps(index))
    jit_off(monkeypatch, [old], tmp_path / "cache")
    with pytest.warns(aot.AOTWarning, match="index format 1, but this flashgen reads format 2 .*rebuild the "
                      "directory with `flashgen build --out`"), pytest.raises(aot.NotBuiltError):
        loader.load(fp32_cpu())


def test_building_into_an_existing_directory_adds_and_replaces(cpu_dir, tmp_path):
    out, [entry] = cpu_dir
    again = copy_dir(out, tmp_path / "again")
    index = json.loads((again / "index.json").read_text())
    other = dict(entry, variant="0" * 64, spec="other", fingerprint="f" * 64)
    index["entries"].append(other)
    (again / "index.json").write_text(json.dumps(index))
    written = aot_build.build_dir([SPEC], again, device="cpu", dtypes=["fp32"])
    entries = json.loads((again / "index.json").read_text())["entries"]
    assert written == [entry] and sorted(e["variant"] for e in entries) == sorted(["0" * 64, entry["variant"]])
    assert cache.sha256_of(again / entry["artifact"] / "lib.so") == entry["sha256"]


def test_cuda_plan_needs_no_gpu_and_no_toolkit(monkeypatch):
    """--arch plans (and names) CUDA variants on any machine; a spec whose mask needs per-call
    block lists brings its block-sparse kernels and the block classifier along."""
    monkeypatch.setattr(artifact, "cuda_version", lambda: pytest.fail("toolkit version asked for"))
    monkeypatch.setattr(artifact, "generator_hash", lambda *a: pytest.fail("generator hash asked for"))
    monkeypatch.setattr(aot_build, "_gpus", dict)
    planned = aot_build.plan([ROOT / "specs" / "document.attn", SPEC], arches=["sm_80", "90"], dtypes=["bf16"],
                       head_dims=[64], layouts=["padded", "packed"])
    got = {(p.inst.spec.name, p.inst.target.arch, dict(p.inst.config).get("varlen", 0),
            dict(p.inst.config).get("sparse", 0), dict(p.inst.config).get("mask", 0)) for p in planned}
    for arch in ("sm_80", "sm_90a"):
        assert {("document", arch, pk, sp, 0) for pk in (0, 1) for sp in (0, 1)} <= got
        assert ("document", arch, 0, 0, 1) in got  # the classifier
        assert {("causal", arch, pk, 0, 0) for pk in (0, 1)} <= got
        assert not any(g[0] == "causal" and (g[3] or g[4]) for g in got)  # no sparse kernels unless asked
    assert len({p.inst.variant_id() for p in planned}) == len(planned)
    causal_packed = next(p.inst for p in planned if p.inst.spec.name == "causal" and p.inst.target.arch == "sm_90a"
                         and p.inst.target.family == "sm80" and dict(p.inst.config).get("varlen"))
    text = aot.not_built_message(causal_packed, [], [])
    assert "causal: sm80 sm_90a, bf16, head_dim 64, packed (varlen) layout, not block-sparse, tiles fwd" in text
    assert "causal.attn --out DIR --arch sm_90a --dtype bf16 --head-dim 64 --layouts packed" in text
    sparse = aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["fp16"], head_dims=[128], sparse=True, decode=False)
    assert {dict(p.inst.config).get("sparse", 0) or 2 * dict(p.inst.config).get("mask", 0) for p in sparse} == {1, 2}
    with pytest.raises(ValueError, match="sm_70"):
        aot_build.plan([SPEC], arches=["sm_70"])
    with pytest.raises(ValueError, match="fp32 is not supported"):
        aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["fp32"])


def decode_insts(planned) -> list[artifact.Instantiation]:
    return [p.inst for p in planned if p.inst.kinds == ("decode",)]


def test_cuda_plan_holds_the_decode_kernels(monkeypatch):
    """CUDA builds hold op.with_kvcache's decode kernels (sm80's, which serve Hopper too): one per
    (arch, dtype, head dim) their kernels take; none with decode=False, none on the CPU (its
    decode runs in the forward library) and none for a forced sm90, which has no decode kernels."""
    monkeypatch.setattr(aot_build, "_gpus", dict)
    spec = flashgen.compile(SPEC).spec
    planned = aot_build.plan([SPEC], arches=["sm_80", "sm_90a"], dtypes=["bf16", "fp16"], head_dims=[64, 128, 72])
    got = {(i.target.family, i.target.arch, i.dtype.value, i.head_dim): i for i in decode_insts(planned)}
    want = {("sm80", a, dt.value, d) for a in ("sm_80", "sm_90a") for dt in (ir.DType.BF16, ir.DType.FP16)
            for d in (64, 128)}  # (not d 72: no decode kernels there, and its decode calls raise)
    assert set(got) == want
    for (_, arch, dt, d), inst in got.items():
        assert inst.variant_id() == SM80.decode_instantiation(spec, arch, ir.DType(dt), d).variant_id()
    entry = aot_build._entry(next(p for p in planned if p.inst.kinds == ("decode",)), Path("x"), "0" * 64)
    assert entry["kinds"] == ["decode"] and entry["config"]["decode"] == 1 and "tiles_origin" not in entry
    assert len(planned) == len(aot_build.plan([SPEC], arches=["sm_80", "sm_90a"], dtypes=["bf16", "fp16"],
                                              head_dims=[64, 128, 72], decode=False)) + len(want)
    assert not decode_insts(aot_build.plan([SPEC], arches=["sm_80"], decode=False))
    assert not decode_insts(aot_build.plan([SPEC], device="cpu"))
    with flashgen.use_family("sm90"):
        assert not decode_insts(aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["bf16"], head_dims=[128]))
    with pytest.raises(TypeError, match="decode"):
        aot_build.plan([SPEC], arches=["sm_80"], decode="yes")
    inst = got[("sm80", "sm_80", "bf16", 64)]
    assert aot.describe_instantiation(inst) == \
        "causal: decode kernels (with_kvcache), sm80 sm_80, bf16, head_dim 64, 64 keys x 3 stages"
    assert aot.build_command(inst).endswith("--arch sm_80 --dtype bf16 --head-dim 64 --decode")
    assert aot._tiles_note(inst) is None  # its tile is the architecture's, never tuned


class _FakeLib:
    """A loaded library, as far as the build and the lookup see one."""

    def __init__(self, inst, path):
        self.instantiation, self.path = inst, path


def fake_cuda(monkeypatch, root: Path, arches: dict[int, str]) -> None:
    """CUDA builds and loads without a toolkit or a GPU: a build writes a cache entry whose
    lib.so is a few bytes, a load wraps it, and CUDA device i has architecture arches[i]."""

    def load_cached(inst, announce=None):
        folder = root / inst.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "lib.so").write_bytes(inst.variant_id().encode())
        (folder / "manifest.json").write_text(json.dumps({"sha256": cache.sha256_of(folder / "lib.so")}))
        return _FakeLib(inst, folder / "lib.so")

    monkeypatch.setattr(aot_build, "_gpus", dict)
    monkeypatch.setattr(artifact, "cuda_version", lambda: "13.0")
    monkeypatch.setattr(cache, "check_toolchain", lambda targets: None)
    monkeypatch.setattr(cache, "load_cached", load_cached)
    monkeypatch.setattr(cache, "LoadedLibrary", _FakeLib)
    monkeypatch.setattr(artifact, "cuda_arch_of", lambda index: arches[index])


def test_decode_kernels_load_from_a_directory_with_jit_disabled(tmp_path, monkeypatch):
    """A CUDA directory holds the decode kernels in its index; a decode call's library loads from
    it with FLASHGEN_JIT=0, and one the directory lacks (built with decode=False, or for another
    architecture) raises NotBuiltError naming the decode variant and the command that adds it."""
    fake_cuda(monkeypatch, tmp_path / "cache", {0: "sm_80", 1: "sm_90a", 2: "sm_80"})
    out, bare = tmp_path / "kernels", tmp_path / "prefill-only"
    aot_build.build_dir([SPEC], out, arches=["sm_80"], dtypes=["bf16"], head_dims=[64], jobs=1)
    aot_build.build_dir([SPEC], bare, arches=["sm_80"], dtypes=["bf16"], head_dims=[64], decode=False, jobs=1)
    index = json.loads((out / "index.json").read_text())["entries"]
    [dec] = [e for e in index if e["kinds"] == ["decode"]]
    spec = flashgen.compile(SPEC).spec
    inst = SM80.decode_instantiation(spec, "sm_80", ir.DType.BF16, 64)
    assert dec["variant"] == inst.variant_id() and dec["target"] == ["sm80", "sm_80", "cuda"]
    assert (out / dec["artifact"] / "lib.so").is_file()
    assert not [e for e in json.loads((bare / "index.json").read_text())["entries"] if e["kinds"] == ["decode"]]

    op = flashgen.compile(SPEC)
    jit_off(monkeypatch, [out], tmp_path / "cache-off")
    lib = op.decode_library(SM80, torch.device("cuda", 0), ir.DType.BF16, 64)
    assert lib.path == out / dec["artifact"] / "lib.so" and lib.instantiation.kinds == ("decode",)
    with pytest.raises(aot.NotBuiltError) as e:  # a GPU of another architecture
        op.decode_library(SM80, torch.device("cuda", 1), ir.DType.BF16, 64)
    text = str(e.value)
    assert "no ahead-of-time kernel for causal: decode kernels (with_kvcache), sm80 sm_90a, bf16, head_dim 64" in text
    assert "causal: decode kernels (with_kvcache), sm80 sm_80, bf16, head_dim 64" in text  # what it holds
    assert f"--out {out} --arch sm_90a --dtype bf16 --head-dim 64 --decode" in text
    jit_off(monkeypatch, [bare], tmp_path / "cache-off")
    with pytest.raises(aot.NotBuiltError) as e:  # a directory built without them
        op.decode_library(SM80, torch.device("cuda", 2), ir.DType.BF16, 64)
    assert "decode kernels (with_kvcache), sm80 sm_80" in str(e.value)
    assert f"--out {bare} --arch sm_80 --dtype bf16 --head-dim 64 --decode" in str(e.value)
    assert not (tmp_path / "cache-off").exists()


def test_build_command_decode_option(tmp_path, monkeypatch, capsys):
    """`flashgen build --out DIR --arch ...` writes the decode kernels (and says so); --no-decode
    leaves them out."""
    from flashgen import cli

    fake_cuda(monkeypatch, tmp_path / "cache", {})
    args = [str(SPEC), "--arch", "sm_80", "--dtype", "bf16", "--head-dim", "64"]
    assert cli.main(["build", *args, "--out", str(tmp_path / "a")]) == 0
    assert "causal: decode kernels (with_kvcache), sm80 sm_80, bf16, head_dim 64" in capsys.readouterr().out
    assert cli.main(["build", *args, "--out", str(tmp_path / "b"), "--no-decode"]) == 0
    assert "decode kernels" not in capsys.readouterr().out
    kinds = {d: sorted(e["kinds"][0] for e in json.loads((tmp_path / d / "index.json").read_text())["entries"])
             for d in ("a", "b")}
    assert kinds == {"a": ["decode", "fwd"], "b": ["fwd"]}


def test_op_build_loads_the_decode_kernels(tmp_path, monkeypatch):
    """op.build(cuda) loads the decode library too (decode=True, the default), so the first
    decode call finds it; decode=False leaves it to that call. On the CPU there is nothing more
    to build: its decode calls run in the forward library op.build loaded."""
    from flashgen.tune import store as tune_store

    fake_cuda(monkeypatch, tmp_path / "cache", {0: "sm_80"})
    for name, fake in (("is_available", lambda: True), ("current_device", lambda: 0), ("device_count", lambda: 1),
                       ("get_device_capability", lambda i=None: (8, 0)), ("get_device_name", lambda d=None: "A100")):
        monkeypatch.setattr(torch.cuda, name, fake)  # a live sm_80 GPU (nothing runs on it)
    monkeypatch.setattr(tune_store, "entries", lambda index: {})  # nothing tuned on it
    monkeypatch.setattr(flashgen.tiles, "device_info", lambda index: flashgen.tiles.arch_info("sm_80"))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    op = flashgen.compile(SPEC)
    insts = op.build("cuda:0", ["bf16"], [64, 128])
    dec = [i for i in insts if i.kinds == ("decode",)]
    assert {i.head_dim for i in dec} == {64, 128} and {i.target for i in dec} == {SM80.target("sm_80")}
    loads, load_cached = [], cache.load_cached
    monkeypatch.setattr(cache, "load_cached", lambda inst, announce=None: loads.append(inst) or load_cached(inst))
    for inst in dec:
        assert op.decode_library(SM80, torch.device("cuda", 0), ir.DType.BF16, inst.head_dim).instantiation == inst
    assert loads == []  # recorded by op.build: the decode call loads nothing
    assert [i.kinds for i in op.build("cuda:0", ["fp16"], [64], decode=False)] == [("fwd", "bwd")]
    assert [i.kinds for i in loads] == [("fwd", "bwd")]
    assert [i.kinds for i in op.build("cpu", ["fp32"])] == [("fwd", "bwd")]


def test_cpu_decode_runs_from_a_directory_with_jit_disabled(cpu_dir, tmp_path, monkeypatch):
    """The CPU family's decode calls run in its forward library: a directory built for the CPU
    serves them with FLASHGEN_JIT=0; a dtype it lacks names the build command."""
    out, _ = cpu_dir
    jit_off(monkeypatch, [out], tmp_path / "cache")
    op = flashgen.compile(SPEC)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=g)
    k_cache, v_cache = (torch.randn(2, 2, 64, 32, generator=g) for _ in range(2))
    lens = torch.tensor([5, 64], dtype=torch.int32)
    with torch.no_grad():
        o = op.with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    with torch.no_grad():
        ref = torch.cat([op(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n]) for b, n in
                         enumerate(lens.tolist())])  # one query at the last position: every key
    torch.testing.assert_close(o, ref)
    with pytest.raises(aot.NotBuiltError, match="--device cpu --dtype bf16"), torch.no_grad():
        op.with_kvcache(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), cache_seqlens=lens)
    assert not (tmp_path / "cache").exists()


def test_variant_id_is_what_the_artifact_is():
    spec = flashgen.compile(SPEC).spec
    a = SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 64)
    assert a.variant_id() == artifact.Instantiation(spec, SM80.target("sm_90a"), ir.DType.BF16, 64,
                                                 a.config).variant_id()
    others = [SM80.instantiation(spec, "sm_80", ir.DType.BF16, 64),
              SM80.instantiation(spec, "sm_90a", ir.DType.FP16, 64),
              SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 128),
              SM80.instantiation(spec, "sm_90a", ir.DType.BF16, 64, packed=True)]
    assert len({a.variant_id(), *(o.variant_id() for o in others)}) == 5


def test_build_command_writes_a_directory(cpu_dir, tmp_path):
    _, [entry] = cpu_dir
    dest = tmp_path / "cli"
    env = os.environ | {"PYTHONPATH": _pythonpath()}
    res = subprocess.run([sys.executable, "-m", "flashgen", "build", str(SPEC), "--out", str(dest), "--device", "cpu",
                          "--dtype", "fp32"], env=env, text=True, capture_output=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    [written] = json.loads((dest / "index.json").read_text())["entries"]
    assert written["variant"] == entry["variant"] and f"wrote {dest / 'index.json'}" in res.stdout
    assert str(dest / written["artifact"] / "lib.so") in res.stdout


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_directory_runs_with_jit_disabled(tmp_path):
    out = tmp_path / "kernels"
    entries = aot_build.build_dir([SPEC], out, device="cuda", dtypes=["bf16"], head_dims=[64])
    # on Hopper the sm90 forward comes too (the forward runs on it, the backward on sm80)
    fams = {f.name for f in families.for_arch_all("cuda", artifact.cuda_arch_of(None))}
    assert entries and all(e["target"][2] == "cuda" and e["head_dim"] == 64 for e in entries)
    assert {e["target"][0] for e in entries} == fams
    assert any(e["kinds"] == ["decode"] for e in entries)  # with_kvcache's kernels (decode=True, the default)
    stdout = run_fresh(out, tmp_path / "empty-cache", spec=str(SPEC), device="cuda", dtype="bfloat16", seqlen=300,
                       head_dim=64, decode=True, missing={"dtype": "bfloat16", "head_dim": 128})
    assert "forward: ok" in stdout and "backward: ok" in stdout and "decode: ok" in stdout
    assert "NOT BUILT NotBuiltError" in stdout and "head_dim 128" in stdout and "--head-dim 128" in stdout


@pytest.mark.gpu
def test_cuda_directory_with_per_call_block_lists(tmp_path):
    """A mask without a closed-form key range (document ids): its calls need the block-sparse
    kernels and the block classifier, which the directory then holds."""
    spec = ROOT / "specs" / "document.attn"
    assert flashgen.compile(spec).auto_sparse
    out = tmp_path / "kernels"
    entries = aot_build.build_dir([spec], out, device="cuda", dtypes=["bf16"], head_dims=[64])
    assert any(e["config"].get("mask") for e in entries) and any(e["config"].get("sparse") for e in entries)
    stdout = run_fresh(out, tmp_path / "empty-cache", spec=str(spec), device="cuda", dtype="bfloat16", seqlen=300,
                       head_dim=64, params=["document_id"], missing={"dtype": "float16", "head_dim": 64})
    assert "forward: ok" in stdout and "backward: ok" in stdout and "NOT BUILT" in stdout


def test_build_command_errors_name_the_options(tmp_path, capsys):
    from flashgen import cli

    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli.main(["build", str(SPEC), "--out", str(afile), "--device", "cpu"]) == 2
    assert "--out:" in capsys.readouterr().err
    assert cli.main(["build", str(SPEC), "--out", str(tmp_path / "d"), "--arch", "sm_75"]) == 2
    assert "--arch:" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_plan_for_hopper_builds_each_family_what_it_serves():
    """On sm_90a a plan holds the sm90 forward (its own tiles) and the sm80 instantiations; a
    forced sm90 plans only what sm90 serves and refuses the rest, naming it."""
    plan = aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["bf16"], head_dims=[128])
    by_family = {p.inst.target.family: p.inst for p in plan}
    assert set(by_family) == {"sm90", "sm80"}
    # (causal d 128: the sm90 instantiation carries its backward too; sm80 still runs GQA,
    # deterministic, packed and block-listed backward calls)
    assert by_family["sm90"].kinds == ("fwd", "bwd") and dict(by_family["sm90"].config)["fwd_block_n"] == 128
    with flashgen.use_family("sm90"):
        forced = aot_build.plan([SPEC, ROOT / "specs" / "document.attn"], arches=["sm_90a"], dtypes=["bf16"],
                                head_dims=[128])
        kernels = [p.inst for p in forced if not dict(p.inst.config).get("mask")]
        assert {i.target.family for i in kernels} == {"sm90"}
        assert [p.inst.name for p in forced if p.inst.spec.name == "causal"] == [by_family["sm90"].name]
        # document ids need block lists per call: the block-sparse forward and the classifier too
        doc = [p.inst for p in forced if p.inst.spec.name == "document"]
        assert sorted(bool(dict(i.config).get("sparse")) for i in doc if i in kernels) == [False, True]
        assert any(dict(i.config).get("mask") for i in doc)
        big = aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["bf16"], head_dims=[256], sparse=[True])
        assert [dict(p.inst.config)["fwd_block_n"] for p in big if not dict(p.inst.config).get("mask")] == [64]
        packed = aot_build.plan([SPEC], arches=["sm_90a"], dtypes=["bf16"], head_dims=[128],
                                layouts=["padded", "packed"])
        assert sorted(bool(dict(p.inst.config).get("varlen")) for p in packed) == [False, True]
