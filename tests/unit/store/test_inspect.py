"""A lease key in words (issue 28 §2): what the operator reads beside the digest."""

from __future__ import annotations

from celery_baton.core.keys import WORDS_MAX, words
from celery_baton.store.inspect import label_key

KEY = "baton:{proj.import_feed}:ex:87a53f"


def test_named_arguments_read_as_a_call() -> None:
    assert words(KEY, '{"feed_url":"https://a.example/rss","page":2}') == (
        "import_feed(feed_url='https://a.example/rss', page=2)"
    )


def test_long_values_are_cut_and_keep_their_quote() -> None:
    text = words(KEY, '{"feed_url":"' + "x" * 1000 + '"}')
    assert text.startswith("import_feed(feed_url='xxx") and text.endswith("…')")
    many = words(KEY, "{" + ",".join(f'"a{i}":"{"y" * 50}"' for i in range(20)) + "}")
    assert len(many) <= WORDS_MAX and len(text) <= WORDS_MAX


def test_whole_task_template_and_function_text() -> None:
    assert words(KEY, "") == "import_feed (the whole task)"
    assert words(KEY, "feed-7") == "import_feed: feed-7"


def test_the_label_key_is_beside_the_lease_and_matches_no_lease_pattern() -> None:
    import fnmatch

    assert label_key(KEY) == "baton:{proj.import_feed}:label:ex:87a53f"
    for kind in ("ex", "cc", "run", "uq"):
        assert not fnmatch.fnmatchcase(label_key(KEY), f"baton:{{*}}:{kind}:*")
