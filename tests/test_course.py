"""The course (course/*.ipynb): stored without outputs, and every notebook marked executable runs
top to bottom in a Jupyter kernel, its exercise solutions (course/solutions/) run after it and
hold."""

import json
import re

import pytest

from helpers import ROOT

COURSE = ROOT / "course"
NOTEBOOKS = sorted(COURSE.glob("*.ipynb"))
EXECUTED = [nb for nb in NOTEBOOKS
            if json.loads(nb.read_text(encoding="utf-8"))["metadata"].get("course", {})
            .get("execute", True)]


def solution_cells(notebook):
    """The solutions of a notebook's exercises as (exercise number, code) pairs, from
    course/solutions/<notebook's name>.py, one cell per '# %% N.k: ...' heading."""
    text = (COURSE / "solutions" / f"{notebook.stem}.py").read_text(encoding="utf-8")
    return [(m.group(1), m.group(0)) for m in re.finditer(r"^# %% (\d+\.\d+)\b.*?(?=^# %%|\Z)",
                                                          text, flags=re.M | re.S)]


def test_the_course_is_stored_without_outputs_and_every_exercise_has_its_solution():
    assert len(NOTEBOOKS) >= 4 and len(EXECUTED) >= 3
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        for cell in cells:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, \
                    f"{notebook.name}: clear its outputs before committing (Jupyter: Edit, Clear " \
                    "Outputs of All Cells)"
        if notebook in EXECUTED:
            asked = re.findall(r"\*\*(\d+\.\d+)\*\*",
                               "".join("".join(c["source"]) for c in cells
                                       if c["cell_type"] == "markdown"))
            assert asked and asked == [n for n, _ in solution_cells(notebook)], notebook.name


@pytest.mark.parametrize("notebook", EXECUTED, ids=lambda nb: nb.stem)
def test_each_notebook_runs_top_to_bottom_and_its_solutions_hold(notebook):
    """nbclient runs the notebook in a fresh kernel from course/, then each solution in the same
    kernel; a cell that raises (a failing assert of a solution included) fails the test."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(notebook, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(code) for _, code in solution_cells(notebook)]
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(COURSE)}}).execute()
    outputs = [o.get("text", "") for c in nb.cells[-len(solution_cells(notebook)):]
               for o in c.outputs]
    assert len(outputs) >= len(solution_cells(notebook))  # every solution printed its check
