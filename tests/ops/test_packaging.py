"""The project's top-level packages are its own: no installed distribution ships a module of the same name.

transformers 5 requires the ``kernels`` distribution, whose top-level module ``kernels`` used to
shadow this project's kernel package (or be shadowed by it) depending on the order of the import
path: ``pdserve`` run from outside the checkout imported the wrong one and failed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def top_level_packages() -> list[str]:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [pattern.rstrip("*") for pattern in patterns]
    assert names and all((ROOT / name / "__init__.py").is_file() for name in names), names
    return names


def test_no_installed_distribution_ships_a_top_level_package_of_ours() -> None:
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"pdserve"}) for name in top_level_packages() if name in owners}
    assert not {name: dists for name, dists in clashes.items() if dists}, clashes


def test_every_package_imports_from_the_checkout_outside_it(tmp_path: Path) -> None:
    """As the console script does: the interpreter started elsewhere, the checkout not on the path."""
    names = top_level_packages()
    code = "import importlib, sys\n" + "".join(f"print(importlib.import_module({name!r}).__file__)\n" for name in names)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files = [Path(line) for line in out.stdout.split()]
    assert files == [ROOT / name / "__init__.py" for name in names]
