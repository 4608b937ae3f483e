"""Sphinx configuration of kclpy's documentation site: docs/*.md as they read on GitHub, and
an API reference generated from the public API's docstrings (docs/api.md).

Built strictly by the suite (tests/system/test_docs_site.py: warnings are errors, so a broken link,
anchor or reference fails it); by hand: ``sphinx-build -W -b html docs docs/_build``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kclpy  # noqa: E402

project = "kclpy"
author = "the kclpy authors"
copyright = "2026, the kclpy authors"  # noqa: A001
release = kclpy.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
# GitHub's heading anchors, so that links between the pages work on GitHub and on the site
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "alabaster"
html_static_path: list[str] = []
