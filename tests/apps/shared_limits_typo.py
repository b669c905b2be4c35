"""An app whose task names a limit ``baton_limits`` does not have (a typo), declared
before the app's conf has its limits (as with settings read late): the worker must
refuse to start, naming the limit and the one it probably meant."""

from __future__ import annotations

from tests.apps.factory import make_baton_app

app, baton = make_baton_app("shared_limits_typo", results=False)


@app.task(limits=["opneai"])
def summarize(text: str) -> None: ...


app.conf.baton_limits = {"openai": "90000/m"}  # known only now: checked at worker start
