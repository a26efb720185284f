"""A cache that cannot be turned against its user: owner-only roots, entries and ahead-of-time
directories, refused loads from paths another user could change, stale build folders swept,
damaged entries and files in an entry's place rebuilt with a message, a wait for another
process announced, a full disk and a read-only root reported as BuildErrors.

No test here starts the compiler: "building" copies the causal spec's fp32 CPU library (which
other tests compile too), so every path of the build and publish step runs, in well under a
second."""

import errno
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import filelock
import pytest
import torch.utils.cpp_extension as ce

import flashgen
from flashgen.build import aot, cache
from flashgen.errors import BuildError, UntrustedPathError
from flashgen.lang import ir
from flashgen.runtime import loader
from flashgen.tools import aot_build

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "causal.attn"


@pytest.fixture(scope="module")
def real():
    """(instantiation, a copy of its compiled lib.so): the causal spec's fp32 CPU kernel."""
    op = flashgen.compile(SPEC)
    inst = op.instantiation("cpu", ir.DType.FP32, 64)
    return op, inst, loader.load(inst).path


@pytest.fixture
def fake_compile(real, monkeypatch, tmp_path):
    """The compiler replaced by a copy of the real library into the build folder; yields the
    cache root (FLASHGEN_CACHE_DIR, not yet created) and the list of announcements."""
    _, inst, lib = real
    builds = []

    def load(name, sources, build_directory, **kw):
        assert all(Path(s).is_file() for s in sources)
        out = Path(build_directory) / f"{name}.so"
        shutil.copyfile(lib, out)
        builds.append(build_directory)
        return str(out)

    monkeypatch.setattr(ce, "load", load)
    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    yield root, builds


def load(inst, said=None):
    return cache.load_cached(inst, said.append if said is not None else None)


def publish(inst, root: Path) -> Path:
    """A cache entry of ``inst`` under ``root``, built but not loaded (a library this process
    mapped must not be changed under it)."""
    cache.private_dir(root)
    cache._build_and_publish(inst, root / inst.name)
    return root / inst.name


def modes(top: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(top).st_mode)}
    for parent, dirs, files in os.walk(top):
        for n in (*dirs, *files):
            p = Path(parent) / n
            out[str(p.relative_to(top))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def foreign(path: Path, monkeypatch) -> None:
    """Make ``path`` look owned by another user: chown it where we may (root), else pretend to
    be someone else."""
    if os.geteuid() == 0:
        os.chown(path, 4242, -1)
    else:
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def test_root_and_entries_are_owner_only_whatever_the_umask(real, fake_compile, umask0):
    _, inst, _ = real
    root, builds = fake_compile
    lib = load(inst)
    assert lib.path == root / inst.name / "lib.so" and len(builds) == 1
    found = modes(root)
    assert found["."] == 0o700 and found[inst.name] == 0o700
    assert not [(p, oct(m)) for p, m in found.items() if m & 0o077], found
    assert found[f"{inst.name}/lib.so"] & 0o600 == 0o600


@pytest.mark.parametrize("where", ["root", "entry", "lib.so"])
@pytest.mark.parametrize("how", ["writable", "owner"])
def test_library_another_user_could_replace_is_refused(real, fake_compile, monkeypatch, where, how):
    _, inst, _ = real
    root, builds = fake_compile
    publish(inst, root)
    path = {"root": root, "entry": root / inst.name, "lib.so": root / inst.name / "lib.so"}[where]
    if how == "writable":
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o002)
    else:
        foreign(path, monkeypatch)
    with pytest.raises(UntrustedPathError) as e:
        load(inst)
    text = str(e.value)
    assert text.startswith(f"refusing to load {inst.name}: {path} is ")
    assert ("writable by others" if how == "writable" else "is owned by uid") in text
    assert "fix: " in text and ("chmod go-w" if how == "writable" else "remove it") in text
    assert "FLASHGEN_CACHE_DIR" in text and len(builds) == 1  # refused, not rebuilt


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder another group")
def test_group_writable_entry_is_refused_unless_the_group_is_private(real, fake_compile):
    _, inst, _ = real
    root, _ = fake_compile
    entry = publish(inst, root)
    os.chown(entry, -1, 4242)
    os.chmod(entry, 0o770)
    with pytest.raises(UntrustedPathError, match="is writable by its group"):
        load(inst)


def test_aot_directory_another_user_could_change_is_refused(real, fake_compile, monkeypatch, tmp_path, umask0):
    op, inst, _ = real
    out = tmp_path / "aot"
    aot_build.build_dir([op], out, device="cpu", dtypes=["fp32"])
    found = modes(out)
    assert found["."] == 0o700 and not [(p, oct(m)) for p, m in found.items() if m & 0o077], found
    aot.reload()
    assert aot.find(inst, [out])[0] is not None
    aot.reload()
    os.chmod(out / inst.name, 0o777)
    with pytest.raises(UntrustedPathError) as e:
        aot.find(inst, [out])
    assert f"{out / inst.name} is writable by others" in str(e.value) and "FLASHGEN_AOT_DIR" in str(e.value)
    aot.reload()
    os.chmod(out / inst.name, 0o700)
    foreign(out, monkeypatch)
    with pytest.raises(UntrustedPathError, match=f"{out} is owned by uid"):
        aot.find(inst, [out])
    aot.reload()


def test_stale_build_folders_are_swept_when_their_lock_is_free(real, fake_compile):
    _, inst, _ = real
    root, _ = fake_compile
    tmp = root / ".tmp"
    tmp.mkdir(parents=True)
    mine = tmp / f"{inst.name}-0badc0de"  # a killed build of this instantiation
    free = tmp / "fg_other_cpu_fp32_0123456789ab-12345678-publish"
    busy = tmp / "fg_busy_cpu_fp32_0123456789ab-87654321"
    for folder in (mine, free, busy):
        (folder / "src").mkdir(parents=True)
    with filelock.FileLock(str(root / "fg_busy_cpu_fp32_0123456789ab.lock")):
        held = threading.Thread(target=load, args=(inst,))  # locks are per file handle: another one
        held.start()
        held.join()
    assert not mine.exists() and not free.exists() and busy.exists()
    assert sorted(p.name for p in tmp.iterdir()) == [busy.name]


@pytest.mark.parametrize("damage", ["checksum", "file"])
def test_damaged_entry_says_so_and_is_rebuilt(real, fake_compile, damage):
    _, inst, _ = real
    root, builds = fake_compile
    entry = root / inst.name
    if damage == "checksum":
        publish(inst, root)
        (entry / "lib.so").write_bytes(b"not a library")
        why = "checksum mismatch"
    else:
        root.mkdir(mode=0o700)
        entry.write_text("a file where the entry's folder should be")
        why = "a file is where its folder should be"
    said = []
    lib = load(inst, said)
    assert said == [f"cache entry {entry} is damaged ({why}); rebuilding"]
    assert lib.path == entry / "lib.so" and cache._entry_ok(entry, inst.key)


def test_first_use_and_a_wait_for_another_process_are_announced(real, fake_compile):
    _, inst, _ = real
    root, _ = fake_compile
    root.mkdir(mode=0o700)
    said, done = [], []
    with filelock.FileLock(str(root / f"{inst.name}.lock")):
        t = threading.Thread(target=lambda: done.append(load(inst, said)))
        t.start()
        deadline = time.time() + 30
        while not said and time.time() < deadline:
            time.sleep(0.01)
        assert said == [f"waiting for another process building {inst.name} (lock {root / inst.name}.lock)"]
        assert not done
    t.join(30)
    assert done and said[1] == f"compiling {inst.name} (first use; cached in {root})"


@pytest.mark.parametrize("step", ["sources", "compiler", "copy", "manifest"])
def test_full_disk_gives_a_build_error_and_leaves_no_entry(real, fake_compile, monkeypatch, step):
    _, inst, _ = real
    root, _ = fake_compile

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / "x"))

    if step == "compiler":  # ninja reports the compiler's failed write
        monkeypatch.setattr(ce, "load", lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("Error building extension: fatal error: error writing to x.o: No space left on device")))
    elif step == "copy":
        monkeypatch.setattr(shutil, "copy2", full)
    else:
        real_write = Path.write_text
        target = "manifest.json" if step == "manifest" else ".cpp"

        def write_text(self, *a, **k):
            if self.name.endswith(target):
                full()
            return real_write(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(BuildError) as e:
        load(inst)
    assert str(e.value).startswith(f"failed to build {inst.name}: no space left on device")
    assert "FLASHGEN_CACHE_DIR" in str(e.value)
    assert not (root / inst.name).exists()
    assert not list((root / ".tmp").iterdir()) and not (root / "failed").exists()


def test_read_only_cache_root_names_flashgen_cache_dir(real, fake_compile, monkeypatch):
    _, inst, _ = real
    root, _ = fake_compile
    root.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root writes anywhere: refuse the lock file's creation as a read-only disk would
        real_open = os.open

        def ro_open(path, *a, **k):
            if str(path).startswith(str(root)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, *a, **k)

        monkeypatch.setattr(os, "open", ro_open)
    else:
        os.chmod(root, 0o500)
    try:
        with pytest.raises(BuildError) as e:
            load(inst)
    finally:
        os.chmod(root, 0o700)
    text = str(e.value)
    assert text.startswith(f"the kernel cache {root} is not writable (")
    assert f"FLASHGEN_CACHE_DIR is {root}" in text and "set FLASHGEN_CACHE_DIR to a writable directory" in text


def test_missing_compiler_is_the_first_line(real, monkeypatch, tmp_path):
    _, inst, _ = real
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(BuildError) as e:
        load(inst)
    assert str(e.value).splitlines()[0] == (f"no C++ compiler found: install g++ (a C++17 compiler with OpenMP) or "
                                            f"set CXX (CXX is '{tmp_path / 'no-such-g++'}', not found)")
    assert not (tmp_path / "cache" / inst.name).exists()


def test_compiler_that_does_not_run_is_a_build_error_naming_it(real, monkeypatch, tmp_path):
    """CXX that exists but fails when torch probes it (``CXX --version``): a BuildError saying so,
    not the probe's CalledProcessError traceback."""
    _, inst, _ = real
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(BuildError) as e:
        load(inst)
    assert "the C++ compiler does not run: `/bin/false" in str(e.value) and "CXX is '/bin/false'" in str(e.value)
    assert not (tmp_path / "cache" / inst.name).exists()


@pytest.mark.parametrize("output, first", [
    ("x.cpp:1:10: fatal error: omp.h: No such file or directory", "the C++ compiler has no OpenMP (omp.h not found)"),
    ("x.cpp:1:10: fatal error: 'omp.h' file not found", "the C++ compiler has no OpenMP (omp.h not found)"),
    ("clang: error: unsupported option '-fopenmp'", "the C++ compiler has no OpenMP (it does not take -fopenmp)"),
    ("/usr/bin/ld: cannot find -lgomp: No such file or directory",
     "the C++ compiler has no OpenMP (its OpenMP runtime library is not found)"),
    ("ld: library not found for -lomp", "the C++ compiler has no OpenMP (its OpenMP runtime library is not found)"),
    ("x.cpp:3:10: fatal error: 'Python.h' file not found", "Python's C headers (Python.h) not found"),
])
def test_compiler_output_naming_a_missing_prerequisite_is_the_first_line(real, fake_compile, monkeypatch, output,
                                                                         first):
    """g++'s and clang++'s words for a missing OpenMP or Python.h, as the compiler prints them."""
    _, inst, _ = real
    root, _ = fake_compile
    monkeypatch.setattr(ce, "load", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError(f"Error building extension 'x':\n[1/2] c++ ...\nFAILED: x.o\n{output}\nninja: build stopped")))
    with pytest.raises(BuildError) as e:
        load(inst)
    assert str(e.value).splitlines()[0].startswith(first), str(e.value)
    assert not (root / inst.name).exists()


def test_missing_ninja_and_nvcc_are_the_first_line(monkeypatch):
    import torch
    from torch.utils import cpp_extension

    from flashgen.build.artifact import Target

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "ninja" else which(name, *a, **k))
    with pytest.raises(BuildError, match=r"^ninja not found"):
        cache.check_toolchain([Target("cpu", "x86_64", "cpu")])
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(BuildError, match=r"^no CUDA compiler \(nvcc\) found: install the CUDA toolkit"):
        cache.check_toolchain([Target("sm80", "sm_80", "cuda")])


def test_missing_compiler_is_said_before_any_compiling_message(real, monkeypatch, tmp_path):
    _, inst, _ = real
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    said = []
    with pytest.raises(BuildError, match=r"^no C\+\+ compiler found"):
        load(inst, said)
    assert said == []


def test_full_disk_in_a_build_of_several_together(real, fake_compile, monkeypatch):
    _, inst, _ = real
    root, _ = fake_compile
    real_write = Path.write_text

    def write_text(self, *a, **k):
        if self.name.endswith(".cpp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(BuildError) as e:
        cache.load_together([inst])
    assert str(e.value).startswith("failed to build 1 instantiations together: no space left on device")
    assert "FLASHGEN_CACHE_DIR" in str(e.value) and not (root / inst.name).exists()


def test_cache_root_below_a_file_names_the_file(real, monkeypatch, tmp_path):
    _, inst, _ = real
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(BuildError) as e:
        load(inst)
    assert str(e.value).startswith(f"{tmp_path / 'file'}, a folder of the kernel cache {tmp_path / 'file' / 'cache'}, "
                                   "is a file, not a folder")


def test_aot_out_that_exists_is_made_unwritable_by_others_and_refused_if_not_ours(real, fake_compile, monkeypatch,
                                                                                   tmp_path):
    op, inst, _ = real
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o777)
    aot_build.build_dir([op], out, device="cpu", dtypes=["fp32"])
    assert stat.S_IMODE(os.stat(out).st_mode) & 0o022 == 0 and (out / inst.name / "lib.so").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    foreign(theirs, monkeypatch)
    with pytest.raises(UntrustedPathError) as e:
        aot_build.build_dir([op], theirs, device="cpu", dtypes=["fp32"])
    assert str(e.value).startswith(f"refusing to write kernels into {theirs}: it is owned by uid")
    assert "choose a directory of your own" in str(e.value) and not list(theirs.iterdir())
    aot.reload()
