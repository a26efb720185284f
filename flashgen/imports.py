"""The package's own import graph, read from the source (nothing is imported).

Two users: the build cache key (flashgen/build/artifact.py hashes every module the code generator
imports, so an edit to any emitter changes the key) and the import-cycle test
(tests/test_architecture.py), which fails on a cycle and names it.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModuleGraph:
    """``paths``: dotted module name → source file; ``edges``: module → the package's modules it
    imports (anywhere in the file, function-local imports included); ``local``: module → the
    package's modules it imports inside a function or class body (line numbers alongside)."""

    paths: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)
    local: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def _module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` inside ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


# An import statement at the start of a line: ``from <dots><name> import <names>`` (names may be
# parenthesised over several lines) or ``import <dotted>``. A regular expression instead of
# ``ast``: parsing the whole package costs ~0.3 s, and the cache key asks for this graph in every
# process (tests/test_architecture.py checks the two agree on this package).
_FROM = re.compile(r"^([ \t]*)from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)", re.M)
_IMPORT = re.compile(r"^([ \t]*)import[ \t]+([\w.]+(?:[ \t]*,[ \t]*[\w.]+)*)", re.M)


@functools.cache
def module_graph(package: Path) -> ModuleGraph:
    """The import graph of the package rooted at ``package`` (a directory with ``__init__.py``).
    An indented import statement counts as function-local (``local``)."""
    package = Path(package)
    graph = ModuleGraph()
    for path in sorted(package.rglob("*.py")):
        graph.paths[_module_name(package, path)] = path
    top = package.name
    for mod, path in graph.paths.items():
        is_package = path.name == "__init__.py"
        text = path.read_text()
        edges: set[str] = set()
        local: list[tuple[str, int]] = []

        def add(target: str, pos: int, indent: str) -> None:
            if target == mod or not (target == top or target.startswith(top + ".")):
                return
            edges.add(target)
            if indent:
                local.append((target, text.count("\n", 0, pos) + 1))

        for m in _FROM.finditer(text):
            indent, dots, name, names = m.groups()
            base = _resolve(mod, is_package, len(dots), name or None) if dots else name
            for alias in names.strip("() \t").replace("\n", " ").split(","):
                alias = alias.split("#")[0].strip().split(" as ")[0].strip()
                if alias:
                    sub = f"{base}.{alias}"
                    add(sub if sub in graph.paths else base, m.start(), indent)
        for m in _IMPORT.finditer(text):
            for alias in m.group(2).split(","):
                if alias.strip() in graph.paths:
                    add(alias.strip(), m.start(), m.group(1))
        graph.edges[mod] = edges
        graph.local[mod] = local
    return graph


def cycles(graph: ModuleGraph, exclude: tuple[str, ...] = ()) -> list[list[str]]:
    """The import cycles of ``graph`` (each a list of module names, first repeated at the end),
    one per strongly connected component of more than one module; modules in ``exclude`` (e.g.
    the package ``__init__``, a re-export facade) are left out."""
    nodes = [m for m in graph.paths if m not in exclude]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.edges.get(v, ())):
            if w in exclude or w not in graph.paths:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strong(v)
    return [_a_cycle(graph, comp) for comp in sorted(comps)]


def _a_cycle(graph: ModuleGraph, comp: list[str]) -> list[str]:
    """One concrete cycle through the first module of a strongly connected component."""
    members = set(comp)
    start = comp[0]
    path = [start]
    seen = {start}
    # Walk within the component by breadth-first search back to start.
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.edges.get(v, ())):
            if w not in members:
                continue
            if w == start:
                chain = [v]
                while chain[-1] != start:
                    chain.append(prev[chain[-1]])
                return list(reversed(chain)) + [start]
            if w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    return path + [start]
