"""Project "alpha" of the two-projects beat tests (see ``tests.apps.beat_project``)."""

from tests.apps.beat_project import project

app, record = project("alpha", {"every1": 1.0, "alpha_only": 2.0})
