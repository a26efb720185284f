"""Where the templates and kernel headers live: package data when installed, else the checkout."""

from __future__ import annotations

import functools
import json
import os
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


def include_dir() -> Path:
    """The include root for generated translation units (``-I`` this)."""
    return templates_dir() / "include"


def repo_root() -> Path | None:
    """The source checkout (with specs/ and generated/), or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "specs").is_dir() and (root / "pyproject.toml").is_file() else None


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` by one rename (readers see the old or the new file,
    never a partial one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
