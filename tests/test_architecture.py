"""The package's structure: its import graph (read by flashgen/imports.py) and the rules the
architecture page (docs/architecture.md) states for it."""

import ast
import re
from pathlib import Path

import flashgen
from flashgen import imports

PACKAGE = Path(flashgen.__file__).resolve().parent


def _ast_edges(package: Path) -> dict[str, set[str]]:
    """The same graph as imports.module_graph, by parsing every module with ast (slow, exact)."""
    graph = imports.module_graph(package)
    out = {}
    for mod, path in graph.paths.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in graph.paths and a.name != mod}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = mod.split(".") if is_package else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if not (base == "flashgen" or base.startswith("flashgen.")):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    target = sub if sub in graph.paths else base
                    if target != mod:
                        edges.add(target)
        out[mod] = edges
    return out


def test_import_graph_matches_a_full_parse():
    graph = imports.module_graph(PACKAGE)
    assert "flashgen.build.artifact" in graph.paths
    assert "flashgen.codegen.render" in graph.edges["flashgen.build.artifact"]
    assert {m: graph.edges[m] for m in graph.paths} == _ast_edges(PACKAGE)


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "flashgen"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_cycle_finder_names_a_cycle(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from .a import x\n",
        "a.py": "from . import b\nx = 1\n",
        "b.py": "from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "def f():\n    from ..a import x\n    return x\n",  # a function-local import closes it
        "d.py": "import flashgen.a\n",
    })
    graph = imports.module_graph(pkg)
    found = imports.cycles(graph, exclude=("flashgen",))
    assert found == [["flashgen.a", "flashgen.b", "flashgen.sub.c", "flashgen.a"]]
    assert graph.local["flashgen.sub.c"] == [("flashgen.a", 2)]
    acyclic = _package(tmp_path / "ok", {"__init__.py": "", "a.py": "from . import b\n", "b.py": "import os\n"})
    assert imports.cycles(imports.module_graph(acyclic)) == []


def test_the_package_has_no_import_cycles():
    """Data flows one way: no cycle among flashgen's modules (the package __init__, which only
    re-exports, left out); tests/test_architecture.py's own cycle finder is shown to catch one
    in test_cycle_finder_names_a_cycle."""
    graph = imports.module_graph(PACKAGE)
    assert imports.cycles(graph, exclude=("flashgen",)) == []


def test_no_function_local_imports_of_flashgen_modules():
    """Imports of the package's own modules sit at the top of each module (lazy loads are left
    only for heavy third-party packages)."""
    graph = imports.module_graph(PACKAGE)
    assert {m: v for m, v in graph.local.items() if v} == {}


def test_no_module_uses_another_modules_underscore_names():
    graph = imports.module_graph(PACKAGE)
    found = []
    for mod, path in graph.paths.items():
        text = path.read_text()
        aliases = set()
        for m in re.finditer(r"^from (\.+)(\w*(?:\.\w+)*) import \(?([^)\n]*(?:\n[^)\n]*)*?)\)?$", text, re.M):
            for alias in m.group(3).replace("\n", " ").split(","):
                parts = alias.split("#")[0].split(" as ")
                name = parts[0].strip()
                if name.startswith("_") and not name.startswith("__"):
                    found.append(f"{mod}: from {m.group(1)}{m.group(2)} import {name}")
                if name:
                    aliases.add(parts[-1].strip())
        for alias in aliases:
            for hit in re.finditer(rf"\b{re.escape(alias)}\._[a-z]\w*", text):
                found.append(f"{mod}: {hit.group(0)}")
    assert found == []


def test_modules_have_one_stage_each():
    """No module grows past ~800 lines again (ops.py had 1,376, explain.py 1,367)."""
    sizes = {m: len(p.read_text().splitlines()) for m, p in imports.module_graph(PACKAGE).paths.items()}
    assert max(sizes.values()) <= 800, sorted(sizes.items(), key=lambda x: -x[1])[:3]


def test_former_mirrors_have_one_implementation():
    """Rules the C++ applied and Python ported (for explain) live once, in Python in the kernel
    family's module, and the kernels read the decision from their argument blocks (args.h):
    the CPU tile choice (families/cpu_tiles.py: the runtime's launches fill tile_q / tile_kv
    from it, explain's CPU model calls it; cpu/tiles.h only checks the fields) and the CUDA
    backward's GQA split (families/sm80.py gqa_splits: the launch fills gqa_splits, explain
    imports it; cuda/bwd.cuh reads it). The other former mirrors have their own tests: the
    key ranges (tests/test_key_range.py), ABI_VERSION (test_codegen.py), tile legality
    (test_tiles.py), the FLOP counter (test_flops.py)."""
    from flashgen.explain import cpu_model, sm80_model
    from flashgen.families import cpu_tiles, sm80
    from flashgen.paths import include_dir

    headers = include_dir() / "flashgen"
    tiles_h = (headers / "cpu" / "tiles.h").read_text()
    for gone in ("choose_tiles", "sparse_tiles", "bwd_choose_tiles", "getenv", "sysconf", "get_num_threads"):
        assert gone not in tiles_h, gone
    for header in (headers / "cpu").glob("*.h"):
        text = header.read_text()
        assert 'getenv("FLASHGEN_CPU_TILES")' not in text and 'getenv("FLASHGEN_CPU_BWD_TILES")' not in text
    assert "a.tile_q" in tiles_h and "a.tile_kv" in tiles_h
    bwd_cuh = (headers / "cuda" / "bwd.cuh").read_text()
    assert "a.gqa_splits" in bwd_cuh and "items * s" not in bwd_cuh

    # One implementation in Python, which its users import.
    assert cpu_model.family_tiles is cpu_tiles and sm80_model.gqa_splits is sm80.gqa_splits
    graph = imports.module_graph(PACKAGE)
    assert "flashgen.families.cpu_tiles" in graph.edges["flashgen.families.cpu"]
    assert "flashgen.families.cpu_tiles" in graph.edges["flashgen.explain.cpu_model"]
    rules = {"qb_max": "flashgen.families.cpu_tiles", "2 * items <= sms": "flashgen.families.sm80"}
    for mod, path in graph.paths.items():
        text = path.read_text()
        for marker, home in rules.items():
            assert marker not in text or mod == home, f"{mod} implements {home}'s rule ({marker!r})"
