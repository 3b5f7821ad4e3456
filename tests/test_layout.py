"""The repository's layout: the method at the top level, the rest in support/ and tools/, and
imports that flow one way (read from the code with `ast`; every violation is named)."""

import ast
import io
import re
import subprocess
import sys
import tokenize

from helpers import ROOT

METHOD = {"model", "kvcache", "data", "train", "sampler"}        # the design card's files
TOP = METHOD | {"configurator", "test_refusion"}
CORE = {"model", "kvcache", "data"}                # the network, its cache, the training layouts
PACKAGES = {                                       # the packages each kind of file may import
    "core": {"torch", "numpy", "tiktoken"},        # ... besides the standard library
    "script": {"torch", "numpy", "tiktoken", "tqdm"},
    "test_refusion": {"torch", "numpy", "pytest"},
}
HEAVY = ("gguf", "safetensors", "jinja2", "tokenizers", "filelock", "torch.distributed.fsdp",
         "matplotlib", "support")


def project_files(pattern):
    """The repository's files matching pattern (a glob from the root): those git tracks in a
    checkout, so that a user's own scripts beside them are not the project's; else every file."""
    listed = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [ROOT / name for name in listed.stdout.split()]
    return sorted(ROOT.glob(pattern))


def modules():
    """{module: path} of every Python file of the project outside tests/ (support.runs, ...)."""
    found = {p.stem: p for p in project_files("*.py") if p.parent == ROOT}
    for folder in ("support", "tools"):
        found |= {f"{folder}.{p.stem}": p for p in project_files(f"{folder}/*.py")
                  if p.stem != "__init__"}
    return found


def is_main_block(node):
    """Whether node is `if __name__ == "__main__":`, the lines that run a file as a program."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in node.test.comparators))


def imports(path):
    """[(imported name, the function it is imported in, "__main__" in the file's
    `if __name__ == "__main__":` block, or None at module level, line)] of one file;
    `from support import runs` is support.runs."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            elif is_main_block(child):
                inner = "__main__"
            else:
                inner = function
            if isinstance(child, ast.Import):
                found.extend((alias.name, function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.extend((f"{child.module}.{alias.name}", function, child.lineno)
                             for alias in child.names)
            visit(child, inner)
    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return found


def project_name(name, project):
    """The project module an imported name belongs to (support.runs for support.runs.Start), or
    None for the standard library and other packages."""
    project = set(project) | set(modules()) | {"support", "tools"}
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in project:
            return ".".join(parts[:n])
    return None


def kind_of(module):
    if module in CORE:
        return "core"
    if module in ("train", "sampler"):
        return "script"
    return module if module == "test_refusion" else None


# where each script may reach support/: in main, its command line
REACHES_SUPPORT = {"train": ("main", "main, its command line"),
                   "sampler": ("main", "main, its command line")}


def violations(project):
    """Every import of the files `project` ({module: path}) that breaks the layout's rules, as
    text naming the file, the line and the rule."""
    found = []
    for module, path in project.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for name, function, line in imports(path):
            target, top = project_name(name, project), name.split(".")[0]
            place = f"{where}:{line} imports"
            if target is None:                          # the standard library or a package
                allowed = PACKAGES.get(kind_of(module))
                if allowed is not None and top not in sys.stdlib_module_names | allowed:
                    found.append(f"{place} {name}: {module} may import only "
                                 f"{', '.join(sorted(allowed))} besides the standard library")
                continue
            if target.startswith("tools"):
                found.append(f"{place} {target}: no module imports a tool")
            if module in CORE and target not in CORE:
                found.append(f"{place} {target}: model, kvcache and data import only each other")
            if module == "test_refusion" and target not in METHOD:
                found.append(f"{place} {target}: test_refusion imports only the method files")
            allowed_in, words = REACHES_SUPPORT.get(module, (None, ""))
            if kind_of(module) == "script" and target not in TOP and function != allowed_in:
                at = "at module level" if function is None else f"in {function}"
                found.append(f"{place} {target} {at}: {module}.py reaches support/ only in "
                             f"{words}")
            if module.startswith("support") and target == "train":
                found.append(f"{place} {target}: support/ serves train.py, never imports it")
    return found


def test_the_top_level_is_the_design_cards_files():
    assert {p.stem for p in project_files("*.py") if p.parent == ROOT} == TOP
    assert not (ROOT / "generate.py").exists()


def test_imports_flow_one_way():
    assert violations(modules()) == []


def test_the_import_graph_has_no_circle():
    project = modules()
    # a __main__ block runs a file as a program: the module itself imports none of it
    graph = {m: {project_name(n, project) for n, where, _ in imports(p) if where != "__main__"}
             - {None, m} for m, p in project.items()}
    graph = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    state = {}

    def circle_from(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                return path + [t]
            if t not in state and (found := circle_from(t, path + [t])):
                return found
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            circle = circle_from(m, [m])
            assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_the_checker_names_each_kind_of_forbidden_import(tmp_path):
    """The rules can fail: files that break each of them, in the places of the method files, are
    named with the rule they break."""
    files = {"sampler": "import torch\nfrom support.shard import shard_model\n\n"
                        "def main():\n    from support import sampling\n\n"
                        "def plan_slots():\n    from support import runs\n",
             "train": "import torch\nfrom support import runs\n\n"
                      "def main():\n    from support import runs\n",
             "data": "import safetensors\nfrom support.tokenizer import encode\n",
             "test_refusion": "from support import corpora\n",
             "support.runs": "import train\nimport sampler\n",  # the decoders: allowed
             "support.files": "from tools import bench\n"}
    bad = {m: tmp_path / f"{m}.py" for m in files}
    for m, text in files.items():
        bad[m].write_text(text)
    assert violations(bad) == [
        f"{bad['sampler']}:2 imports support.shard at module level: sampler.py reaches support/ "
        "only in main, its command line",
        f"{bad['sampler']}:8 imports support.runs in plan_slots: sampler.py reaches support/ only "
        "in main, its command line",
        f"{bad['train']}:2 imports support.runs at module level: train.py reaches support/ only "
        "in main, its command line",
        f"{bad['data']}:1 imports safetensors: data may import only numpy, tiktoken, torch besides "
        "the standard library",
        f"{bad['data']}:2 imports support.tokenizer: model, kvcache and data import only each "
        "other",
        f"{bad['test_refusion']}:1 imports support.corpora: test_refusion imports only the method "
        "files",
        f"{bad['support.runs']}:1 imports train: support/ serves train.py, never imports it",
        f"{bad['support.files']}:1 imports tools.bench: no module imports a tool"]


def test_the_method_imports_without_the_plumbings_packages():
    """Importing the loss, the layouts and the decoders loads no FSDP, GGUF, safetensors, jinja2,
    tokenizers, matplotlib or support/."""
    code = ("import sys, model, kvcache, data, train, sampler, test_refusion; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def docstring_line_numbers(text):
    """The numbers of a module's lines that are docstrings (the module's, a class's, a
    function's)."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                isinstance(first.value.value, str):
            found.update(range(first.lineno, first.end_lineno + 1))
    return found


def code_line_numbers(text):
    """The numbers of a module's lines that hold code: not blank, not only a comment, not in a
    docstring (as STYLE.md counts a budget: explanation is free)."""
    docstrings = docstring_line_numbers(text)
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return code - docstrings


def density_violations(module, text):
    """The packed lines of a method file: a backslash continuation, or a subscript whose index
    nests one call in another (`flat[0, :int(leading_true(passed)[0])]`)."""
    found = [f"{module}:{n} continues with a backslash" for n, line in
             enumerate(text.splitlines(), 1) if line.rstrip().endswith("\\")]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Subscript) and any(
                isinstance(inner, ast.Call) and inner is not call
                for call in ast.walk(node.slice) if isinstance(call, ast.Call)
                for inner in ast.walk(call)):
            found.append(f"{module}:{node.lineno} nests calls in a subscript: "
                         f"{ast.unparse(node)}")
    return found


def test_code_lines_and_packed_lines_are_told_apart():
    text = ('"""A module."""\n\n\ndef f(x):\n    """Its doc,\n    two lines."""\n'
            '    # a comment\n    y = [x,\n         x]  # and one after code\n'
            '    return y[int(len(y))] + \\\n        1\n')
    assert sorted(code_line_numbers(text)) == [4, 8, 9, 10, 11]
    assert density_violations("m", text) == [
        "m:10 continues with a backslash", "m:10 nests calls in a subscript: y[int(len(y))]"]
    assert density_violations("m", "y = x[len(x) - 1] + x[f(0)][g(1)]\n") == []


def test_the_method_reads_on_one_screen():
    """The budget of the reading path, in code lines (code_line_numbers: comments, blank lines and
    docstrings are free): sampler.py at most 600 and the five method files at most 1,250 together,
    besides verify="exact"'s section (SPEC 4.5, beyond the paper), at most 70 of its own; of their
    lines at least 10% are full-line comments;
    no function of theirs over 50 code lines but the decoder on one screen,
    generate_refusion_plain, at most 85; no packed line (density_violations); sampler.py's
    ReFusion sections read no infill setting (SPEC 4.1 is SpeculativeInfill's, in a section of its
    own), and the method imports no threads or queues (batching is support/batching.py's)."""
    lines = {m: (ROOT / f"{m}.py").read_text(encoding="utf-8") for m in sorted(METHOD)}
    code = {m: code_line_numbers(text) for m, text in lines.items()}
    text = lines["sampler"].splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith("# beyond the paper: verify"))
    last = next(i for i, line in enumerate(text) if line.startswith("# baseline decoders"))
    exact = {n for n in code["sampler"] if first < n <= last}
    assert len(exact) <= 70
    assert len(code["sampler"] - exact) <= 600
    assert sum(map(len, code.values())) - len(exact) <= 1250
    # explanation is free, and there is some: full-line comments are >= 10% of their lines
    comments = sum(line.lstrip().startswith("#") for text in lines.values()
                   for line in text.splitlines())
    assert comments >= 0.10 * sum(len(text.splitlines()) for text in lines.values())
    long = []
    for module, text in lines.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                limit = 85 if node.name == "generate_refusion_plain" else 50
                size = len(code[module] & set(range(node.lineno, node.end_lineno + 1)))
                if size > limit:
                    long.append(f"{module}.{node.name}: {size} code lines")
        assert not {"threading", "queue"} & {name for name, _, _ in imports(ROOT / f"{module}.py")}
    assert long == []
    assert [v for m, text in lines.items() for v in density_violations(m, text)] == []
    # the ReFusion sections: from the first to the section of SPEC 4.1
    text = lines["sampler"].splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith("# ReFusion on one screen"))
    last = next(i for i, line in enumerate(text) if line.startswith("# beyond the paper: infill"))
    reads = [(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(lines["sampler"]))
             if first < getattr(node, "lineno", 0) < last and
             (isinstance(node, ast.Attribute) and node.attr == "infill" or
              isinstance(node, ast.Constant) and node.value in ("paper", "speculative"))]
    assert reads == []


def calls_per_code_line(text, node=None):
    """Calls (ast.Call nodes) per code line of a module, or of one of its functions (node)."""
    code = code_line_numbers(text)
    if node is None:
        node = ast.parse(text)
    else:
        code &= set(range(node.lineno, node.end_lineno + 1))
    return sum(isinstance(n, ast.Call) for n in ast.walk(node)) / len(code)


def test_the_method_is_as_dense_as_the_anchors():
    """As nanoGPT, gpt-fast, nanochat and LLaDA write: at most 0.25 docstring lines per code line
    over the method files (docstrings say what, shapes, returns, raises and a SPEC pointer), at
    most 0.75 calls per code line in each, and 0.9 in the decoder on one screen."""
    lines = {m: (ROOT / f"{m}.py").read_text(encoding="utf-8") for m in sorted(METHOD)}
    docs = sum(len(docstring_line_numbers(text)) for text in lines.values())
    code = sum(len(code_line_numbers(text)) for text in lines.values())
    assert docs <= 0.25 * code
    assert {m: round(calls_per_code_line(text), 2) for m, text in lines.items()
            if calls_per_code_line(text) > 0.75} == {}
    plain = next(node for node in ast.parse(lines["sampler"]).body
                 if getattr(node, "name", "") == "generate_refusion_plain")
    assert calls_per_code_line(lines["sampler"], plain) <= 0.9


def test_density_is_counted_as_stated():
    text = ('"""A module."""\n\n\ndef f(x):\n    """Its doc,\n    two lines."""\n'
            '    y = g(h(x))\n    return y\n')
    assert sorted(docstring_line_numbers(text)) == [1, 5, 6]
    assert calls_per_code_line(text) == 2 / 3          # 2 calls, 3 code lines
    assert calls_per_code_line(text, ast.parse(text).body[1]) == 2 / 3


# a test's citation of the sentence it proves: "# SPEC 4, step 2: ..." or "SPEC section 3"
SPEC_CITATION = re.compile(r"SPEC (?:section )?(\d+(?:\.\d+)?)")


def comment_above(lines, node):
    """The full-line comments just above a function (and its decorators), top to bottom."""
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    found = []
    n = first - 1
    while n >= 1 and lines[n - 1].lstrip().startswith("#"):
        found.insert(0, lines[n - 1])
        n -= 1
    return found


def specification_violations(path):
    """The lines of a file of specification tests that break the method files' rules, as text
    naming the file, the line and the rule: a packed line (density_violations), several values
    assigned to several names at once (`a, b = x, y`), statements joined by a semicolon, a block
    on its header's line (`if x: y`), a test whose comment or docstring cites no SPEC section, and
    a test whose (first) section comes before the one of a test above it."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = density_violations(path.name, text)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.OP and token.string == ";":
            found.append(f"{path.name}:{token.start[0]} joins statements with a semicolon")
    compound = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        several_names = isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
        if several_names and isinstance(node.value, ast.Tuple):
            found.append(f"{path.name}:{node.lineno} assigns several values at once: "
                         f"{ast.unparse(node)}")
        if isinstance(node, compound) and node.body[0].lineno == node.lineno:
            found.append(f"{path.name}:{node.lineno} puts a block on its header's line")
    # the tests, top to bottom: each cites a section, in SPEC's order
    previous = "0"
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        cited = comment_above(lines, node) + [ast.get_docstring(node) or ""]
        sections = [m.group(1) for line in cited for m in SPEC_CITATION.finditer(line)]
        if not sections:
            found.append(f"{path.name}:{node.lineno} {node.name} cites no SPEC section")
            continue
        section = sections[0]
        if [int(n) for n in section.split(".")] < [int(n) for n in previous.split(".")]:
            found.append(f"{path.name}:{node.lineno} {node.name} cites SPEC {section} after a "
                         f"test citing SPEC {previous}")
        previous = section
    return found


def test_the_specification_tests_read_as_the_method_files_do():
    """test_refusion.py keeps the method files' rules (one statement a line, no packed line), and
    every test of it names the SPEC sentence it proves, in SPEC's order."""
    assert specification_violations(ROOT / "test_refusion.py") == []


def test_the_specification_checker_names_each_kind_of_violation(tmp_path):
    """The rules can fail: a file of specification tests that breaks each of them is named with
    the rule it breaks (a test citing SPEC 3 after one citing SPEC 4 among them), and the forms
    the rules allow (one call's tuple unpacked, a citation in a comment above the test or in its
    docstring) pass."""
    bad = tmp_path / "test_spec.py"
    bad.write_text('import torch\n'
                   '\n'
                   '\n'
                   '# SPEC 4, step 1: "Select every slot whose score exceeds `slot_threshold`"\n'
                   'def test_cited_above():\n'
                   '    P, L = 5, 24\n'
                   '    x = P; y = L\n'
                   '    if x: y = 0\n'
                   '    assert [x][int(len([y]))] == \\\n'
                   '        0\n'
                   '\n'
                   '\n'
                   'def test_cited_in_its_docstring():\n'
                   '    """SPEC section 3, step 5: the loss."""\n'
                   '    values, order = torch.sort(torch.zeros(3))\n'
                   '\n'
                   '\n'
                   '# the hybrid loss\n'
                   'def test_uncited():\n'
                   '    """A docstring, no citation."""\n')
    assert sorted(specification_violations(bad)) == sorted([
        "test_spec.py:6 assigns several values at once: P, L = (5, 24)",
        "test_spec.py:7 joins statements with a semicolon",
        "test_spec.py:8 puts a block on its header's line",
        "test_spec.py:9 continues with a backslash",
        "test_spec.py:9 nests calls in a subscript: [x][int(len([y]))]",
        "test_spec.py:13 test_cited_in_its_docstring cites SPEC 3 after a test citing SPEC 4",
        "test_spec.py:19 test_uncited cites no SPEC section"])


def test_no_two_functions_or_classes_share_a_name():
    """One name, one meaning: no two top-level functions or classes of the project's modules
    share a name (a script's `main` aside)."""
    where = {}
    for module, path in modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name != "main":
                where.setdefault(node.name, []).append(module)
    assert {name: found for name, found in where.items() if len(found) > 1} == {}


def defined_names(path):
    """The names a module defines at its top level (def, class, assignment), not those it
    imports."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return found


def test_every_name_is_imported_from_its_one_home():
    """No re-export: each `from X import name` of a project module X names something X itself
    defines, so that every setting, class and function has one home (the tests included)."""
    project = modules()
    files = list(project.values()) + project_files("tests/*.py")
    wrong = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        comments = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
                    if token.type == tokenize.COMMENT]
        if any("noqa: F401" in comment for comment in comments):
            wrong.append(f"{path.relative_to(ROOT)} re-exports (noqa: F401)")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in project:
                continue
            home = defined_names(project[node.module])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} takes {alias.name} from "
                      f"{node.module}, which does not define it"
                      for alias in node.names if alias.name not in home]
    assert wrong == []


def test_no_module_global_of_the_decoders_shadows_a_parameter():
    """sampler.py's functions read their settings from their parameters, never from a module
    global of the same name (the command line's settings are DEFAULTS, a dict): no top-level name
    of sampler.py or support/sampling.py is also a parameter there."""
    for path in (ROOT / "sampler.py", ROOT / "support" / "sampling.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        globals_ = defined_names(path) | {alias.asname or alias.name.split(".")[0]
                                          for node in tree.body
                                          if isinstance(node, (ast.Import, ast.ImportFrom))
                                          for alias in node.names}
        shadowed = {f"{path.name}:{node.lineno} {node.name}({arg.arg})"
                    for node in ast.walk(tree)
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs
                    if arg.arg in globals_}
        assert shadowed == set()


def test_each_package_index_names_every_module_and_only_modules():
    """support/__init__.py's docstring names every module of support/, a line each, and
    tools/__init__.py's every command of tools/ (python -m tools.X); neither names one that is
    not there."""
    for package, entry in (("support", r"^    (\w+) {2,}\S"), ("tools", r"python -m tools\.(\w+)")):
        index = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        named = set(re.findall(entry, index, re.MULTILINE))
        files = {p.stem for p in project_files(f"{package}/*.py")} - {"__init__"}
        assert named == files, (package, sorted(files - named), sorted(named - files))


def test_the_papers_layout_reads_no_option_beyond_the_paper():
    """reorganize_slots, layout_slots and layout_one_sample are the paper's layout alone: no name
    of an option beyond it (SPEC section 3: slot_end_labels, ar_fraction, pack) appears in them;
    train.py's make_batch applies those after the layout (data.label_slot_ends, mix_layouts)."""
    tree = ast.parse((ROOT / "data.py").read_text(encoding="utf-8"))
    options = {"slot_end_labels", "ar_fraction", "pack"}
    found = {(node.name, name.id if isinstance(name, ast.Name) else name.arg)
             for node in tree.body if isinstance(node, ast.FunctionDef)
             and node.name in ("reorganize_slots", "layout_slots", "layout_one_sample")
             for name in ast.walk(node) if isinstance(name, (ast.Name, ast.arg))
             and (name.id if isinstance(name, ast.Name) else name.arg) in options}
    assert found == set()


def test_python_sampler_py_loads_sampler_once():
    """python sampler.py runs as __main__ and nothing imports it again as `sampler` (no module of
    its command line imports the decoders back): -X importtime lists no module named sampler."""
    run = subprocess.run([sys.executable, "-X", "importtime", "sampler.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
                if line.startswith("import time:")]
    assert "support.sampling" in imported
    assert "sampler" not in imported
