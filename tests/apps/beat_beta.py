"""Project "beta" of the two-projects beat tests (see ``tests.apps.beat_project``)."""

from tests.apps.beat_project import project

app, record = project("beta", {"every1": 1.0, "beta_only": 3.0})
