"""Makes tests/structured_output a package, so pytest imports its conftest.py as structured_output.conftest
(beside the top-level conftest module the tests import from)."""
