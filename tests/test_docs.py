"""The front page and the docs: every relative link resolves, and the README stays a front page."""

import re

from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "SPEC.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue                                   # web addresses and in-page anchors
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            checked += 1
    assert checked >= 10


def test_the_readme_is_a_front_page_that_embeds_both_pictures():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for picture in ("docs/layout.png", "docs/decode.png", "docs/bench.png"):
        assert f"]({picture})" in text and (ROOT / picture).stat().st_size > 10_000
