"""Golden renders: ``flashgen generate specs/*.attn`` writes every spec's rendered translation
units (the CPU family's per dtype, sm80's and sm90's at head dims 64 and 128 or the spec's own,
and sm80's decode units at those of them its decode kernels take) into ``generated/<spec>/``, so a
template change shows up as a reviewable diff; tests/test_codegen.py fails when they are stale.
"""

from __future__ import annotations

from pathlib import Path

from .. import families
from ..families import sm80
from ..lang import frontend
from ..runtime.checks import spec_dtypes


def generated_files(spec_path: Path) -> dict[str, str]:
    """File name → text of everything ``generate`` writes for one spec (its generated/ folder)."""
    spec = frontend.parse(spec_path)
    files = {}
    cpu, cuda = families.get("cpu"), families.get("sm80")
    for dt in spec_dtypes(spec, cpu):
        files.update(cpu.instantiation(spec, "any", dt, None).sources())
    for dt in spec_dtypes(spec, cuda):
        for hd in spec.head_dims or (64, 128):
            files.update(cuda.instantiation(spec, "any", dt, hd).sources())
            if hd in sm80.DECODE_HEAD_DIMS:
                files.update(cuda.decode_instantiation(spec, "any", dt, hd).sources())
    hopper = families.get("sm90")  # its units are named like sm80's: prefixed with the family here
    for dt in spec_dtypes(spec, hopper):
        for hd in [d for d in (spec.head_dims or (64, 128)) if d in hopper.head_dims]:
            files.update({f"sm90_{k}": v for k, v in hopper.instantiation(spec, "any", dt, hd).sources().items()})
    return files


def generate(spec_paths: list[Path], out_root: Path) -> list[Path]:
    """Render each spec into ``out_root/<spec name>/``; writes only files that changed and removes
    files no longer generated. Returns the paths written."""
    written = []
    for sp in spec_paths:
        name = frontend.parse(sp).name
        folder = out_root / name
        folder.mkdir(parents=True, exist_ok=True)
        files = generated_files(sp)
        for fname, text in files.items():
            path = folder / fname
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                written.append(path)
        for stale in folder.iterdir():
            if stale.name not in files and stale.is_file():
                stale.unlink()
                written.append(stale)
    return written
