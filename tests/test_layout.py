"""The package's imports go one way (README, "Layout"): passes -> patterns -> ops -> kernels,
distributed -> nvfp4 -> config; tp sits beside patterns; nothing imports the top-level scripts.

Read from the source with ``ast`` (imports inside functions count too), so a cycle or an upward
import fails here rather than in review."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fp4fuse"

# Each layer may import only layers of a lower rank (and its own folder).
LAYER_RANK = {
    "config": 0,
    "nvfp4": 1,
    "kernels": 2,
    "distributed": 2,
    "ops": 3,
    "patterns": 4,
    "tp": 4,
    "passes": 5,
}
TOP_LEVEL = 6  # fp4fuse/__init__.py, demo.py, launch.py, selfcheck.py


def _layer(module: str) -> str:
    """``fp4fuse.ops.fp4_ops`` -> ``ops``; ``fp4fuse.config`` -> ``config``; ``fp4fuse`` -> ``fp4fuse``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _rank(module: str) -> int:
    return LAYER_RANK.get(_layer(module), TOP_LEVEL)


def _imports(path: pathlib.Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "fp4fuse" or m.startswith("fp4fuse.")}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def test_imports_go_one_way():
    violations = []
    for module, path in _modules().items():
        if _rank(module) == TOP_LEVEL:
            continue
        for target in _imports(path, module):
            same_folder = _layer(target) == _layer(module)
            if target == "fp4fuse" or (not same_folder and _rank(target) >= _rank(module)):
                violations.append(f"{module} imports {target}")
    assert violations == []


def test_every_subpackage_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYER_RANK)
