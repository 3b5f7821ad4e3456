"""python -m tools.gpu_report, the acceptance check on one GPU, in its quick mode on the CPU: every
section's figures in both files, a failing section recorded while the others run, and the budget
that skips what it has no time for."""

import json
import time

import pytest

from tools import gpu_report


def run_quick(tmp_path, *flags):
    """The report's quick mode on the CPU at its tiniest settings, into tmp_path (its models, data
    and files). Returns the report read back from bench_gpu.json, and bench_gpu.md's text."""
    gpu_report.main(["--device=cpu", "--quick=True", f"--out={tmp_path / 'docs'}",
                     f"--work_dir={tmp_path / 'work'}", f"--data_root={tmp_path / 'data'}",
                     "--num_lines=2", "--train_iters=4", "--recipe_iters=3", "--steady_iters=1",
                     "--repeats=1", *flags])
    report = json.loads((tmp_path / "docs" / "bench_gpu.json").read_text())
    return report, (tmp_path / "docs" / "bench_gpu.md").read_text()


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("no such GPU")
    monkeypatch.setattr(gpu_report, "machine", broken)          # inside the machine section
    report, md = run_quick(tmp_path)
    sections = report["sections"]
    assert list(sections) == list(gpu_report.SECTIONS)
    assert sections["machine"]["error"] == "RuntimeError: no such GPU"
    assert "Failed after" in md and "`RuntimeError: no such GPU`" in md
    for name in ("quick_start", "decoding", "attention", "recipe_85m", "pass_costs"):
        assert "result" in sections[name], sections[name].get("traceback")
    attention = {(r["decoder"], r["backend"]): r for r in sections["attention"]["result"]["runs"]}
    assert len(attention) == 2 * 4 + 1
    math_rows = [attention[d, "math"] for d in ("next_token", "refusion")]
    assert all(r["nfe"] > 0 for r in math_rows)        # the math kernel runs on every device
    every = attention["next_token, a read every token", "default"]
    assert every["tokens"] == math_rows[0]["tokens"]   # the same tokens, read more often
    decoding = sections["decoding"]["result"]
    assert decoding["lines"] == 2
    assert {(r["decoder"], r["batch_size"]) for r in decoding["runs"]} == {
        (d, b) for d in ("ReFusion", "next-token", "MDM") for b in (1, 4)}
    for run in decoding["runs"]:
        assert run["nfe"] > 0 and run["passes"] > 0 and run["model_ms_per_pass"] > 0
    assert sections["quick_start"]["result"]["refusion"]["iters"] == 4
    assert sections["recipe_85m"]["result"]["iters"] == 3
    costs = sections["pass_costs"]["result"]
    assert set(costs["quick start"]["result"]["ms"]["eager"]) == {"1", "8", "32"}
    assert costs[gpu_report.SMOLLM2]["result"]["params_m"] > 130
    assert "compiled variants" in report["notes"][0]           # --quick on a CPU skips them


def test_past_the_budget_the_sections_not_started_are_skipped(tmp_path, monkeypatch):
    def slow(cfg, clock):
        time.sleep(0.2)
        return {"slept": 0.2}
    for name in gpu_report.SECTIONS:
        monkeypatch.setitem(gpu_report.SECTIONS, name, slow)
    cfg = gpu_report.parse_args(gpu_report.DEFAULTS, ["--device=cpu", "--budget_s=0.1",
                                                     f"--out={tmp_path}"])
    cfg["notes"] = []
    sections = gpu_report.run_report(cfg)["sections"]
    assert sections["machine"]["result"] == {"slept": 0.2}
    for name in ("quick_start", "decoding", "attention", "recipe_85m", "pass_costs"):
        assert sections[name]["skipped"].startswith("skipped: the budget of 0.1 s was spent")
    md = (tmp_path / "bench_gpu.md").read_text()
    assert md.count("Skipped: the budget of 0.1 s was spent") == 5


def stub_sections(monkeypatch, stop=None):
    """Every section a stub that records its name (the list returned); the section `stop` raises
    what stop[1] gives instead."""
    ran = []
    for name in gpu_report.SECTIONS:
        def section(cfg, clock, name=name):
            ran.append(name)
            if stop and name == stop[0]:
                raise stop[1]
            return {"ran": name}
        monkeypatch.setitem(gpu_report.SECTIONS, name, section)
    return ran


@pytest.mark.parametrize("stop", [
    KeyboardInterrupt(),
    SystemExit("interrupted after 3 iterations; saved out/ckpt.pt. Continue with `python "
               "train.py --out_dir=out --init_from=resume`")])
def test_ctrl_c_stops_the_report_keeping_what_was_written(tmp_path, monkeypatch, stop):
    """Ctrl-C in a section (or in one of its training runs, which saves and exits) is no failure
    of that section: the run stops, both files holding the sections before it and the one it
    stopped in marked so; no section after it runs."""
    ran = stub_sections(monkeypatch, ("decoding", stop))
    cfg = gpu_report.parse_args(gpu_report.DEFAULTS, ["--device=cpu", f"--out={tmp_path}"])
    cfg["notes"] = []
    with pytest.raises(type(stop)):
        gpu_report.run_report(cfg)
    assert ran == ["machine", "quick_start", "decoding"]
    sections = json.loads((tmp_path / "bench_gpu.json").read_text())["sections"]
    assert list(sections) == ["machine", "quick_start", "decoding"]
    assert sections["quick_start"]["result"] == {"ran": "quick_start"}
    assert sections["decoding"]["stopped"].startswith("stopped by Ctrl-C or a stop signal after")
    assert "Stopped by Ctrl-C or a stop signal after" in (tmp_path / "bench_gpu.md").read_text()


def test_an_exit_that_reports_an_error_is_the_sections_failure(tmp_path, monkeypatch):
    """A training run whose loss diverged exits with "error: ..."; that section failed, and the
    next still runs."""
    ran = stub_sections(monkeypatch, ("recipe_85m", SystemExit("error: the loss is nan at "
                                                                "iteration 3")))
    cfg = gpu_report.parse_args(gpu_report.DEFAULTS, ["--device=cpu", f"--out={tmp_path}"])
    cfg["notes"] = []
    sections = gpu_report.run_report(cfg)["sections"]
    assert sections["recipe_85m"]["error"] == "SystemExit: error: the loss is nan at iteration 3"
    assert ran == list(gpu_report.SECTIONS) and "result" in sections["pass_costs"]


@pytest.mark.parametrize("flag, message", [
    ("--sections=()", r"--sections=\(\): name at least one of machine, quick_start"),
    ("--sections=machine,bogus", "--sections: 'bogus' unknown; choose among machine"),
    ("--sections=machine,machine", "--sections=machine,machine: name each section once"),
    ("--out={file}/docs", r"--out=.*/docs: cannot write the report \(bench_gpu.md and "
                          r"bench_gpu.json\) there \(.*\); choose a folder you can write to"),
    ("--work_dir={file}/work", "--work_dir=.*/work: cannot write the checkpoints")])
def test_settings_that_cannot_work_are_refused_before_any_section_runs(tmp_path, monkeypatch,
                                                                       flag, message):
    ran = stub_sections(monkeypatch)
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    flags = ["--device=cpu", f"--out={tmp_path / 'docs'}", f"--work_dir={tmp_path / 'work'}",
             flag.format(file=file)]
    with pytest.raises(ValueError, match=message):
        gpu_report.main(flags)
    assert ran == []


def test_compiled_decoders_with_a_cache_run_at_batch_1_and_the_report_says_why():
    """A compiled model takes one cached prompt at a time (support.compiled), so ReFusion and
    next-token decoding are compiled at batch 1 only, the MDM at every batch size, and the
    decoding section's notes say so; no row is an error for it."""
    cfg = dict(gpu_report.DEFAULTS, compile=True, batch_sizes=(1, 64))
    runs = gpu_report.decoding_runs(cfg)
    assert [r for r in runs if r[0] == "eager"] == [
        ("eager", d, B) for d in ("ReFusion", "next-token", "MDM") for B in (1, 64)]
    assert [r for r in runs if r[0] == "compiled"] == [
        ("compiled", "ReFusion", 1), ("compiled", "next-token", 1), ("compiled", "MDM", 1),
        ("compiled", "MDM", 64)]
    assert all(mode == "eager" for mode, _, _ in
               gpu_report.decoding_runs(dict(cfg, compile=False)))
    figures = {"right": 1, "lines": 2, "tokens": 8, "nfe": 4, "tpf": 2.0, "tokens_per_s": 80.0,
               "passes": 4, "ms_per_pass": 1.0, "model_ms_per_pass": 0.5,
               "decoder_ms_per_pass": 0.5, "identical": 1.0}
    section = {"lines": 2, "dtype": "bfloat16", "max_new_tokens": 8, "mdm_max_new_tokens": 8,
               "refusion_settings": {"slot_size": 4}, "split": gpu_report.SPLIT_NOTE,
               "runs": [dict(figures, decoder=d, batch_size=B, mode=m) for m, d, B in runs]}
    md = gpu_report.decoding_md(section)
    assert gpu_report.COMPILED_NOTE in md and "failed" not in md
