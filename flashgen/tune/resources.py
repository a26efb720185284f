"""Kernel resources from the compiler's report: finding the CUDA toolkit's cuobjdump and parsing
``cuobjdump -res-usage`` (registers, stack frame / spills, shared and local memory per kernel).
The tuner prunes candidates that spill by it; flashgen explain shows registers with it."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import env


@dataclass(frozen=True)
class KernelResources:
    """Per-thread registers, stack frame and local memory (bytes; spills land in the stack
    frame), and static shared memory per CTA (bytes) of one kernel, from cuobjdump -res-usage."""

    regs: int
    stack: int
    shared: int
    local: int

    @property
    def local_bytes(self) -> int:
        """Local memory per thread: stack frame (register spills, local arrays) + LOCAL."""
        return self.stack + self.local


_FUNCTION = re.compile(r"^\s*Function\s+(\S+?)\s*:\s*$")
_FIELD = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")
_ARCH = re.compile(r"^\s*arch\s*=\s*(sm_\w+)\s*$")


def parse_res_usage(text: str, arch: str | None = None) -> dict[str, KernelResources]:
    """Kernel (mangled) name → KernelResources from the text of ``cuobjdump -res-usage``: lines
    ``Function <name>:`` each followed by ``REG:n STACK:n SHARED:n LOCAL:n ...``. With ``arch``
    (e.g. 'sm_90a'), only the ELF sections for that arch; a kernel listed in several sections
    keeps the largest of each figure. Unparseable lines are skipped (never raises on bad text)."""
    out: dict[str, KernelResources] = {}
    section_ok = True
    name = None
    for line in text.splitlines():
        m = _ARCH.match(line)
        if m:
            section_ok = arch is None or m.group(1) == arch
            name = None
            continue
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1) if section_ok else None
            continue
        if name is None:
            continue
        fields = {k: int(v) for k, v in _FIELD.findall(line)}
        if "REG" in fields:
            new = KernelResources(fields.get("REG", 0), fields.get("STACK", 0), fields.get("SHARED", 0),
                                  fields.get("LOCAL", 0))
            old = out.get(name)
            if old is not None:
                new = KernelResources(*(max(a, b) for a, b in zip(
                    (old.regs, old.stack, old.shared, old.local), (new.regs, new.stack, new.shared, new.local),
                    strict=True)))
            out[name] = new
            name = None
    return out


@functools.cache
def find_cuobjdump() -> str | None:
    """The CUDA toolkit's cuobjdump: next to nvcc in CUDA_HOME (as torch.utils.cpp_extension
    finds it), else on PATH, else beside the nvcc on PATH; None when absent."""
    try:  # lazy: torch (and its cpp_extension) only when a resource report is asked for
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:  # an odd torch install only loses the resource report
        CUDA_HOME = None
    homes = [CUDA_HOME, env.cuda_home()]
    for home in homes:
        if home and (Path(home) / "bin" / "cuobjdump").is_file():
            return str(Path(home) / "bin" / "cuobjdump")
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc:
        beside = Path(nvcc).resolve().parent / "cuobjdump"
        if beside.is_file():
            return str(beside)
    return None


def resource_usage(lib_path: Path | str, arch: str | None = None) -> dict[str, KernelResources] | None:
    """Resources of every kernel in a built library (``parse_res_usage`` of ``cuobjdump
    -res-usage``); None when cuobjdump is missing or fails (resources unknown)."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    try:
        res = subprocess.run([tool, "-res-usage", str(lib_path)], check=False, capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return parse_res_usage(res.stdout, arch)


def main_kernel(resources: dict[str, KernelResources] | None, kind: str) -> KernelResources | None:
    """The figures of ``kind``'s main kernel (flashgen::cuda::fwd_kernel / bwd_kernel; the
    largest of each figure over its instantiations), None when unknown."""
    if not resources:
        return None
    name = f"{kind}_kernel"
    pat = re.compile(rf"(?<![0-9]){len(name)}{name}I")
    hits = [r for n, r in resources.items() if pat.search(n)]
    if not hits:
        return None
    return KernelResources(max(r.regs for r in hits), max(r.stack for r in hits), max(r.shared for r in hits),
                           max(r.local for r in hits))
