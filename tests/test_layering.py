"""The package's imports obey the layers written in docs/ARCHITECTURE.md,
and the docs name only what exists.

Every module of ``kvstrata`` is read with ``ast`` (nothing is imported), and
every import counts: module level, inside functions, under TYPE_CHECKING,
relative ones, ``importlib.import_module("...")`` with a literal name, and
module-level tables of dotted paths (PEP 562 lazy exports such as
``kvstrata.enginecore._EXPORTS``, registries such as the connector
factory's built-ins), since each becomes an import when used. Three rules:

- every module belongs to exactly one layer (its longest listed prefix);
- no import goes to a higher layer, and in a layer marked ``(peers)`` no
  prefix imports another;
- no import cycle between modules. Here a table of names does not count:
  it is a one-way, lazy registry (the connector factory names ``multi``,
  which builds its children with the factory), held to the layer rule but
  not a cycle edge.

A package's ``__init__`` is not counted as a dependency of its own
submodules (they run inside it). Both exceptions are those of the team's
import-cycle tool, so the two agree.

The docs: the ``tree`` block of docs/ARCHITECTURE.md shows every package
and names only modules that exist; every backticked path or
``kvstrata.`` name in README.md and docs/ARCHITECTURE.md exists.

Run as a script to print every layer or cycle violation:
``python tests/test_layering.py``.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO / "kvstrata"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.\w+)+(:\w+)?$")
_LAYER_LINE = re.compile(r"^\s*(\d+)\s+([\w-]+)\s*(\(peers\))?\s*:\s*(.+?)\s*$")


# -- the layer table -------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    rank: int
    name: str
    peers: bool  # its prefixes never import each other
    prefixes: tuple[str, ...]


def parse_layers(markdown: str) -> list[Layer]:
    """The fenced ``layers`` block: one line per layer, lowest first,
    ``N name [(peers)]: prefix, prefix``; ``#`` starts a comment."""
    m = re.search(r"^```layers\s*\n(.*?)^```", markdown, re.S | re.M)
    if m is None:
        raise ValueError("no ```layers block")
    layers: list[Layer] = []
    for raw in m.group(1).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        lm = _LAYER_LINE.match(line)
        if lm is None:
            raise ValueError(f"bad layer line: {raw!r}")
        prefixes = tuple(p.strip() for p in lm.group(4).split(",") if p.strip())
        layers.append(Layer(int(lm.group(1)), lm.group(2), lm.group(3) is not None, prefixes))
    ranks = [layer.rank for layer in layers]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"layer numbers must increase: {ranks}")
    seen = [p for layer in layers for p in layer.prefixes]
    if len(seen) != len(set(seen)):
        raise ValueError(f"a prefix is listed twice: {seen}")
    return layers


def placement(module: str, layers: list[Layer], package: str) -> tuple[Layer, str] | None:
    """(layer, prefix) of ``module``: its longest listed prefix. The package
    name itself, when listed, names only the package's ``__init__``."""
    best: tuple[Layer, str] | None = None
    for layer in layers:
        for p in layer.prefixes:
            hit = module == p if p == package else (module == p or module.startswith(p + "."))
            if hit and (best is None or len(p) > len(best[1])):
                best = (layer, p)
    return best


# -- the import graph ------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    text: str
    by_name: bool = False  # named in a module-level table, not imported


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _string_imports(tree: ast.Module) -> list[tuple[str, ast.AST, bool]]:
    """Modules imported by name: ``import_module("x")``/``__import__("x")``
    anywhere (an import when it runs), and the strings of module-level
    container literals (a table: True)."""
    out: list[tuple[str, ast.AST, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.args[0].value, node, False))
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(
            stmt.value, (ast.Dict, ast.List, ast.Tuple, ast.Set, ast.Call)
        ):
            for node in ast.walk(stmt.value):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value):
                    out.append((node.value.split(":", 1)[0], node, True))
    return out


def imports_of(root: Path, path: Path, modules: set[str]) -> list[Edge]:
    me = module_name(root, path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, str(path))
    lines = source.splitlines()
    # (name, node, may strip to a parent module, named in a table)
    found: list[tuple[str, ast.AST, bool, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node, True, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found += [(f"{base}.{a.name}", node, True, False) for a in node.names]
            found.append((base, node, True, False))
    found += [(name, node, False, table) for name, node, table in _string_imports(tree)]
    edges: dict[tuple[str, bool], Edge] = {}
    for name, node, strip, table in found:
        n = name
        while strip and n and n not in modules:
            n = n.rpartition(".")[0]
        if not n or n not in modules or n == me:
            continue
        if me.startswith(n + ".") and (root.parent / n.replace(".", "/") / "__init__.py").exists():
            continue  # the package this module runs inside
        line = getattr(node, "lineno", 0)
        key = (n, table)
        if key not in edges or line < edges[key].line:
            text = lines[line - 1].strip() if 0 < line <= len(lines) else name
            edges[key] = Edge(me, n, line, text, by_name=table)
    return sorted(edges.values(), key=lambda e: (e.line, e.dst, e.by_name))


def import_graph(root: Path) -> dict[str, list[Edge]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(root, p) for p in files}
    return {module_name(root, p): imports_of(root, p, modules) for p in files}


# -- the checks ------------------------------------------------------------------


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's components of more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for e in it:
                w = e.dst
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def _shortest_cycle(graph: dict[str, list[Edge]], comp: list[str]) -> list[Edge]:
    inside = set(comp)
    start = comp[0]
    prev: dict[str, Edge] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for e in graph[v]:
            if e.dst not in inside:
                continue
            if e.dst == start:
                path = [e]
                while path[0].src != start:
                    path.insert(0, prev[path[0].src])
                return path
            if e.dst not in prev:
                prev[e.dst] = e
                todo.append(e.dst)
    return []


def cycle_violations(graph: dict[str, list[Edge]]) -> list[str]:
    graph = {m: [e for e in edges if not e.by_name] for m, edges in graph.items()}
    out = []
    for comp in strongly_connected(graph):
        path = _shortest_cycle(graph, comp)
        steps = "; ".join(f"{e.src}:{e.line} `{e.text}`" for e in path)
        out.append(f"import cycle among {', '.join(comp)}: {steps}")
    return out


def layer_violations(graph: dict[str, list[Edge]], layers: list[Layer], package: str) -> list[str]:
    out = []
    for mod in sorted(graph):
        src = placement(mod, layers, package)
        if src is None:
            out.append(f"{mod} belongs to no layer in docs/ARCHITECTURE.md")
            continue
        for e in graph[mod]:
            dst = placement(e.dst, layers, package)
            if dst is None:
                continue  # reported as a module of no layer
            (sl, sp), (dl, dp) = src, dst
            if dl.rank > sl.rank:
                out.append(f"{mod}:{e.line} `{e.text}` imports {e.dst}: upward, from layer {sl.rank} "
                           f"{sl.name} ({sp}) to layer {dl.rank} {dl.name} ({dp})")
            elif dl.rank == sl.rank and sl.peers and sp != dp:
                out.append(f"{mod}:{e.line} `{e.text}` imports {e.dst}: between peers of layer "
                           f"{sl.rank} {sl.name} ({sp} -> {dp})")
    return out


def check(root: Path, architecture_md: str) -> list[str]:
    graph = import_graph(root)
    return layer_violations(graph, parse_layers(architecture_md), root.name) + cycle_violations(graph)


# -- the docs name what exists ----------------------------------------------------


def tree_names(markdown: str) -> dict[str, list[str]]:
    """The fenced ``tree`` block's ``kvstrata/`` part: {package dir: names}.
    A line ``  dir/  a, b, sub/ (c, d),`` names modules ``a``, ``b`` of
    ``dir`` and ``c``, ``d`` of ``dir/sub``; a deeper-indented line goes on
    with the line before it; a line at indent 0 ends the part."""
    m = re.search(r"^```tree\s*\n(.*?)^```", markdown, re.S | re.M)
    if m is None:
        raise ValueError("no ```tree block")
    entries: list[str] = []  # one per package line, its continuation lines joined
    inside = False
    for line in m.group(1).splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            inside = line.strip() == "kvstrata/"
        elif inside and len(line) - len(line.lstrip()) == 2:
            entries.append(line.strip())
        elif inside and entries:
            entries[-1] += " " + line.strip()
    out: dict[str, list[str]] = {}
    for body in entries:
        head = re.match(r"^(\w+)/\s+(.*)$", body)
        current = head.group(1) if head else ""
        body = head.group(2) if head else body
        names = out.setdefault(current, [])
        for sub, inner in re.findall(r"(\w+)/\s*\(([^)]*)\)", body):
            d = f"{current}/{sub}" if current else sub
            out.setdefault(d, []).extend(n.strip() for n in inner.split(",") if n.strip())
            names.append(sub + "/")
        body = re.sub(r"\w+/\s*\([^)]*\)", "", body)
        names.extend(n for n in re.split(r"[,\s]+", body) if n)
    return out


def missing_tree_entries(root: Path, markdown: str) -> list[str]:
    problems = []
    tree = tree_names(markdown)
    for d, names in tree.items():
        for n in names:
            base = root / d if d else root
            target = base / n if n.endswith(("/", ".py")) else base / f"{n}.py"
            if not (target.exists() or (base / n / "__init__.py").exists()):
                problems.append(f"the tree names {target.relative_to(root.parent)}, which does not exist")
    packages = {str(p.parent.relative_to(root)) for p in root.glob("*/**/__init__.py")}
    for pkg in sorted(packages - set(tree)):
        problems.append(f"the tree does not show the package kvstrata/{pkg}/")
    return problems


_BACKTICK = re.compile(r"`([^`\s]+)`")


def missing_named_paths(repo: Path, markdown: str, package: str = "kvstrata") -> list[str]:
    """Backticked file paths (``a/b.py``, ``a/b/``; relative to the repo or
    to the package; not URL paths like ``/health``, not a bare ``dir/``) and
    dotted names (``kvstrata.x.y[.Attr]``) that do not exist."""
    problems = []
    for tok in sorted(set(_BACKTICK.findall(markdown))):
        tok = tok.rstrip(".,;:")
        if "/" in tok.rstrip("/") and re.fullmatch(r"\w[\w./-]*", tok) and (tok.endswith((".py", "/")) or "." not in tok):
            if not any((base / tok).exists() for base in (repo, repo / package)):
                problems.append(f"names the path {tok}, which does not exist")
        elif re.fullmatch(rf"{package}(\.\w+)+", tok):
            parts = tok.split(".")
            for i in range(len(parts), 0, -1):
                mod = repo.joinpath(*parts[:i])
                path = mod / "__init__.py" if mod.is_dir() else mod.with_suffix(".py")
                if path.exists():
                    rest = parts[i:]
                    if len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", path.read_text(encoding="utf-8"))):
                        problems.append(f"names {tok}: {'.'.join(rest)} is not in {path.relative_to(repo)}")
                    break
            else:
                problems.append(f"names {tok}, which does not exist")
    return problems


# -- the tests -------------------------------------------------------------------


def test_every_kvstrata_module_has_a_layer_and_imports_only_down_without_cycles():
    problems = check(PACKAGE_DIR, ARCHITECTURE.read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(problems)


def test_the_layer_table_lists_every_top_level_part_of_the_package():
    layers = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    listed = {p for layer in layers for p in layer.prefixes}
    top = {f"kvstrata.{p.stem}" for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__"}
    top |= {f"kvstrata.{p.parent.name}" for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert top <= listed, f"not in the layers block: {sorted(top - listed)}"
    assert [layer.rank for layer in layers] == list(range(len(layers)))


def test_the_lazy_exports_of_enginecore_are_seen_as_imports():
    graph = import_graph(PACKAGE_DIR)
    dsts = {e.dst for e in graph["kvstrata.enginecore"]}
    assert {"kvstrata.enginecore.async_engine", "kvstrata.errors", "kvstrata.types"} <= dsts


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fakepkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


_FAKE_LAYERS = """
```layers
0 base: fakepkg, fakepkg.types
1 prims (peers): fakepkg.a, fakepkg.b
2 top: fakepkg.top
```
"""


def test_checker_passes_a_clean_fake_package(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "",
        "types.py": "X = 1\n",
        "a/__init__.py": "from fakepkg.a.core import f\n",
        "a/core.py": "from ..types import X\nfrom fakepkg.a import helper\n",
        "a/helper.py": "",
        "b.py": "import fakepkg.types\n",
        "top.py": "from fakepkg import a, b\n",
    })
    assert check(root, _FAKE_LAYERS) == []


def test_checker_catches_an_upward_import_under_type_checking_and_names_it(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "",
        "types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fakepkg.top import T\n",
        "a.py": "", "b.py": "",
        "top.py": "T = int\n",
    })
    assert check(root, _FAKE_LAYERS) == [
        "fakepkg.types:3 `from fakepkg.top import T` imports fakepkg.top: upward, "
        "from layer 0 base (fakepkg.types) to layer 2 top (fakepkg.top)"
    ]


def test_checker_catches_peers_importing_each_other_and_modules_of_no_layer(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "", "types.py": "", "top.py": "",
        "a.py": "def f():\n    from . import b\n",
        "b.py": "",
        "stray.py": "",
    })
    assert check(root, _FAKE_LAYERS) == [
        "fakepkg.a:2 `from . import b` imports fakepkg.b: between peers of layer 1 prims "
        "(fakepkg.a -> fakepkg.b)",
        "fakepkg.stray belongs to no layer in docs/ARCHITECTURE.md",
    ]


def test_checker_catches_a_cycle_and_says_which_modules(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "", "types.py": "", "b.py": "", "top.py": "",
        "a/__init__.py": "",
        "a/x.py": "from fakepkg.a.y import g\n",
        "a/y.py": "import importlib\n\ndef g():\n    return importlib.import_module('fakepkg.a.x')\n",
    })
    assert check(root, _FAKE_LAYERS) == [
        "import cycle among fakepkg.a.x, fakepkg.a.y: fakepkg.a.x:1 `from fakepkg.a.y import g`; "
        "fakepkg.a.y:4 `return importlib.import_module('fakepkg.a.x')`"
    ]


def test_checker_reads_lazy_export_tables(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "", "types.py": "", "a.py": "",
        "b.py": '_EXPORTS = {"Thing": "fakepkg.top", "Other": "fakepkg.top:Other"}\n',
        "top.py": "from fakepkg import b\n",  # a table is one-way: no cycle with b
    })
    assert check(root, _FAKE_LAYERS) == [
        "fakepkg.b:1 `_EXPORTS = {\"Thing\": \"fakepkg.top\", \"Other\": \"fakepkg.top:Other\"}` imports "
        "fakepkg.top: upward, from layer 1 prims (fakepkg.b) to layer 2 top (fakepkg.top)"
    ]


def test_a_missing_or_malformed_layer_table_is_an_error():
    with pytest.raises(ValueError, match="no ```layers block"):
        parse_layers("# nothing here\n")
    with pytest.raises(ValueError, match="bad layer line"):
        parse_layers("```layers\nzero base fakepkg\n```\n")
    with pytest.raises(ValueError, match="must increase"):
        parse_layers("```layers\n1 a: x\n0 b: y\n```\n")


def test_the_architecture_tree_shows_every_package_and_names_only_what_exists():
    assert missing_tree_entries(PACKAGE_DIR, ARCHITECTURE.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md"])
def test_the_docs_name_only_paths_and_modules_that_exist(doc):
    assert missing_named_paths(REPO, (REPO / doc).read_text(encoding="utf-8")) == []


def test_the_doc_checks_catch_a_stale_tree_and_a_stale_path(tmp_path):
    root = _fake_package(tmp_path, {"__init__.py": "", "a.py": "X = 1\n", "sub/__init__.py": "", "sub/b.py": "",
                                    "new/__init__.py": ""})
    md = "```tree\nkvstrata/\n  a.py gone.py\n  sub/  b, c\n```\n"
    assert missing_tree_entries(root, md) == [
        "the tree names fakepkg/gone.py, which does not exist",
        "the tree names fakepkg/sub/c.py, which does not exist",
        "the tree does not show the package kvstrata/new/",
    ]
    md = "`fakepkg/a.py` `sub/b.py` `sub/old.py` `fakepkg.a.X` `fakepkg.a.Y` `fakepkg.gone`"
    assert missing_named_paths(tmp_path, md, "fakepkg") == [
        "names fakepkg.a.Y: Y is not in fakepkg/a.py",
        "names fakepkg.gone: gone is not in fakepkg/__init__.py",
        "names the path sub/old.py, which does not exist",
    ]


if __name__ == "__main__":
    problems = check(PACKAGE_DIR, ARCHITECTURE.read_text(encoding="utf-8"))
    print("\n".join(problems) or "layers and cycles: clean")
    sys.exit(1 if problems else 0)
