"""python -m tools.gpu_report, the acceptance check on one GPU, in its quick mode on the CPU: every
section's figures in both files, a failing section recorded while the others run, and the budget
that skips what it has no time for."""

import json
import time

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
