"""For tools that still run `python setup.py ...`: the metadata lives in pyproject.toml alone."""
from setuptools import setup

setup()
