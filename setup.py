"""Thin shim: all metadata lives in pyproject.toml. Compiled ops in csrc/ are optional (see csrc/README.md)."""
from setuptools import setup

setup()
