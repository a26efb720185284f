"""Writing ahead-of-time kernel directories (``flashgen build SPEC... --out DIR``): which
instantiations a build holds (``plan``), compiling them and copying them with the tuning they
follow into the directory, and its ``index.json`` (``build_dir``). The directory format and
the lookup are flashgen/build/aot.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import filelock
import torch

from .. import families, tiles
from ..archs import cuda_arch
from ..build import aot, artifact, cache
from ..errors import BuildError, UntrustedPathError
from ..paths import write_json_atomic
from ..runtime.checks import as_dtype, ranges_text
from ..runtime.op import AttentionOp
from ..runtime.op import compile as compile_spec
from ..tune import store as tune_store


@dataclass(frozen=True)
class Planned:
    """One instantiation of a build: the spec's op, the instantiation, the CUDA device whose
    tuning it follows (None: no such GPU here, or CPU), and where its tiles came from."""

    op: object  # flashgen.ops.AttentionOp
    inst: artifact.Instantiation
    device_index: int | None = None
    origin: tuple[str, str] | None = None
    tuned_seqlen: tuple[int | None, int | None] | None = None


def _gpus() -> dict[str, int]:
    """Architecture -> index of the first local CUDA device of it."""
    if not torch.cuda.is_available():
        return {}
    out: dict[str, int] = {}
    for i in range(torch.cuda.device_count()):
        out.setdefault(cuda_arch(torch.cuda.get_device_capability(i)), i)
    return out


def targets(device=None, arches: Iterable[str] = ()) -> list[tuple[str, str, int | None]]:
    """(backend, arch, CUDA device index or None) to build for. ``arches``: CUDA architectures
    (sm_80, sm_90a, ...; a local GPU of that architecture lends its tuning); ``device``: 'cpu'
    adds the CPU, 'cuda[:N]' that GPU's architecture (or, with ``arches``, the GPU to prefer for
    its own architecture). Neither: the CPU. ValueError for an unknown architecture or device,
    or a CUDA device on a machine without one."""
    arches = [arches] if isinstance(arches, str) else list(arches or ())
    out: list[tuple[str, str, int | None]] = []
    gpus: dict[str, int] | None = None
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cpu":
            out.append(("cpu", artifact.cpu_arch(), None))
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device: {device}: CUDA is not available here (use --arch to build for an "
                                 "architecture without its GPU)")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            arch = artifact.cuda_arch_of(index)
            gpus = {arch: index} | {a: i for a, i in _gpus().items() if a != arch}
            if not arches:
                out.append(("cuda", arch, index))
        else:
            raise ValueError(f"device: '{dev.type}' is not supported (expected cpu or cuda)")
    if arches:
        gpus = _gpus() if gpus is None else gpus
        for a in arches:
            arch = tiles.normalize_arch(a)
            out.append(("cuda", arch, gpus.get(arch)))
    if not out:
        out.append(("cpu", artifact.cpu_arch(), None))
    return list(dict.fromkeys(out))


def _as_op(spec):
    return spec if isinstance(spec, AttentionOp) else compile_spec(spec)


def plan(specs: Iterable, *, device=None, arches: Iterable[str] = (), dtypes: Iterable | None = None,
         head_dims: Iterable[int] | None = None, layouts: Iterable[str] = ("padded",),
         sparse: Iterable[bool] | bool = (False,), decode: bool = True) -> list[Planned]:
    """The instantiations ``build_dir`` compiles (see there for the arguments); computes no
    cache key and compiles nothing. Raises SpecError for a bad spec, ValueError / TypeError for
    bad arguments (naming them)."""
    ops = [_as_op(s) for s in ([specs] if isinstance(specs, str | Path) else specs)]
    if not ops:
        raise ValueError("specs: none given")
    tgts = targets(device, arches)
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    for lay in layouts:
        if lay not in ("padded", "packed"):
            raise ValueError(f"layouts: unknown layout {lay!r} (expected 'padded' and/or 'packed')")
    packs = sorted({lay == "packed" for lay in layouts}) or [False]
    sparse = (sparse,) if isinstance(sparse, bool) else tuple(sparse)
    if not all(isinstance(x, bool) for x in sparse):
        raise TypeError(f"sparse: expected bools, got {sparse!r}")
    if not isinstance(decode, bool):
        raise TypeError(f"decode: expected a bool, got {decode!r}")
    want_dts = [as_dtype(d) for d in dtypes] if dtypes is not None else None
    want_hds = list(head_dims) if head_dims is not None else None
    out: dict[artifact.Instantiation, Planned] = {}

    def add(p: Planned) -> None:
        out.setdefault(p.inst, p)

    for op in ops:
        spec = op.spec
        for backend, arch, index in tgts:
            dts = want_dts if want_dts is not None else list(op.dtypes(backend))
            if not dts:
                raise ValueError(f"spec '{spec.name}' allows no dtype on {backend} (its dtype line: "
                                 f"{', '.join(d.value for d in spec.dtypes or ())})")
            for dt in dts:
                if dt not in op.dtypes(backend):
                    raise ValueError(f"dtypes: {dt.value} is not supported by spec '{spec.name}' on {backend} "
                                     f"(it allows {', '.join(d.value for d in op.dtypes(backend)) or 'none'})")
            fams = families.for_arch_all(backend, arch)
            alone = len(fams) == 1  # forced, or the only family there: what it cannot serve is an error
            for part in (f for f in fams if not families.complete(f)):
                # A partial family (sm90: the padded forward) gets what it serves of the request,
                # with its own tiles; forced alone, a request it cannot serve is refused.
                part_hds = want_hds if want_hds is not None else [d for d in (64, 128) if d in op.head_dims(part)]
                if alone:
                    bad = [d for d in part_hds if d not in op.head_dims(part)]
                    if bad:
                        raise ValueError(f"head_dims: {bad[0]} is not served by family {part.name} (it serves "
                                         f"{ranges_text(op.head_dims(part))})")
                    if ("packed" in layouts and "varlen" not in part.features) or \
                            (True in sparse and "sparse" not in part.features):
                        raise ValueError(f"layouts / sparse: family {part.name} has no "
                                         + ("packed" if "packed" in layouts else "block-sparse") + " kernels")
                # the requested layouts and sparsities it serves, and block lists per call where
                # the spec needs them
                part_lays, part_sps = part.served(layouts, sorted(set(sparse) | ({True} if op.auto_sparse
                                                                                  and part.block_classifier else set())))
                part_pks = sorted({lay == "packed" for lay in part_lays})
                if part_pks:
                    for dt in dts:
                        for hd in part_hds:
                            if dt in op.dtypes(part) and hd in op.head_dims(part):
                                for pk in part_pks:
                                    for sp in part_sps:
                                        for inst, origin, tuned in _tuned_instantiations(op, part, arch, index, dt,
                                                                                         hd, pk, sp):
                                            add(Planned(op, inst, index, origin, tuned))
                    if True in part_sps:
                        add(Planned(op, part.classifier(spec, arch), index))
            if not families.complete(fams[-1]):
                continue
            fam = fams[-1]  # the complete family
            if fam.runtime_head_dim:
                for dt in dts:
                    add(Planned(op, fam.instantiation(spec, arch, dt, None)))
                continue
            allowed = op.head_dims("cuda")
            if want_hds is not None:
                for hd in want_hds:
                    if hd not in allowed:
                        raise ValueError(f"head_dims: {hd} is not supported by spec '{spec.name}' on cuda "
                                         f"(expected one of {ranges_text(allowed)})")
                hds = want_hds
            else:
                hds = [d for d in (64, 128) if d in allowed] or list(allowed)
            sps = sorted(set(sparse) | ({True} if op.auto_sparse else set()))
            for dt in dts:
                for hd in hds:
                    lens: list[int | None] = [None]
                    if index is not None:
                                            lens += sorted({n for kind in ("fwd", "bwd")
                                        for n in tune_store.tuned_seqlens(op.fingerprint, index, dt, hd, kind)})
                    for pk in packs:
                        for sp in sps:
                            choices = [tiles.choose(spec, arch, dt, hd, n, device_index=index,
                                                    fingerprint=op.fingerprint) for n in (lens if not sp else [None])]
                            if index is not None and len(lens) > 1:  # a GPU whose tuning does not apply
                                choices.append(tiles.choose(spec, arch, dt, hd, None, device_index=index,
                                                            use_tuned=False))
                            for ch in choices:
                                inst = fam.instantiation(spec, arch, dt, hd, packed=pk, sparse=sp, tiles=ch.config())
                                add(Planned(op, inst, index,
                                            (ch.fwd_origin, ch.bwd_origin), ch.tuned_seqlen))
            if True in sps:  # the block classifier (one per spec and arch, as ops.mask_library)
                add(Planned(op, fam.classifier(spec, arch), index))
            if decode:  # op.with_kvcache's library of its own (sm80), where a family of the target serves it
                for dt in dts:
                    for hd in hds:
                        inst = families.decode_instantiation(spec, fams, arch, dt, hd)
                        if inst is not None:
                            add(Planned(op, inst))
    return list(out.values())


def _tuned_instantiations(op, fam, arch: str, index: int | None, dt, hd: int, pk: bool, sp: bool) -> list:
    """(instantiation, (fwd origin, bwd origin), tuned lengths) of a partial family's calls at
    (dt, hd, layout, sparsity): untuned families their default; a tuned one (sm90's forward)
    each tuned length's choice on the local GPU ``index`` (block-sparse calls: the longest
    length's) and the untuned default beside them."""
    if not fam.tuned:
        return [(fam.instantiation(op.spec, arch, dt, hd, packed=pk, sparse=sp), None, None)]
    lens: list[int | None] = [None]
    if index is not None and not sp:
        lens += sorted({n for kind in fam.tuning.kinds
                        for n in tune_store.tuned_seqlens(op.fingerprint, index, dt, hd, kind, fam.name)})
    choices = [fam.choose_tiles(op.spec, arch, dt, hd, n, sparse=sp, device_index=index, fingerprint=op.fingerprint)
               for n in lens]
    if index is not None:  # a GPU whose tuning does not apply: the family default too
        choices.append(fam.choose_tiles(op.spec, arch, dt, hd, None, sparse=sp, device_index=index, use_tuned=False))
    out = []
    for ch in choices:
        inst = fam.instantiation(op.spec, arch, dt, hd, packed=pk, sparse=sp, tiles=ch.config())
        out.append((inst, (ch.origin, None), (ch.tuned_seqlen, None)))
    return out


# ---------------------------------------------------------------- writing a directory


def _entry(p: Planned, folder: Path, sha256: str) -> dict:
    inst = p.inst
    cfg = dict(inst.config)
    e = {
        "variant": inst.variant_id(),
        "artifact": folder.name,
        "sha256": sha256,
        "spec": inst.spec.name,
        "fingerprint": inst.spec.fingerprint(),
        "target": [inst.target.family, inst.target.arch, inst.target.device],
        "dtype": inst.dtype.value,
        "head_dim": inst.head_dim,
        "config": cfg,
        "kinds": list(inst.kinds),
        "key": inst.key,
    }
    if inst.target.backend == "cuda":
        e["cuda"] = artifact.cuda_version()
        if p.origin is not None:
            e["tiles_origin"] = list(p.origin)
            e["tuned_seqlen"] = list(p.tuned_seqlen or (None, None))
    return e


def _copy_artifact(src: Path, out: Path, name: str) -> tuple[Path, str]:
    """Copy the cache entry ``src`` to ``out/name`` (replacing it) by one rename; (path, sha256).
    BuildError when the copy does not verify against the entry's manifest."""
    dest = out / name
    if dest.exists() and os.path.samefile(src, dest):
        return dest, cache.sha256_of(dest / "lib.so")
    tmp = out / f".{name}-{uuid.uuid4().hex[:8]}.tmp"
    shutil.copytree(src, tmp)
    cache.owner_only(tmp)
    sha = cache.sha256_of(tmp / "lib.so")
    try:
        manifest = json.loads((tmp / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("sha256") != sha:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{src}: lib.so does not match its manifest; it changed while being copied")
    if dest.exists():
        old = out / f".{name}-{uuid.uuid4().hex[:8]}.old"
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dest)
    return dest, sha


def _update_index(out: Path, new: list[dict]) -> dict:
    path = out / aot.INDEX
    entries: dict[str, dict] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        problem = aot.mismatch(data)
        if problem:
            warnings.warn(f"flashgen: {path}: {problem}; starting a new index (its old entries are dropped)",
                          aot.AOTWarning, stacklevel=3)
        else:
            entries = {e["variant"]: e for e in data["entries"] if isinstance(e, dict) and "variant" in e}
    for e in new:
        entries[e["variant"]] = e
    ordered = sorted(entries.values(), key=lambda e: (e.get("spec", ""), e.get("target", []), e.get("dtype", ""),
                                                      e.get("head_dim") or 0, e.get("artifact", "")))
    data = aot.runtime() | {"entries": ordered}
    write_json_atomic(path, data)
    return data


def _copy_tuning(out: Path, planned: list[Planned]) -> list[Path]:
    """Copy the tuned winners of the built (spec, dtype, head dim)s of each local GPU into
    ``out/tuning/`` (merged with what is there under the same metadata)."""
    keys: dict[int, set[str]] = {}
    for p in planned:
        inst = p.inst
        if p.device_index is None or inst.head_dim is None:
            continue
        fam = families.get(inst.target.family)
        if fam.tuning is None:
            continue
        for kind in fam.tuning.kinds:  # the keys of the family that built it
            keys.setdefault(p.device_index, set()).add(tune_store.entry_key(p.op.fingerprint, inst.dtype, inst.head_dim,
                                                                            kind, fam.name))
    written = []
    for index, want in sorted(keys.items()):
        stored = tune_store.entries(index)
        picked = {k: {str(n): r for n, r in sorted(stored[k].items())} for k in sorted(want) if stored.get(k)}
        if not picked:
            continue
        meta = tune_store.meta(index)
        path = out / "tuning" / tune_store.store_path(index).name
        cache.private_dir(path.parent)
        merged = tune_store.read_file(path, meta) if path.exists() else {}
        for k, per_n in picked.items():
            merged.setdefault(k, {}).update(per_n)
        write_json_atomic(path, {"meta": meta, "entries": merged})
        written.append(path)
    return written


def build_dir(specs: Iterable, out: str | Path, *, device=None, arches: Iterable[str] = (),
              dtypes: Iterable | None = None, head_dims: Iterable[int] | None = None,
              layouts: Iterable[str] = ("padded",), sparse: Iterable[bool] | bool = (False,),
              decode: bool = True, jobs: int | None = None,
              announce: Callable[[str], None] | None = None) -> list[dict]:
    """Compile the kernels of ``specs`` into the ahead-of-time directory ``out`` and add them to
    its ``index.json`` (an existing directory keeps its other entries; a variant built again
    replaces its entry).

    Args:
        specs: spec paths, spec texts, ``ir.Spec``s or ``AttentionOp``s.
        out: the directory (created if missing).
        device: 'cpu' and/or (without ``arches``) 'cuda[:N]' for that GPU's architecture.
        arches: CUDA architectures (sm_80, sm_90a, ...) to build for, present or not; where a
            local GPU has the architecture, its tuned tiles apply and its tuning entries are
            copied to ``out/tuning/``. Neither device nor arches: the CPU.
        dtypes: default every dtype the spec allows on each backend.
        head_dims: CUDA head dims (default those of 64 and 128 the spec allows); ignored on CPU.
        layouts: 'padded' and/or 'packed' (CUDA; the CPU kernels take both).
        sparse: False and/or True: dense and/or block-sparse CUDA kernels; True adds the block
            classifier. Specs whose mask makes CUDA calls build block lists per call
            (``AttentionOp.auto_sparse``) always get the block-sparse kernels and the classifier.
        decode: True (default): also the decode kernels (``op.with_kvcache``) of each CUDA
            (dtype, head dim) a family of the target has them for (sm80's, one unit each, which
            serve Hopper too); False leaves them out (a prefill-only directory). The CPU's decode
            calls run in its forward library: nothing more to build there.
        jobs: instantiations compiled at once (default: one per CPU core, at most all).
        announce: called with a message before each compile (a cache miss).

    Compiles through the build cache (FLASHGEN_CACHE_DIR) whatever FLASHGEN_JIT says, then
    copies each entry. Everything written is owner-only (folders 0700, files 0600 or 0700)
    whatever the umask, and a directory ``out`` that existed loses group and other write
    access: a process loads libraries only from a directory no other user can write
    (flashgen.build.aot). Returns the index entries written.

    Raises:
        SpecError: a spec does not parse or validate.
        ValueError / TypeError: bad arguments (naming them).
        BuildError: a compile failed, or ``out`` exists and is owned by another user (nothing
            is written into it).
    """
    planned = plan(specs, device=device, arches=arches, dtypes=dtypes, head_dims=head_dims, layouts=layouts,
                   sparse=sparse, decode=decode)
    out = Path(out)
    cache.check_toolchain(p.inst.target for p in planned)  # before DIR is created
    existed = out.is_dir()
    problem = cache.owner_problem(out) if existed else None
    if problem:  # its owner could replace what we write: a load would refuse it
        raise UntrustedPathError(f"refusing to write kernels into {out}: it {problem}, so that user could replace "
                                 "them (and processes loading from it refuse it)\n  fix: choose a directory of your "
                                 "own for --out")
    cache.private_dir(out)
    if existed and os.stat(out).st_mode & 0o022:
        os.chmod(out, os.stat(out).st_mode & 0o7755)
    with ThreadPoolExecutor(max_workers=jobs or max(1, min(len(planned), os.cpu_count() or 1))) as pool:
        libs = list(pool.map(lambda p: cache.load_cached(p.inst, announce), planned))
    with filelock.FileLock(str(out / ".index.lock"), mode=0o600):
        entries = []
        for p, lib in zip(planned, libs, strict=True):
            folder, sha = _copy_artifact(lib.path.parent, out, p.inst.name)
            entries.append(_entry(p, folder, sha))
        _copy_tuning(out, planned)
        _update_index(out, entries)
    aot.forget(out)
    if any(p.device_index is not None for p in planned):
            tune_store.reload()
    return entries
