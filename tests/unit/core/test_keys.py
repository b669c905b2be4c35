"""Canonical keys: bound to the signature, defaults applied, sorted JSON, hashed."""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from typing import Any

import pytest

from celery_baton import KeySpecError
from celery_baton.core.keys import KeyNames, KeySpec, digest


def fetch(host: str, path: str = "/", *, tenant: str = "t0") -> None: ...


def takes_kwargs(a: int, **extra: Any) -> None: ...


def build(spec: Any, fun: Any = fetch, **kw: Any) -> KeySpec:
    return KeySpec.build(spec, fun, subject="fetch.exclusive", **kw)


def test_positional_keyword_and_mixed_calls_give_one_key() -> None:
    spec = build(["host", "path"])
    calls = [
        (("h", "/p"), {}),
        (("h",), {"path": "/p"}),
        ((), {"host": "h", "path": "/p"}),
        ((), {"path": "/p", "host": "h"}),
    ]
    assert len({spec.key(args, kwargs) for args, kwargs in calls}) == 1


def test_defaults_are_applied() -> None:
    spec = build(["host", "path", "tenant"])
    assert spec.key(("h",), {}) == spec.key(("h", "/"), {"tenant": "t0"})
    assert spec.key(("h",), {}) != spec.key(("h", "/x"), {})


def test_material_is_sorted_compact_json_of_the_named_arguments() -> None:
    spec = build(["path", "host"])
    material = spec.material(("h", "/p"), {})
    assert material == '{"host":"h","path":"/p"}'
    assert spec.key(("h", "/p"), {}) == digest(material)
    assert digest(material) == hashlib.blake2b(material.encode(), digest_size=12).hexdigest()
    # Nested values are canonical too: dict order does not matter.
    nested = build("host")
    assert nested.material(({"b": 1, "a": [1, 2]},), {}) == json.dumps(
        {"host": {"a": [1, 2], "b": 1}}, sort_keys=True, separators=(",", ":")
    )
    assert nested.key(({"b": 1, "a": 2},), {}) == nested.key(({"a": 2, "b": 1},), {})


def test_only_the_named_arguments_count() -> None:
    spec = build("host")
    assert spec.key(("h", "/a"), {}) == spec.key(("h", "/b"), {"tenant": "x"})
    assert spec.key(("h",), {}) != spec.key(("g",), {})
    assert spec.key((1,), {}) != spec.key(("1",), {})  # types are part of the key


def test_whole_task_key() -> None:
    spec = build(True)
    assert spec.material(("h",), {}) == spec.material(("g",), {}) == ""


def test_template() -> None:
    spec = build("{tenant}/{host}")
    assert spec.material(("h",), {}) == "t0/h"
    assert spec.key(("h",), {"tenant": "x"}) == spec.key((), {"host": "h", "tenant": "x"})
    attr = build("{host[0]}")
    assert attr.material(("hx",), {}) == "h"


def test_callable() -> None:
    spec = build(lambda host, path="/", **kw: host.lower())
    assert spec.material(("H",), {}) == "h"
    assert spec.key(("H",), {}) == spec.key(("h", "/other"), {})
    bad = build(lambda *a, **kw: 42)
    with pytest.raises(KeySpecError, match="not str"):
        bad.material(("h",), {})


def test_var_keyword_arguments_can_be_named() -> None:
    spec = build("region", takes_kwargs)
    assert spec.material((1,), {"region": "eu"}) == '{"region":"eu"}'
    with pytest.raises(KeySpecError, match="lacks"):
        spec.material((1,), {})


def test_bound_task_signature_skips_self() -> None:
    def run(self: Any, item: int) -> None: ...

    spec = KeySpec.build("item", run, subject="t.exclusive", bound=True)
    assert spec.key((3,), {}) == spec.key((), {"item": 3})
    with pytest.raises(KeySpecError, match="self"):
        KeySpec.build("self", run, subject="t.exclusive", bound=True)


@pytest.mark.parametrize(
    "spec",
    [
        "missing",
        ["host", "missing"],
        "{missing}/{host}",
        "{}",
        "",
        [],
        42,
        [1],
        False,
    ],
)
def test_invalid_specs_raise_at_build(spec: Any) -> None:
    with pytest.raises(KeySpecError) as error:
        build(spec)
    assert "fetch.exclusive" in str(error.value)


def test_missing_argument_error_names_the_argument_and_the_signature() -> None:
    with pytest.raises(KeySpecError, match=r"'missing'.*takes: host, path, tenant"):
        build("missing")


@pytest.mark.parametrize(
    "value", [object(), float("nan"), float("inf"), b"bytes", {1, 2}, {("a",): 1}]
)
def test_unserialisable_argument_raises_key_spec_error(value: Any) -> None:
    spec = build("host")
    with pytest.raises(KeySpecError, match="serialised"):
        spec.material((value,), {})


def test_arguments_that_do_not_fit_the_signature_raise_key_spec_error() -> None:
    spec = build("host")
    with pytest.raises(KeySpecError, match="do not match"):
        spec.key(("h", "/", "extra"), {})
    with pytest.raises(KeySpecError, match="do not match"):
        spec.key((), {"nope": 1})


def test_template_error_raises_key_spec_error() -> None:
    spec = build("{host.nope}")
    with pytest.raises(KeySpecError, match="template"):
        spec.material(("h",), {})


def test_any_error_of_the_apps_key_code_is_a_key_spec_error() -> None:
    """A key function that raises, or a template whose format spec does not fit the
    argument (ValueError), refuse the call with KeySpecError naming the task: anything
    else escaped the worker's refusal and killed it (Unrecoverable error)."""
    func = build(lambda host, path="/": f"{host}/{1 // len(path)}")
    with pytest.raises(KeySpecError, match="key function raised ZeroDivisionError") as caught:
        func.material(("h", ""), {})
    assert caught.value.subject == func.subject
    spec = build("{host}-{path:05d}")
    with pytest.raises(KeySpecError, match=r"template .*ValueError"):
        spec.material(("h", "abc"), {})
    assert spec.material(("h", 7), {}) == "h-00007"


def test_key_names_share_one_hash_tag_per_task() -> None:
    names = KeyNames()
    keys = [
        names.lease("app.t", "ex", "d"),
        names.lease("app.t", "cc", "d"),
        names.rate("app.t", "d"),
        names.unique("app.t", "d"),
        names.done("app.t", "id"),
        names.limits("app.t"),
    ]
    assert keys[0] == "baton:{app.t}:ex:d"
    assert keys[3] == "baton:{app.t}:uq:d"
    assert all(key.startswith("baton:{app.t}:") for key in keys)
    assert KeyNames("p").unique("x", "d") == "p:{x}:uq:d"


def _plain(a: Any, b: Any = 2, *, c: Any = 3) -> None: ...
def _kw(a: Any, b: Any = 2, **kw: Any) -> None: ...
def _posonly(a: Any, /, b: Any = 2) -> None: ...
def _star(a: Any, *rest: Any, b: Any = 2) -> None: ...


@pytest.mark.parametrize("fun", [_plain, _kw, _posonly, _star])
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        ((1, 5), {}),
        ((), {"a": 1}),
        ((1,), {"b": 5, "c": 6}),
        ((1,), {"z": 9}),  # unknown: only **kw takes it
        ((1,), {"a": 1}),  # a given twice
        ((), {}),  # a missing
        ((1, 2, 3), {}),  # one too many for most
    ],
)
def test_fast_binding_agrees_with_signature_bind(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The worker binds arguments without ``Signature.bind`` when it can; the result, or
    the error, must be exactly what ``Signature.bind`` gives."""
    spec = KeySpec.build(["a", "b"], fun, subject="t")
    signature = inspect.signature(fun)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        with pytest.raises(KeySpecError, match="do not match"):
            spec.arguments(args, kwargs)
        return
    bound.apply_defaults()
    expected = dict(bound.arguments)
    expected.update(expected.pop("kw", {}))
    assert spec.arguments(args, kwargs) == expected


@pytest.mark.parametrize("template", ["{k", "k}", "{feed_url!z}", "{feed_url:{}"])
def test_a_template_python_cannot_parse_names_the_task_and_the_option(template: str) -> None:
    """``exclusive="{k"`` was a bare ``ValueError: expected '}' before end of string``
    (issue 39 §5)."""

    def fetch(feed_url: str) -> None: ...

    with pytest.raises(KeySpecError) as error:
        KeySpec.build(template, fetch, subject="feeds.fetch.exclusive")
    assert str(error.value).startswith("feeds.fetch.exclusive: "), error.value
    assert repr(template) in str(error.value)


def _one(a: Any) -> None: ...
def _one_required_kw(a: Any, *, b: Any) -> None: ...


@pytest.mark.parametrize("fun", [_one, _plain, _kw, _posonly, _star, _one_required_kw])
@pytest.mark.parametrize(
    "value",
    [0, -7, 10**30, "", "x", 'a "quoted" \\ back', "é ☃ \U0001f600", "\x00\n\t\u2028", True, 1.5],
)
@pytest.mark.parametrize("more", [(), (5,), (5, 6)])
def test_one_argument_material_is_the_general_paths_json(
    fun: Callable[..., Any], value: Any, more: tuple[Any, ...]
) -> None:
    """One named argument given by position (an id: an int or a str) is written without
    binding the call; the text, or the error, must be exactly the general path's."""
    spec = KeySpec.build("a", fun, subject="t")
    args = (value, *more)
    try:
        bound = inspect.signature(fun).bind(*args)
    except TypeError:
        with pytest.raises(KeySpecError, match="do not match"):
            spec.material(args, {})
        return
    bound.apply_defaults()
    expected = json.dumps(
        {"a": bound.arguments["a"]}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert spec.material(args, {}) == expected


def test_an_empty_list_points_at_true() -> None:
    """celery-once's ``once={"keys": []}`` copied to ``unique=[]``: ours is ``True``."""
    with pytest.raises(
        KeySpecError, match=r"names no argument \(one key for the whole task is True\)"
    ):
        build([])
