"""The nemesis soak's checks, a module per group; :mod:`tests.soak.checker` runs them all."""
