"""The package as it ships: its version, and a wheel that holds its Lua scripts.

``.ci/run`` goes further (the sdist, the wheel built from it installed in a new
virtualenv, the demo run from it); these are the quick checks of the same promises.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import celery_baton
from tests.support.package_contents import lua_scripts, package_files, wheel_problems
from tests.support.processes import REPO_ROOT


def test_the_version_printed_is_the_installed_one(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    installed = metadata.version("celery-baton")
    assert done.stdout == f"celery-baton {installed}\n"
    assert celery_baton.__version__ == installed


@pytest.mark.timeout(180)  # ~5-10 s here: pip builds in an isolated env with hatchling
def test_a_wheel_built_from_the_tree_holds_every_lua_script(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [wheel] = tmp_path.glob("celery_baton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert len(lua_scripts()) >= 20
    assert [s for s in lua_scripts() if s not in names] == []
    assert wheel_problems(wheel) == []


def test_the_check_names_a_script_the_wheel_left_out(tmp_path: Path) -> None:
    wheel = tmp_path / "celery_baton-0-py3-none-any.whl"
    left_out = lua_scripts()[0]
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in package_files():
            if name != left_out:
                zf.writestr(name, "")
        zf.writestr("stray.txt", "")
    assert wheel_problems(wheel) == [
        f"missing from the wheel: {left_out}",
        "in the wheel but not the package: stray.txt",
    ]
