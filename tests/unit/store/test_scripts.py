"""gate.lua is written as fragments and joined into one script when it is loaded
(store/scripts.py, join_gate). What runs is tested against a real server in
tests/store/test_gate.py; here, that the joining leaves one whole script."""

from __future__ import annotations

import re
from importlib import resources

from celery_baton.store.scripts import GATE_KINDS, join_gate, script_source


def lua(path: str) -> str:
    where = resources.files("celery_baton.store") / "lua"
    for part in path.split("/"):
        where = where / part
    return where.read_text()


def test_every_place_in_the_frame_is_filled_and_each_chain_opens_once() -> None:
    script = script_source("gate")
    assert "-- @" not in script and "--: " not in script
    checks = re.findall(r"^  (if|elseif) kind == '(.)'", script, re.M)
    assert checks[0] == ("if", "L") and all(word == "elseif" for word, _ in checks[1:])
    assert [kind for _, kind in checks] == list("LRPOFDBSNUKXQC")
    writes = re.findall(r"^  (if|elseif) w\[1\] == '(.)'", script, re.M)
    assert writes == [("if", "L"), ("elseif", "R"), ("elseif", "F")] + [
        ("elseif", kind) for kind in "NUKQC"
    ]


def test_a_kind_is_one_file_with_its_check_and_its_write() -> None:
    for kind in GATE_KINDS:
        sections = re.findall(r"^--: (\w+)$", lua(f"gate/{kind}.lua"), re.M)
        assert "check" in sections, kind
    assert re.findall(r"^--: (\w+)$", lua("gate/epochs.lua"), re.M) == ["epochs"]


def test_joining_reads_through_the_function_it_is_given() -> None:
    """bench/gate_cost.py joins an older revision's fragments read from git."""
    seen: list[str] = []

    def read(path: str) -> str:
        seen.append(path)
        return lua(path)

    assert join_gate(read) == script_source("gate")
    assert seen == [*(f"gate/{kind}.lua" for kind in GATE_KINDS), "gate/epochs.lua", "gate.lua"]


def test_no_lua_file_is_over_300_lines() -> None:
    lua_dir = resources.files("celery_baton.store") / "lua"
    files = [*lua_dir.iterdir(), *(lua_dir / "gate").iterdir()]
    long = {
        f.name: n
        for f in files
        if f.name.endswith(".lua") and (n := len(f.read_text().splitlines())) > 300
    }
    assert not long
