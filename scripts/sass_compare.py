"""Compare the CUDA code two checkouts compile to: registers, spills and SASS instruction counts
per kernel for a fixed set of renders, as a markdown table.

    python scripts/sass_compare.py BEFORE AFTER [-o docs/cpp-roles-sass.md] [-j 2]

BEFORE / AFTER: a git ref of this repository (extracted with git archive) or a checkout
directory ("." is the working tree). Each side renders its own templates with its own flashgen
package (PYTHONPATH), then compiles every case with nvcc (the flags of tests/test_nvcc.py plus
-Xptxas -v) and disassembles it with cuobjdump. Needs nvcc, cuobjdump, c++filt and the Python
packages flashgen renders with (jinja2, lark, torch). Results of a git ref are cached under
--cache by tree hash, so rerunning against a fixed BEFORE only compiles AFTER.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (spec, kind, dtype, head dim, config, archs): padded renders as in generated/, packed and
# block-sparse ones as ops.instantiation asks for them (tests/test_nvcc.py PACKED), the tiles of
# the sm_90a table.
CASES = [
    ("dense", "fwd", "bf16", 128, {}, ("90a", "80")),
    ("causal", "fwd", "fp16", 64, {}, ("90a",)),
    ("causal", "bwd", "bf16", 128, {}, ("90a", "80")),
    ("alibi", "bwd", "bf16", 128, {}, ("90a",)),
    ("gemma", "fwd", "bf16", 64, {}, ("90a",)),
    ("dropout", "bwd", "bf16", 128, {}, ("90a",)),
    ("document", "fwd", "bf16", 128, {"sparse": 1}, ("90a",)),
    ("causal", "fwd", "bf16", 72, {"varlen": 1}, ("90a",)),
    ("alibi", "bwd", "bf16", 128, {"sparse": 1, "varlen": 1}, ("90a",)),
    ("document", "mask", "bf16", None, {"mask": 1}, ("90a",)),
]

RENDER = r"""
import json, sys
# Drop an editable install's finder (it maps flashgen.templates to its own checkout), so that
# flashgen and its templates both come from the checkout on PYTHONPATH.
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()
                 and "editable" not in type(f).__module__.lower()]
import flashgen
from flashgen import paths
assert str(paths.templates_dir()).startswith(sys.argv[2]), (paths.templates_dir(), sys.argv[2])
try:  # the package layout with lang/ and build/
    from flashgen.build.artifact import Instantiation, Target
    from flashgen.lang import frontend, ir
except ImportError:  # a checkout from before it
    from flashgen.build import Instantiation, Target
    from flashgen import frontend, ir
assert flashgen.__file__.startswith(sys.argv[2]), (flashgen.__file__, sys.argv[2])
spec, kind, dtype, hd, config, out = json.loads(sys.argv[1])
# Target(family, arch, device) since kernel families; Target(backend, arch) before
target = Target("sm80", "sm_90a", "cuda") if "family" in Target.__dataclass_fields__ else Target("cuda", "sm_90a")
inst = Instantiation(frontend.parse(f"specs/{spec}.attn"), target, ir.DType(dtype), hd, tuple(config.items()))
open(out, "w").write(inst.sources()[inst.source_name(kind)])
"""

# One SASS instruction line: /*0a70*/  [@!P0] OPCODE.MODS operands ;
SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\S*)(.*?);")
FAMILIES = ("HMMA", "LDSM", "LDGSTS", "MUFU", "BAR")


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    here = Path(sys.executable).resolve().parent.parent
    for cand in [Path("/usr/local/cuda/bin") / name, *here.glob(f"lib/python3*/site-packages/nvidia/*/bin/{name}")]:
        if cand.exists():
            return str(cand)
    raise SystemExit(f"{name} not found")


def case_id(case) -> str:
    spec, kind, dtype, hd, config, _ = case
    extra = "".join(f"-{k}" for k in sorted(config) if k != "mask")
    return f"{spec}-{kind}-{dtype}" + (f"-hd{hd}" if hd else "") + extra


def materialize(ref: str, work: Path) -> tuple[Path, str | None]:
    """The checkout directory of `ref` and its cache key (a tree hash; None for a directory)."""
    if Path(ref).is_dir():
        return Path(ref).resolve(), None
    tree = subprocess.run(["git", "-C", str(ROOT), "rev-parse", f"{ref}^{{tree}}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dest = work / tree
    if not dest.exists():
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", tree], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest, tree


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def label(demangled: str) -> str:
    """A name stable across the refactor: the kernel template and, for the main backward kernel,
    whether it issues the dQ atomics."""
    base = demangled.split("<", 1)[0].split("::")[-1].split("(")[0]
    if base == "bwd_kernel":
        m = re.search(r"BwdTile<[^>]*>, (true|false)", demangled)
        return f"bwd_kernel[{'dq atomics' if m and m.group(1) == 'true' else 'deterministic'}]"
    return base


def parse_ptxas(stderr: str) -> dict[str, dict]:
    res, cur = {}, None
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur is not None:
            cur.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["regs"] = int(m.group(1))
    return res


def parse_sass(text: str) -> dict[str, dict]:
    res, cur, body = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = res.setdefault(m.group(1), {"instrs": 0, **{f: 0 for f in FAMILIES}})
            body = cur["_body"] = []
            continue
        m = SASS_LINE.match(line)
        if m and cur is not None:
            op = m.group(1)
            if op == "NOP":
                continue  # alignment padding
            cur["instrs"] += 1
            for f in FAMILIES:
                if op == f:
                    cur[f] += 1
            body.append(line.split("/*", 2)[-1].split("*/", 1)[-1].strip())
    for v in res.values():
        v["sass_sha"] = hashlib.sha256("\n".join(v.pop("_body")).encode()).hexdigest()[:12]
    return res


def compile_case(checkout: Path, case, arch: str, tmp: Path, nvcc: str, cuobjdump: str) -> dict:
    spec, kind, dtype, hd, config, _ = case
    src = tmp / f"{case_id(case)}-{arch}.cu"
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run([sys.executable, "-c", RENDER, json.dumps([spec, kind, dtype, hd, config, str(src)]), str(checkout)],
                   cwd=checkout, env=env, check=True)
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    obj = src.with_suffix(".o")
    cmd = ["nice", nvcc, "-c", "-std=c++17", "-O3", "--use_fast_math", *COMMON_NVCC_FLAGS,
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
           "-I", str(checkout / "templates" / "include"), "-o", str(obj), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{r.stderr}")
    ptxas = parse_ptxas(r.stderr)
    sass = parse_sass(subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True,
                                     check=True).stdout)
    names = sorted(set(ptxas) | set(sass))
    dm = demangle(names)
    out = {}
    for n in names:
        key = label(dm[n])
        i = 2
        while key in out:  # two instantiations of one template: number them in name order
            key = f"{label(dm[n])}#{i}"
            i += 1
        out[key] = {**ptxas.get(n, {}), **sass.get(n, {})}
    return out


def measure(ref: str, work: Path, cache: Path, jobs: int) -> dict:
    checkout, tree = materialize(ref, work)
    cfile = cache / f"{tree}.json" if tree else None
    if cfile and cfile.exists():
        return json.loads(cfile.read_text())
    nvcc, cuobjdump = tool("nvcc"), tool("cuobjdump")
    tmp = Path(tempfile.mkdtemp(prefix="sass-", dir=work))
    jobs_list = [(c, a) for c in CASES for a in c[5]]
    with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
        futs = {(case_id(c), a): ex.submit(compile_case, checkout, c, a, tmp, nvcc, cuobjdump) for c, a in jobs_list}
        res = {f"{k[0]} sm_{k[1]}": f.result() for k, f in futs.items()}
    if cfile:
        cache.mkdir(parents=True, exist_ok=True)
        cfile.write_text(json.dumps(res, indent=1))
    return res


def pct(a, b) -> str:
    if a == b:
        return "0"
    return f"{100.0 * (b - a) / a:+.2f}%" if a else "new"


def table(before: dict, after: dict, names: tuple[str, str]) -> str:
    lines = [f"Before: `{names[0]}`, after: `{names[1]}`. Spills: spill stores / spill loads (bytes). "
             "Instructions exclude NOP padding; `same SASS` compares the instruction text "
             "(opcodes and operands) line by line.", "",
             "| render | kernel | regs | spills | SASS instrs (Δ) | HMMA | LDSM | LDGSTS | MUFU | BAR | same SASS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in sorted(set(before) | set(after), key=lambda c: list(before).index(c) if c in before else 1e9):
        kb, ka = before.get(case, {}), after.get(case, {})
        for k in sorted(set(kb) | set(ka)):
            b, a = kb.get(k, {}), ka.get(k, {})

            def pair(f):
                x, y = b.get(f, "–"), a.get(f, "–")
                return f"{x}" if x == y else f"{x} → {y}"

            sp = lambda d: f"{d.get('spill_st', '–')}/{d.get('spill_ld', '–')}" if d else "–"
            spills = sp(b) if sp(b) == sp(a) else f"{sp(b)} → {sp(a)}"
            instrs = pair("instrs") + (f" ({pct(b['instrs'], a['instrs'])})" if b and a and b["instrs"] != a["instrs"] else "")
            same = "yes" if b and a and b.get("sass_sha") == a.get("sass_sha") else "no"
            lines.append(f"| {case} | {k} | {pair('regs')} | {spills} | {instrs} | "
                         + " | ".join(pair(f) for f in FAMILIES) + f" | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("-o", "--out", type=Path, help="write the table here (default: stdout)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "flashgen-sass")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "flashgen-sass" / "cache")
    ap.add_argument("--json", type=Path, help="also dump both sides' raw numbers here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    before = measure(args.before, args.work, args.cache, args.jobs)
    after = measure(args.after, args.work, args.cache, args.jobs)
    if args.json:
        args.json.write_text(json.dumps({"before": before, "after": after}, indent=1))
    text = table(before, after, (args.before, args.after))
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
