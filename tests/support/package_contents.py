"""What a built wheel and sdist must hold, and what they must not.

The package reads its Lua scripts (``store/lua/*.lua``) as package data at run time: a
wheel without them installs fine and fails at the first store call. So every file of
the package in the tree must be in the wheel, and in the sdist (a wheel built from the
sdist, as ``python -m build`` builds it, has only what the sdist had).

Standard library only: ``.ci/run`` calls it before any project virtualenv exists::

    python3 tests/support/package_contents.py DIST_DIR
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "celery_baton"

# The sdist is for building, testing and documenting the package; CI's script and the
# benchmarks stay in the repository (pyproject.toml, [tool.hatch.build.targets.sdist]).
SDIST_NEEDS = ("pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO", "tests/conftest.py")
SDIST_LEAVES_OUT = (".ci/", "bench/", ".git/")


def package_files() -> list[str]:
    """Every file of the package in the tree, as its path in a wheel (``celery_baton/...``)."""
    root = SRC / PACKAGE
    return sorted(
        path.relative_to(SRC).as_posix()
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def wheel_problems(wheel: Path) -> list[str]:
    names = set(zipfile.ZipFile(wheel).namelist())
    problems = [f"missing from the wheel: {f}" for f in package_files() if f not in names]
    problems += [
        f"in the wheel but not the package: {n}"
        for n in sorted(names)
        if not n.startswith((f"{PACKAGE}/", f"{PACKAGE}-"))
    ]
    return problems


def sdist_problems(sdist: Path) -> list[str]:
    with tarfile.open(sdist) as tar:
        # Every member sits under one top directory, celery_baton-<version>/.
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    problems = [
        f"missing from the sdist: src/{f}" for f in package_files() if f"src/{f}" not in names
    ]
    problems += [f"missing from the sdist: {n}" for n in SDIST_NEEDS if n not in names]
    problems += [
        f"in the sdist but should not be: {n}"
        for n in sorted(names)
        if n.startswith(SDIST_LEAVES_OUT) or "__pycache__" in n or n.endswith(".pyc")
    ]
    return problems


def lua_scripts() -> list[str]:
    return [f for f in package_files() if f.endswith(".lua")]


def main(dist: Path) -> int:
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    sdists = sorted(dist.glob(f"{PACKAGE}-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
        return 1
    problems = wheel_problems(wheels[0]) + sdist_problems(sdists[0])
    for problem in problems:
        print(problem)
    if not lua_scripts():
        problems.append("no Lua script found in the tree")
        print(problems[-1])
    if not problems:
        print(
            f"{wheels[0].name} and {sdists[0].name}: every package file "
            f"({len(package_files())}, {len(lua_scripts())} Lua scripts) in both"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
