"""The package's layering, read from the source: every import (top-level or inside a function), no cycles.

The wings and what each may import are the table in docs/ARCHITECTURE.md; this test is that table.
A wing is a subpackage of ``mosaic`` (``mosaic/_build/``); the package root (``mosaic/__init__.py``, the public API)
counts as the wing ``mosaic``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mosaic"

#: The floor every wing stands on: errors, fault points, hashing, progress reporting, safe text, the version.
BASE = {"_base"}

#: What each wing may import besides itself and BASE. Everything not listed is forbidden; no wing imports the
#: package root (``mosaic``, the public API), which imports only the API façade and the base.
ALLOWED: dict[str, set[str]] = {
    "mosaic": {"_api"},
    "_base": set(),
    "_formats": set(),
    "_checkpoint": {"_formats"},
    "_recipe": {"_checkpoint"},
    "_provenance": {"_checkpoint", "_recipe"},
    "_hub": {"_formats", "_recipe"},
    "_sources": {"_formats", "_checkpoint", "_recipe", "_hub"},
    "_build": {"_formats", "_checkpoint", "_recipe", "_provenance", "_hub", "_sources"},
    "_export": {"_formats", "_checkpoint"},
    "_audit": {"_formats", "_checkpoint", "_recipe", "_provenance", "_sources", "_export"},
    "_release": {"_formats", "_recipe", "_provenance", "_hub", "_build", "_audit"},
    "_plan": {"_formats", "_checkpoint", "_recipe", "_sources", "_build"},
    "_eval": {"_formats", "_checkpoint"},
    "_measure": {"_formats", "_checkpoint", "_hub", "_sources", "_build", "_plan", "_eval"},
    "_api": {"_formats", "_checkpoint", "_recipe", "_provenance", "_hub", "_sources", "_build", "_export", "_audit",
             "_release", "_plan", "_eval", "_measure"},
    "cli": {"_api", "testing"},
    "testing": {"_formats", "_checkpoint", "_eval"},
}

#: Module-level rules finer than the wings: the audit re-converts the tokenizer with the vocabulary
#: converter but never borrows the exporter; the base's own modules stand on each other only as listed.
FORBIDDEN_MODULES = {
    "_audit": {"mosaic._export.gguf", "mosaic._export.glm5_next", "mosaic._export.tensors",
               "mosaic._export.ranma_names"},
}
BASE_MODULES: dict[str, set[str]] = {
    "mosaic._base": set(), "mosaic._base.errors": set(), "mosaic._base.faults": set(), "mosaic._base.literal": set(),
    "mosaic._base.version": set(), "mosaic._base.progress": {"mosaic._base.literal"},
    "mosaic._base.hashing": {"mosaic._base.faults"}, "mosaic._base.lock": {"mosaic._base.errors"},
}
#: Inside the command line: only the demo runs the command line, and only it writes synthetic models.
CLI_MODULES: dict[str, set[str]] = {"mosaic.cli.commands": {"_api"}, "mosaic.cli.render": {"_api"}}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: Iterable[str], root: Path = PACKAGE) -> set[str]:
    """Every mosaic module a file imports, wherever the import statement stands in the file."""
    known = set(modules)
    me = module_name(path, root)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(me, path.name == "__init__.py", node)
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        else:
            continue
        for t in targets:
            if t == "mosaic" or t.startswith("mosaic."):
                # importing mosaic.a.b runs mosaic.a's __init__ too, unless the importer is inside mosaic.a
                parts = t.split(".")
                for i in range(2, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name in known and (i == len(parts) or not me.startswith(name + ".")):
                        out.add(name)
                if t == "mosaic":
                    out.add("mosaic")
    out.discard(me)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    names = [module_name(f, root) for f in files]
    return {module_name(f, root): imports_of(f, names, root) for f in files}


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mosaic"


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def wing_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(wing(m), set()).update(wing(d) for d in deps if wing(d) != wing(m))
    return out


def forbidden_edges(graph: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        w = wing(m)
        if w not in ALLOWED:
            bad.append(f"{m}: wing {w!r} is not in the layering table")
            continue
        allowed = ALLOWED[w] | (BASE if w != "_base" else set())
        allowed = CLI_MODULES.get(m, allowed) | (BASE if m in CLI_MODULES else set())
        for d in sorted(deps):
            dw = wing(d)
            if dw != w and dw not in allowed:
                bad.append(f"{m} imports {d} ({w} -> {dw})")
            if d in FORBIDDEN_MODULES.get(w, ()):
                bad.append(f"{m} imports {d} (forbidden to {w})")
            if w == "_base" and dw == w and d != "mosaic._base" and d not in BASE_MODULES.get(m, set()):
                bad.append(f"{m} imports {d} (the base's modules stand apart)")
    return bad


# --- the package as it is ----------------------------------------------------------------------------


def test_no_module_cycle() -> None:
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_no_wing_cycle() -> None:
    cycle = find_cycle(wing_graph(import_graph()))
    assert cycle is None, " -> ".join(cycle or [])


def test_every_edge_is_allowed_by_the_table() -> None:
    assert forbidden_edges(import_graph()) == []


def test_every_wing_is_in_the_table_and_the_table_has_no_stale_wing() -> None:
    wings = {wing(m) for m in import_graph()}
    assert wings == set(ALLOWED)


def test_the_graph_sees_imports_inside_functions() -> None:
    """publish's audit import and the API's lazy imports are inside functions or at the top: both count."""
    g = import_graph()
    assert "mosaic._audit.run" in g["mosaic._release.publishing"]
    assert "mosaic._build.run" in g["mosaic._api.functions"]  # imported inside build()
    assert "mosaic._hub.snapshot" in g["mosaic._sources.resolve"]  # imported inside hub_snapshot()


# --- the checker itself can fail -----------------------------------------------------------------------


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "mosaic"
    for sub in ("_audit", "_sources", "_release"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_audit" / "run.py").write_text("from mosaic._sources.resolve import resolve\n")
    (pkg / "_sources" / "resolve.py").write_text("def resolve():\n    from mosaic._release.publishing import go\n")
    (pkg / "_release" / "publishing.py").write_text("def go():\n    from .._audit import run\n")
    g = import_graph(pkg)
    assert g["mosaic._release.publishing"] == {"mosaic._audit", "mosaic._audit.run"}
    cycle = find_cycle(g)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"mosaic._audit.run", "mosaic._sources.resolve", "mosaic._release.publishing"}
    assert find_cycle(wing_graph(g)) is not None


@pytest.mark.parametrize(
    ("module", "dep", "ok"),
    [
        ("mosaic._formats.gguf_container", "mosaic._checkpoint.folder", False),  # formats import nothing above
        ("mosaic._audit.mosaic_folder", "mosaic._build.layout", False),  # the audit never trusts the layout
        ("mosaic._audit.gguf_folder", "mosaic._export.gguf", False),
        ("mosaic._audit.gguf_folder", "mosaic._export.vocab", True),
        ("mosaic._build.run", "mosaic._plan.planner", False),
        ("mosaic._hub.download", "mosaic._audit.run", False),
        ("mosaic._base.errors", "mosaic._formats.safetensors_reader", False),
        ("mosaic._plan.planner", "mosaic._build.layout", True),
        ("mosaic._build.run", "mosaic", False),  # nothing imports the root
        ("mosaic.cli.commands", "mosaic._build.run", False),  # the command line calls the API only
        ("mosaic.cli.commands", "mosaic._api.functions", True),
        ("mosaic.cli.demo", "mosaic.testing.exl3", True),
        ("mosaic", "mosaic._build.run", False),  # the root imports the façade, never a wing
        ("mosaic._base.errors", "mosaic._base.hashing", False),
        ("mosaic._base.hashing", "mosaic._base.faults", True),
    ],
)
def test_checker_judges_edges(module: str, dep: str, ok: bool) -> None:
    assert (forbidden_edges({module: {dep}}) == []) is ok
