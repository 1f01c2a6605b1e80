"""Sphinx configuration: the API reference is generated from graphpool's docstrings.

Build (warnings are errors): ``python -m sphinx -W --keep-going -b html docs docs/_build``.
The source tree's ``src/`` comes first on the path, so the docs describe this checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import graphpool

project = "graphpool"
author = "the graphpool authors"
copyright = "the graphpool authors, Apache-2.0"
release = graphpool.__version__
version = release

extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
default_role = "literal"  # `name` in a docstring reads as code, as in the README
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
