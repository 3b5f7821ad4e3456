"""The course (course/*.ipynb): stored without outputs, and every notebook marked executable runs
top to bottom in a Jupyter kernel, its exercise solutions (course/solutions/) run after it and
hold."""

import json
import re
import shutil
import sys

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


def run_notebook(nb, folder, tmp_path):
    """Execute the notebook nb (nbformat) in place, from folder, in a fresh kernel of the
    interpreter that runs the tests (whatever the "python3" kernelspec of this machine names),
    with TMPDIR tmp_path / "tmp": a cell that raises fails the test."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    specs = tmp_path / "kernels"
    write_kernel_spec(specs / "this-python")   # runs sys.executable -m ipykernel_launcher
    (tmp_path / "tmp").mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(tmp_path / "tmp"))
        km = KernelManager(kernel_name="this-python",
                           kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs)]))
        try:
            nbclient.NotebookClient(nb, km=km, timeout=600,
                                    resources={"metadata": {"path": str(folder)}}).execute()
        finally:  # a kernel manager given to nbclient is the caller's to shut down
            if km.has_kernel:
                km.shutdown_kernel()


def test_notebooks_run_in_the_interpreter_that_runs_the_tests(tmp_path, monkeypatch):
    """A "python3" kernelspec of another interpreter (here one that cannot start) is not used."""
    nbformat = pytest.importorskip("nbformat")
    other = tmp_path / "jupyter" / "kernels" / "python3"
    other.mkdir(parents=True)
    (other / "kernel.json").write_text(json.dumps({"argv": ["/bin/false"], "language": "python",
                                                   "display_name": "another Python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys\n"
                                                                   "print(sys.executable)")])
    run_notebook(nb, tmp_path, tmp_path)
    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable


@pytest.mark.parametrize("notebook", EXECUTED, ids=lambda nb: nb.stem)
def test_each_notebook_runs_top_to_bottom_and_its_solutions_hold(notebook, tmp_path):
    """nbclient runs the notebook in a fresh kernel from course/, then each solution in the same
    kernel; a cell that raises (a failing assert of a solution included) fails the test. What the
    notebook puts in the temporary folder is gone when its kernel has stopped."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(notebook, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(code) for _, code in solution_cells(notebook)]
    run_notebook(nb, COURSE, tmp_path)
    outputs = [o.get("text", "") for c in nb.cells[-len(solution_cells(notebook)):]
               for o in c.outputs]
    assert len(outputs) >= len(solution_cells(notebook))  # every solution printed its check
    assert list((tmp_path / "tmp").glob("course-*")) == []  # (torch may keep its own caches)


def test_the_first_notebook_runs_in_a_checkout_whose_data_folder_cannot_be_written(tmp_path):
    """A checkout where data/ cannot be made (here a file holds its name: no user, root included,
    can write there): notebook 1 prepares its data and draws its picture in a temporary folder,
    says so, and leaves nothing behind."""
    nbformat = pytest.importorskip("nbformat")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for entry in ROOT.iterdir():   # the code linked, course/ copied (its ".." is the checkout)
        if entry.name not in ("data", ".git", "course"):
            (checkout / entry.name).symlink_to(entry)
    shutil.copytree(COURSE, checkout / "course")
    (checkout / "data").write_text("not a folder")
    nb = nbformat.read(COURSE / "01_slots.ipynb", as_version=4)
    run_notebook(nb, checkout / "course", tmp_path)
    notes = [o["text"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if o.get("name") == "stderr"]
    assert any(f"note: {checkout / 'data'} cannot be written" in t for t in notes), notes
    assert list((tmp_path / "tmp").glob("course-*")) == []
