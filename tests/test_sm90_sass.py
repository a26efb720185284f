"""Compile-only check of the sm90 (Hopper) forward (no GPU needed): the causal, ALiBi and document
example specs at head_dim 128, bf16, rendered by the sm90 family and compiled for sm_90a with the
flags a build uses. The SASS must issue wgmma (HGMMA) and TMA loads (UTMALDG) and touch no local
memory (no LDL/STL), and ptxas must report no spills (also for the causal spec's packed unit, whose
dynamic schedule takes work items by a global atomic): an sm90 forward that falls back to
mma.sync, to plain global loads or to spilling compiles cleanly and is still wrong, so only the
machine code shows it. Each unit is compiled once for both checks. Skips where nvcc is absent;
the SASS check alone skips where cuobjdump is (the spill check needs only nvcc)."""

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from conftest import SPECS

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _cuobjdump() -> str | None:
    """cuobjdump as kernel resource reports find it (CUDA_HOME, PATH, beside nvcc), else from the
    nvidia-cuda-cuobjdump wheel in this environment (as scripts/sass_compare.py looks for it)."""
    from flashgen.tune.resources import find_cuobjdump

    found = find_cuobjdump()
    if found:
        return found
    wheels = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/*/bin/cuobjdump"))
    return str(wheels[-1]) if wheels else None


CUOBJDUMP = _cuobjdump()
SPEC_NAMES = ["causal", "alibi", "document", "dense"]  # dense: the overlapped key loop
# One SASS instruction line: /*0a70*/  [@!P0] OPCODE.MODS operands ;
SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _opcodes(sass: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in sass.splitlines():
        m = SASS_LINE.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def _spills(ptxas: str) -> dict[str, tuple[int, int]]:
    """Kernel (mangled name) → (spill store bytes, spill load bytes) from ``-Xptxas -v``."""
    res, cur = {}, None
    for line in ptxas.splitlines():
        m = PTXAS_ENTRY.search(line)
        if m:
            cur = m.group(1)
            continue
        m = PTXAS_SPILLS.search(line)
        if m and cur is not None:
            res[cur] = (int(m.group(1)), int(m.group(2)))
    return res


def _compile(name: str, packed: bool, work: Path):
    """The spec's sm90 forward unit (bf16, d 128; ``packed``: the varlen instantiation) compiled
    for sm_90a with a build's flags: (object file, ptxas report)."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what a real build adds

    from flashgen import families
    from flashgen.build import artifact
    from flashgen.lang import frontend, ir
    from flashgen.paths import include_dir

    inst = families.get("sm90").instantiation(frontend.parse(SPECS / f"{name}.attn"), "sm_90a",
                                              ir.DType.BF16, 128, packed=packed)
    assert "fwd" in inst.kinds
    text = inst.sources()[inst.source_name("fwd")]
    assert '#include "flashgen/sm90/fwd.cuh"' in text  # the Hopper kernel, not the sm80 one
    src, obj = work / "k.cu", work / "k.o"
    src.write_text(text)
    with pytest.MonkeyPatch.context() as mp:  # the release flags (-G would put everything in local memory)
        mp.delenv("FLASHGEN_DEBUG", raising=False)
        _, cuda_flags = artifact.compiler_flags(inst.target)
    cmd = [NVCC, "-c", *cuda_flags, *COMMON_NVCC_FLAGS, "-Xptxas", "-v", "-I", str(include_dir()),
           "-o", str(obj), str(src)]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    return obj, res.stderr + res.stdout


@pytest.fixture(scope="module", params=SPEC_NAMES)
def sm90_unit(request, tmp_path_factory):
    """The spec's sm90 forward unit compiled for sm_90a: (object file, ptxas report)."""
    return _compile(request.param, False, tmp_path_factory.mktemp(f"sm90-{request.param}"))


@pytest.fixture(scope="module")
def sm90_packed_unit(tmp_path_factory):
    """The causal spec's packed (varlen) sm90 forward unit: the dynamic schedule's code path."""
    return _compile("causal", True, tmp_path_factory.mktemp("sm90-causal-packed"))


def test_sm90_fwd_no_spills(sm90_unit):
    _, report = sm90_unit
    spills = _spills(report)
    assert any("fwd_kernel" in k for k in spills), f"no forward kernel in the ptxas report:\n{report}"
    assert all(v == (0, 0) for v in spills.values()), f"spills (store, load bytes): {spills}"


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or nvidia-cuda-cuobjdump)")
def test_sm90_fwd_sass(sm90_unit):
    obj, _ = sm90_unit
    dump = subprocess.run([CUOBJDUMP, "-sass", str(obj)], check=False, capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    ops = _opcodes(dump.stdout)
    assert ops.get("HGMMA", 0) > 0, f"no wgmma (HGMMA) in the SASS: {sorted(ops)}"
    assert ops.get("UTMALDG", 0) > 0, f"no TMA load (UTMALDG) in the SASS: {sorted(ops)}"
    local = {op: n for op, n in ops.items() if op in ("LDL", "STL")}
    assert not local, f"local memory accesses in the SASS: {local}"
    # the padded layout's schedule is static: no work counter
    assert not any(op.startswith(("ATOM", "RED")) for op in ops), sorted(ops)
    # wgmma descriptors in uniform registers, one add per wgmma (sm90/ptx.cuh desc_advance): a few
    # instructions between consecutive HGMMAs of a GEMM (13-19 when both were re-encoded each time)
    at = [i for i, line in enumerate(l for l in dump.stdout.splitlines() if SASS_LINE.match(l))
          if SASS_LINE.match(line).group(1) == "HGMMA"]
    gaps = sorted(b - a for a, b in zip(at, at[1:]) if b - a < 60)
    assert gaps and gaps[len(gaps) // 2] <= 6, f"median instructions between HGMMAs {gaps[len(gaps) // 2]}: {gaps}"


def _sass(obj) -> dict[str, int]:
    dump = subprocess.run([CUOBJDUMP, "-sass", str(obj)], check=False, capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    return _opcodes(dump.stdout)


def test_sm90_packed_fwd_no_spills(sm90_packed_unit):
    """The packed causal unit, with the dynamic schedule's work ring and atomic, spills nothing
    (168 registers per thread as without it)."""
    _, report = sm90_packed_unit
    spills = _spills(report)
    assert any("fwd_kernel" in k for k in spills), f"no forward kernel in the ptxas report:\n{report}"
    assert all(v == (0, 0) for v in spills.values()), f"spills (store, load bytes): {spills}"


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or nvidia-cuda-cuobjdump)")
def test_sm90_packed_fwd_sass_takes_work_by_atomic(sm90_packed_unit):
    """The packed unit draws its items from the work counter (a global atomic add, ATOMG) and
    touches no local memory (the padded units have no atomic: test_sm90_fwd_sass)."""
    ops = _sass(sm90_packed_unit[0])
    assert ops.get("ATOMG", 0) > 0, f"no global atomic (ATOMG) in the packed SASS: {sorted(ops)}"
    assert ops.get("HGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0
    local = {op: n for op, n in ops.items() if op in ("LDL", "STL")}
    assert not local, f"local memory accesses in the SASS: {local}"


# The sm90 backward units (sm90/bwd.cuh), bf16: causal at d 128, dense at d 64, and ALiBi (a
# score expression, a tensor parameter and its gradient) at both. Spill bytes allowed per unit
# (ptxas, the whole kernel): the producer warpgroup runs on 24 registers after setmaxnreg, and
# with the dQ writer warp beside the loads ptxas keeps 5-12 words of the load warp's walk on the
# stack (40-104 bytes; written once per query tile, not on the consumers' path), and since the
# persistent tile scheduler a few more (the item loop's index and the counters carried across
# items: 84 bytes padded, 232 packed, whose sequence lookup adds its own). The consumers'
# own local-memory instructions are bounded separately (BWD_CONSUMER_LOCAL, counted in the SASS
# before the producer's register release): none, except ALiBi at d 128, whose score hooks and
# parameter-gradient atomics run beside the 128 fp32 dK, dV accumulators and the 64 of S^T, dP^T
# in 240 registers (docs/perf-notes.md).
BWD_UNITS = [("causal", 128, False), ("dense", 64, False), ("alibi", 64, False), ("alibi", 128, False),
             ("causal", 128, True)]
BWD_SPILL_BYTES = {("causal", 128, False): 84, ("dense", 64, False): 196, ("alibi", 64, False): 84,
                   ("alibi", 128, False): 192, ("causal", 128, True): 232}
# dense d 64 runs 128-row query tiles (sm90.bwd_block_m): a few words of its consumers' state
# spill (8 local-memory instructions, one of them between the step's wgmmas), measured faster
# than 64-row tiles without spills (docs/perf-notes.md).
BWD_CONSUMER_LOCAL = {("alibi", 128, False): 56, ("dense", 64, False): 8}


@pytest.fixture(scope="module", params=BWD_UNITS, ids=[f"{n}-d{d}{'-packed' if pk else ''}" for n, d, pk in BWD_UNITS])
def sm90_bwd_unit(request, tmp_path_factory):
    """The spec's sm90 backward unit compiled for sm_90a: (object file, ptxas report, seconds)."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    import time

    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    from flashgen import families
    from flashgen.build import artifact
    from flashgen.lang import frontend, ir
    from flashgen.paths import include_dir

    name, d, packed = request.param
    inst = families.get("sm90").instantiation(frontend.parse(SPECS / f"{name}.attn"), "sm_90a", ir.DType.BF16, d,
                                              packed=packed)
    assert inst.kinds == ("fwd", "bwd")
    text = inst.sources()[inst.source_name("bwd")]
    assert '#include "flashgen/sm90/bwd.cuh"' in text
    work = tmp_path_factory.mktemp(f"sm90-bwd-{name}-{d}-{int(packed)}")
    src, obj = work / "k.cu", work / "k.o"
    src.write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FLASHGEN_DEBUG", raising=False)
        _, cuda_flags = artifact.compiler_flags(inst.target)
    cmd = [NVCC, "-c", *cuda_flags, *COMMON_NVCC_FLAGS, "-Xptxas", "-v", "-I", str(include_dir()),
           "-o", str(obj), str(src)]
    t0 = time.monotonic()
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - t0
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), res.stderr
    print(f"sm90 backward unit {name} d{d}: nvcc {seconds:.1f} s")
    return obj, res.stderr + res.stdout, seconds, BWD_SPILL_BYTES.get(request.param, 0), \
        BWD_CONSUMER_LOCAL.get(request.param, 0)


def test_sm90_bwd_no_spills(sm90_bwd_unit):
    """Also no wgmma serialisation: ptxas reports it as info (C7512 "wgmma.mma_async instructions
    are serialized", C7519 "warpgroup.arrive is injected"), not as a warning, and it costs every
    overlap of the GEMMs (each wgmma then waits for the one before)."""
    _, report, seconds, allowed, _ = sm90_bwd_unit
    serial = [line for line in report.splitlines() if "C7512" in line or "C7519" in line]
    assert not serial, "ptxas serialises wgmma:\n" + "\n".join(serial)
    spills = _spills(report)
    assert any("bwd_kernel" in k and "sm90" in k for k in spills), f"no sm90 backward kernel in the report:\n{report}"
    assert all(max(v) <= allowed for v in spills.values()), f"spills (store, load bytes; {allowed} allowed): {spills}"
    assert seconds < 90, f"one backward unit took {seconds:.0f} s of nvcc"


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (CUDA toolkit or nvidia-cuda-cuobjdump)")
def test_sm90_bwd_sass(sm90_bwd_unit):
    obj, _, _, _, consumer_allowed = sm90_bwd_unit
    dump = subprocess.run([CUOBJDUMP, "-sass", str(obj)], check=False, capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    ops = _opcodes(dump.stdout)
    assert ops.get("HGMMA", 0) > 0, f"no wgmma (HGMMA) in the SASS: {sorted(ops)}"
    assert ops.get("UTMALDG", 0) > 0, f"no TMA load (UTMALDG) in the SASS: {sorted(ops)}"
    assert ops.get("STSM", 0) > 0, f"no stmatrix (STSM) for dS in the SASS: {sorted(ops)}"
    assert ops.get("UTMAREDG", 0) > 0, f"no TMA reduce-add (UTMAREDG) for dQ in the SASS: {sorted(ops)}"
    # The backward kernel's consumer code comes first, up to the producer warpgroup's register
    # release (USETMAXREG.DEALLOC); local-memory instructions there are the consumers' spills.
    consumer, in_bwd, released = 0, False, False
    hgmma_at, n = [], 0  # instruction indices of the consumers' HGMMAs
    for line in dump.stdout.splitlines():
        if "Function :" in line:
            in_bwd, released = "bwd_kernel" in line and "Sm90Bwd" in line, False
        elif in_bwd and "USETMAXREG.DEALLOC" in line:
            released = True
        elif in_bwd and not released and SASS_LINE.match(line):
            n += 1
            op = SASS_LINE.match(line).group(1)
            consumer += op in ("LDL", "STL")
            if op == "HGMMA":
                hgmma_at.append(n)
    # The wgmma descriptors live in uniform registers, advanced by one add per wgmma (sm90/ptx.cuh
    # desc_advance): a few instructions between consecutive HGMMAs of a GEMM, where re-encoding
    # both descriptors and moving them to uniform registers took 13-14 (docs/perf-notes.md).
    gaps = sorted(b - a for a, b in zip(hgmma_at, hgmma_at[1:]) if b - a < 60)
    assert gaps and gaps[len(gaps) // 2] <= 8, f"median instructions between HGMMAs {gaps[len(gaps) // 2]}: {gaps}"
    assert ops.get("USETMAXREG", 0) > 0, "no setmaxnreg in the backward's SASS"
    # wgmma waits: a handful per step (S^T, dP^T, dV, dK, dQ groups), not one per HGMMA
    assert ops.get("HGMMA", 0) >= 4 * max(1, dump.stdout.count("WARPGROUP.DEPBAR")), \
        f"{dump.stdout.count('WARPGROUP.DEPBAR')} wgmma waits for {ops.get('HGMMA', 0)} HGMMA (serialised?)"
    assert consumer <= consumer_allowed, f"{consumer} local-memory instructions on the consumers' path"
