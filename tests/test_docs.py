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
            assert path.exists(), \
                f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            checked += 1
    assert checked >= 10


def test_the_readme_is_a_front_page_that_embeds_both_pictures():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for picture in ("docs/layout.png", "docs/decode.png", "docs/bench.png"):
        assert f"]({picture})" in text and (ROOT / picture).stat().st_size > 10_000


COMMAND = re.compile(r"\b(?:python3?|torchrun)\b[^`\n]*?\s(?:-m\s+([\w.]*\w)(?![\w.<])|"
                     r"([\w./-]+\.py))\b")  # "python -m tools.<name>": a placeholder
PY_FILE = re.compile(r"(?<![\w./<-])((?:[\w-]+/)*[\w-]+\.py)\b")


def test_every_command_and_python_file_the_docs_name_is_there():
    """`python X.py`, `torchrun ... X.py` and `python -m pkg.mod` name files of this repository
    (an absolute path is a user's own file), and so does every other X.py a page mentions (a path
    from the root; a top-level file by its name)."""
    named = 0
    for page in PAGES + [ROOT / "support" / "__init__.py", ROOT / "tools" / "__init__.py"]:
        text = page.read_text(encoding="utf-8")
        for module, script in COMMAND.findall(text):
            if module in ("pytest", "pip") or script.startswith("/"):
                continue                          # other programs, and a user's own files
            path = ROOT / (script or module.replace(".", "/") + ".py")
            assert path.is_file(), \
                f"{page.relative_to(ROOT)} runs {module or script}, which is not there"
            named += 1
        for name in PY_FILE.findall(text):
            assert (ROOT / name).is_file(), \
                f"{page.relative_to(ROOT)} names {name}, which is not there"
            named += 1
    assert named >= 50
