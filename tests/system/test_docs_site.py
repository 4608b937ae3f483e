"""The documentation site (Sphinx over docs/*.md, with the API reference from the public API's
docstrings) builds strictly: any warning, such as a broken link, anchor or reference, fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def build(docs: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(docs),
         str(out)], capture_output=True, text=True, timeout=600)


def test_the_site_builds_with_every_page_and_the_api_reference(tmp_path: Path) -> None:
    result = build(ROOT / "docs", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-5000:]
    built = {path.stem for path in (tmp_path / "site").glob("*.html")}
    pages = {path.stem for path in (ROOT / "docs").glob("*.md")}
    assert pages <= built, pages - built
    api = (tmp_path / "site" / "api.html").read_text()
    import kclpy

    public = [name for name in kclpy.__all__ if not name.startswith("_")]
    missing = [name for name in public if f'id="kclpy.{name}"' not in api]
    assert not missing, f"public names missing from docs/api.md: {missing}"


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The site's own configuration, on two pages (a whole build is slow): one anchor
    resolves, the other does not, and only the other is reported."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(ROOT / "docs" / "conf.py", docs)
    (docs / "index.md").write_text("# Site\n\n```{toctree}\nother\n```\n\n"
                                   "See [there](other.md#a-heading) and "
                                   "[nowhere](other.md#no-such-heading).\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n\nText.\n")
    result = build(docs, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-heading" in result.stderr and "a-heading" not in result.stderr
