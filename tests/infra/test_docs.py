"""The README, the docs site (mkdocs.yml, docs/) and the LICENSE: the README stays short and its
links land, the strict build fails on a broken link or anchor, and the LICENSE is the one
pyproject.toml names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MKDOCS = Path(sys.executable).with_name("mkdocs")
#: A markdown link's target: ``[text](target)``.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(page: Path) -> set[str]:
    """The anchors of a markdown page's headings, as MkDocs' toc extension (and GitHub, for plain
    words) makes them; code fences skipped."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(slugify(m.group(1).replace("`", ""), "-"))
    return anchors


def test_the_readme_is_at_most_10_kb_and_its_test_command_is_make_test():
    assert README.stat().st_size <= 10 * 1024, README.stat().st_size
    assert "make test " in README.read_text()


def test_every_relative_link_of_the_readme_lands_on_a_file_and_heading():
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z]+://", t)]
    assert len(targets) >= 10
    for target in targets:
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), target
        if anchor:
            assert anchor in headings(REPO / path), target


def test_make_lint_builds_the_docs_strictly():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\nlint:") :].split("\n\n", 1)[0]
    assert re.search(r"mkdocs build --strict --site-dir \$\(SITE_DIR\)", recipe), recipe
    assert "--quiet" not in recipe  # it hides the warnings that --strict counts
    assert re.search(r"^SITE_DIR \?= \.site$", makefile, flags=re.M)
    assert ".site/" in (REPO / ".gitignore").read_text().split()


@pytest.mark.parametrize(
    ("link", "named"),
    [("getting-started.md", None), ("no-such-page.md", "no-such-page.md"), ("layout.md#no-such-part", "no-such-part")],
)
def test_the_strict_build_fails_on_a_broken_link_or_anchor(tmp_path, link, named):
    """A copy of the docs with one more link on the landing page: the build passes with a good
    link and fails, naming it, with a link to a missing page or a missing anchor."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "index.md").open("a") as index:
        index.write(f"\nSee [this]({link}).\n")
    env = {"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"}
    build = [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True, env=env)
    if named is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0 and named in done.stderr, done.stderr


def test_the_license_is_the_apache_2_0_text_pyproject_names():
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for section in range(1, 10):
        assert re.search(rf"^\s+{section}\. [A-Z]", text, flags=re.M), section
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
