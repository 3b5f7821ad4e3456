"""The front page and the docs: every relative link resolves, and the README stays a front page."""

import ast
import codecs
import shlex
import re

import sampler
from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "SPEC.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "course" / "README.md"]


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
    for picture in ("docs/layout.png", "docs/decode.png", "docs/bench.png", "docs/decode.gif"):
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


METHOD_FILES = ("model.py", "kvcache.py", "data.py", "train.py", "sampler.py")


def lines_of(name):
    """The lines of a top-level file (`kvcache.py`), or of a function of the method files
    (`generate_refusion_plain`: from its def to its last line, as ast counts them)."""
    if name.endswith(".py"):
        return len((ROOT / name).read_text(encoding="utf-8").splitlines())
    for file in METHOD_FILES:
        for node in ast.walk(ast.parse((ROOT / file).read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node.end_lineno - node.lineno + 1
    raise AssertionError(f"the README counts the lines of {name}, which is no file or function")


def test_every_line_count_the_readme_states_is_computed_from_the_files():
    """"`kvcache.py` (107 lines)", "`generate_refusion_plain` (78 lines)" and "hold 1,616 lines
    together" (the five method files): each figure is the files' own."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())  # lines rejoined
    claims = re.findall(r"`([\w.]+)` \((\d[\d,]*) lines\)", text)
    assert len(claims) >= 6
    for name, figure in claims:
        assert lines_of(name) == int(figure.replace(",", "")), name
    total = re.findall(r"hold (\d[\d,]*) lines together", text)
    assert [int(t.replace(",", "")) for t in total] == [sum(map(lines_of, METHOD_FILES))]


def sampler_commands():
    """Every `python sampler.py ...` command the README and the docs show, as argument lists
    (a trailing `# comment` dropped, bash's $'...' decoded), with the page it is on."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        lines = [line for block in spans for line in block.replace("\\\n", " ").splitlines()]
        lines += [" ".join(span.split()) for span in re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`", text)]
        for line in lines:
            for command in re.findall(r"python sampler\.py(?: [^&|]*)?", line):
                command = re.sub(r"\s+#.*$", "", command).strip()
                command = re.sub(r"\$'((?:[^'\\]|\\.)*)'",
                                 lambda m: shlex.quote(codecs.decode(m[1], "unicode_escape")),
                                 command)
                found.append((page.relative_to(ROOT), shlex.split(command)[2:]))
    return found


def test_every_sampler_command_the_docs_show_runs_after_the_quick_start(tmp_path, monkeypatch,
                                                                         capsys):
    """The commands that read the quick start's model (config/sample_quotes.py, out-quotes/) run
    as written after the quick start, and those that read out/ after `python train.py`: each on a
    tiny model of the same config, from a directory holding config/ as the root does, on at most 2
    validation prompts. (Commands for other models, --init_from=smollm2 or
    --out_dir=out-qwen3-8b, need those models.)"""
    import train
    from support.prepare import TokenDataset
    first_fitting = TokenDataset.first_fitting       # 2 prompts a command: what runs is the same
    monkeypatch.setattr(TokenDataset, "first_fitting", lambda self, n, *a: first_fitting(
        self, min(n, 2), *a))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").symlink_to(ROOT / "config")
    (tmp_path / "my_prompt.txt").write_text("print('hi')\n")
    tiny = ["--max_iters=2", "--n_layer=1", "--n_head=2", "--n_embd=16", "--batch_size=4",
            "--eval_interval=1", "--eval_iters=1", f"--data_root={tmp_path / 'data'}"]
    train.main(["config/train_quotes.py"] + tiny)
    train.main(tiny + ["--block_size=256"])                # python train.py: out/, stdlib
    runnable = [(page, argv) for page, argv in sampler_commands()
                if not any(a.startswith(("--init_from", "--out_dir")) or
                           a.startswith("config/") and a != "config/sample_quotes.py"
                           for a in argv)]
    assert len(runnable) >= 10
    for page, argv in runnable:
        try:
            sampler.main(argv + ["--max_new_tokens=32"] * ("--max_new_tokens=64" in argv))
        except SystemExit as e:                            # --help
            assert e.code == 0 and argv == ["--help"], (page, argv)
        assert "error" not in capsys.readouterr().err, (page, argv)
