"""Makes tests/entrypoints a package, so pytest imports its conftest.py as entrypoints.conftest.

Without it (the tests use pytest's default "prepend" import mode and no test folder is a package), pytest
imports this folder's conftest.py as plain "conftest" and replaces tests/conftest.py in sys.modules; then
`from conftest import make_tiny_model` in folders collected later (tests/model) fails in a full run.
"""
