"""docs/ARCHITECTURE.md's ``tree`` block is the map of the package: every
module under kvstrata/ is named in it, and everything it names exists; the
README's Layout lists every package.

The block's format, one entry per package (continuation lines indented
deeper), modules by name without ``.py``, a sub-package's modules in
parentheses after it::

    kvstrata/
      __init__.py __main__.py config.py ...
      kv/          manager, coordinator, managers/ (base, full, windowed),
                   block_pool, ...
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstrata"
_ITEM = re.compile(r"(\w+)/\s*\(([^)]*)\)|(\w+)(?:\.py)?")


def _tree_entries() -> dict[str, str]:
    """Package ("" for kvstrata/ itself) -> the text of its entry."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = re.search(r"```tree\n(.*?)```", text, re.S)
    assert block, "docs/ARCHITECTURE.md has no ```tree block"
    lines = block.group(1).splitlines()
    assert lines[0] == "kvstrata/"
    entries, current = {"": ""}, ""
    for line in lines[1:]:
        if not line.startswith("  "):
            break  # tests/, tools/: not the package
        m = re.match(r"  (\w+)/\s+(.*)", line)
        if m:
            current = m.group(1)
            entries[current] = m.group(2)
        else:
            entries[current] += " " + line.strip()
    return entries


def _named(entry: str) -> set[str]:
    """The module paths an entry names, relative to its package: ``manager``,
    ``managers/base``."""
    names = set()
    for m in _ITEM.finditer(entry):
        if m.group(1):
            names.update(f"{m.group(1)}/{sub}" for sub in re.findall(r"\w+", m.group(2)))
        else:
            names.add(m.group(3))
    return names


def _modules() -> set[tuple[str, str]]:
    """(package, module path inside it) of every module under kvstrata/, as
    the tree names them (``__init__`` only for kvstrata/ itself)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if len(parts) == 1:
            found.add(("", parts[0]))
        elif parts[-1] != "__init__":
            found.add((parts[0], "/".join(parts[1:])))
    return found


def test_every_module_is_named_in_the_architecture_tree():
    entries = _tree_entries()
    missing = sorted(f"kvstrata/{pkg + '/' if pkg else ''}{mod}.py" for pkg, mod in _modules()
                     if pkg not in entries or mod not in _named(entries[pkg]))
    assert not missing, f"docs/ARCHITECTURE.md's tree does not name: {missing}"


def test_everything_the_tree_names_exists():
    entries = _tree_entries()
    modules = _modules()
    stale = sorted(f"kvstrata/{pkg + '/' if pkg else ''}{name}" for pkg, entry in entries.items()
                   for name in _named(entry) if (pkg, name) not in modules)
    assert not stale, f"docs/ARCHITECTURE.md's tree names what does not exist: {stale}"


def test_the_readme_layout_lists_every_package():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    missing = [p for p in packages if f"kvstrata/{p}/" not in layout]
    assert not missing, f"README.md's Layout does not list: {missing}"
