"""Where the templates and kernel headers live: package data when installed, else the checkout."""

from __future__ import annotations

import functools
import json
import os
import stat
import uuid
from importlib import resources
from pathlib import Path


@functools.cache
def templates_dir() -> Path:
    """The ``templates/`` directory (Jinja2 templates and ``include/flashgen/*`` headers)."""
    try:
        found = Path(str(resources.files("flashgen.templates")))
        if (found / "include").is_dir():
            return found
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parent.parent / "templates"
    if (checkout / "include").is_dir():
        return checkout
    raise FileNotFoundError("flashgen templates not found: reinstall flashgen (package data missing)")


@functools.cache
def specs_dir() -> Path:
    """The ``specs/`` directory (the example specs, which flashgen.integrations also uses)."""
    try:
        found = Path(str(resources.files("flashgen.specs")))
        if (found / "causal.attn").is_file():
            return found
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parent.parent / "specs"
    if (checkout / "causal.attn").is_file():
        return checkout
    raise FileNotFoundError("flashgen specs not found: reinstall flashgen (package data missing)")


def example_spec(name: str) -> Path:
    """A spec file named on a command line: ``name`` itself when it is a file, else the example
    spec ``specs_dir() / (name + ".attn")``; ValueError listing the example specs otherwise."""
    if Path(name).is_file():
        return Path(name)
    path = specs_dir() / f"{name}.attn"
    if not path.is_file():
        names = ", ".join(sorted(f.stem for f in specs_dir().glob("*.attn")))
        raise ValueError(f"no spec named {name!r}: no such file and no spec of that name in specs/ ({names})")
    return path


def include_dir() -> Path:
    """The include root for generated translation units (``-I`` this)."""
    return templates_dir() / "include"


def repo_root() -> Path | None:
    """The source checkout (with specs/ and generated/), or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "specs").is_dir() and (root / "pyproject.toml").is_file() else None


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` by one rename (readers see the old or the new file,
    never a partial one), owner-only (0600) whatever the umask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def owner_only(path: Path) -> None:
    """Make ``path`` (a file, or a folder with everything in it) owner-only: folders 0700, files
    0600 (0700 when executable)."""
    paths = [path]
    if path.is_dir() and not path.is_symlink():
        for parent, dirs, files in os.walk(path):
            paths += [Path(parent) / n for n in (*dirs, *files)]
    for p in paths:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_ISDIR(st.st_mode):
            os.chmod(p, 0o700)
        else:
            os.chmod(p, 0o700 if st.st_mode & stat.S_IXUSR else 0o600)


def private_dir(path: Path) -> Path:
    """Create the folder ``path`` (and missing parents) owner-only (0700) whatever the umask; an
    existing folder is left as it is. Raises OSError as mkdir does (FileExistsError for a file
    in its place)."""
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            if not path.is_dir():
                raise
        else:
            os.chmod(path, 0o700)
    return path
