"""Cost against the answer's length (tools/bench_length.py): the sweep's plumbing on two short
lengths with tiny models (not its figures), the fitted growth and its tasks, quotes-long and
transform-long."""

import json
from pathlib import Path

import pytest

from support.corpora import (BLOCK_END, DATASETS, double_quoted, quote_block_expected,
                             quote_block_records, score, transform_expected)
from tools import bench_length

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_decodes_every_length_with_every_decoder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bench_length.main(["--quick", f"--out_dir={tmp_path / 'out'}"])
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = report["rows"]
    labels = [label for label, *_ in bench_length.decoders(32)]
    assert [(r["length"], r["label"]) for r in rows] == [(L, label) for L in (32, 64)
                                                          for label in labels]
    for r in rows:
        L = r["length"]
        assert r["prompts"] == 2 and r["answer_tokens"] == 2 * L
        assert r["nfe"] == r["forward_calls"] and 0 < r["tokens"] <= 2 * L
        assert r["ms_per_token"] == pytest.approx(1e3 * r["seconds"] / r["tokens"])
        assert set(r["quality"]) == {"exact", "letters"}
        if r["method"] == "next_token":
            assert r["tpf"] == 1 and r["speedup_vs_ar"] == 1
        if r["method"] == "mdm":   # a fixed schedule: L / k steps a prompt, shifted as trained
            assert r["nfe"] == 2 * r["settings"]["steps"] and r["settings"]["mdm_shift"] is True
    assert set(report["growth"]) == set(labels)
    assert all(isinstance(b, float) for b in report["growth"].values())
    assert set(report["leads"]) == {"32", "64"}
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "ms/token ~ length^b" in table and "paper's 18x" in table
    if (tmp_path / "out" / "bench.png").exists():     # matplotlib installed
        assert (tmp_path / "out" / "bench_length.png").stat().st_size > 0
    capsys.readouterr()
    bench_length.main(["--quick", f"--out_dir={tmp_path / 'out'}"])   # the models are reused
    assert capsys.readouterr().out.count("== reusing") == 3


def test_the_growth_is_the_exponent_of_a_power_law():
    """ms per token = 3 L (the MDM's linear growth) gives b = 1; constant gives b = 0."""
    rows = [{"label": name, "length": L, "ms_per_token": ms(L)}
            for name, ms in (("linear", lambda L: 3.0 * L), ("flat", lambda L: 2.0))
            for L in (32, 64, 128, 256, 512)]
    fits = bench_length.growth(rows)
    assert fits["linear"] == pytest.approx(1.0) and fits["flat"] == pytest.approx(0.0, abs=1e-9)


def test_transform_long_answers_have_the_sweeps_lengths_and_are_scored_by_letter():
    records = DATASETS["transform-long"]()[:200]
    # letters, newline and EOS: 32 to 512 tokens of one byte each
    assert {len(r["response"]) + 1 for r in records} == {32, 64, 128, 256, 512}
    query = "upper: abcd\n"
    assert transform_expected(query) == "ABCD"
    assert score("transform-long", query, "ABCD\n") == {"exact": 1.0, "letters": 1.0}
    assert score("transform-long", query, "ABxD\n") == {"exact": 0.0, "letters": 0.75}
    assert score("transform-long", query, "AB") == {"exact": 0.0, "letters": 0.5}


def test_quotes_long_answers_are_runs_of_lines_rewritten_at_the_sweeps_lengths():
    records = quote_block_records(n=50, lengths=(32, 64, 512))
    # the lengths in turn: the answer (text, newline) and EOS is L byte tokens
    assert [len(r["response"]) + 1 for r in records] == [32, 64, 512] * 16 + [32, 64]
    for r in records:
        assert r["query"].endswith("\n" + BLOCK_END) and r["response"].isascii()
        lines = r["query"][:-len(BLOCK_END) - 1].split("\n")
        # a run of lines, each of the same length as its rewrite, at least one rewritten
        assert [len(x) for x in lines] == [len(x) for x in r["response"].split("\n")[:-1]]
        assert [double_quoted(x) for x in lines] != lines
        assert r["response"] == quote_block_expected(r["query"]) + "\n"
    assert len({r["query"] for r in records}) == 50


def test_quotes_long_is_scored_line_by_line_and_by_character():
    query = "f('a')\nprint('hi', x)\nz = y\n" + BLOCK_END
    assert quote_block_expected(query) == 'f("a")\nprint("hi", x)\nz = y'
    right = 'f("a")\nprint("hi", x)\nz = y\n'
    assert score("quotes-long", query, right) == {"exact": 1.0, "letters": 1.0}
    # 3 of the 27 characters before the final newline wrong or missing
    assert score("quotes-long", query, 'f("a")\nprint(\'hi\', x)\nz = ') == \
        {"exact": 0.0, "letters": pytest.approx(24 / 27)}
    with pytest.raises(ValueError, match="not a quotes-long query"):
        quote_block_expected("f('a')\n")


@pytest.mark.parametrize("flags, message", [
    (["--lengths=(32,100)"], "--lengths: 100 is not an answer length of quotes-long; choose from "
                             "32, 64, 128, 256, 512"),
    (["--dataset=transform-long", "--lengths=(32,100)"], "--lengths: 100 is not an answer length "
     "of transform-long; choose from 32, 64, 128, 256, 512"),
    (["--dataset=quotes"], "--dataset='quotes': the sweep's tasks are quotes-long, "
                           "transform-long"),
    (["--lengths=()"], r"--lengths=\(\): name at least one answer length to sweep, from 32, 64")])
def test_a_length_or_task_the_sweep_does_not_have_is_refused_before_any_work(tmp_path, flags,
                                                                            message):
    with pytest.raises(ValueError, match=message):
        bench_length.main([*flags, f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_the_18x_claim_names_the_lengths_where_it_holds_not_the_first_alone():
    lead = {L: {"ratio": r, "as_good": ok} for L, r, ok in
            ((32, 0.5, True), (64, 19.0, False), (128, 29.4, True), (256, 4.7, True),
             (512, 20.0, True))}
    assert bench_length.holds_from(lead, "ratio", "as_good") == "at lengths 128, 512 only"
    lead[256]["ratio"] = 18.5
    assert bench_length.holds_from(lead, "ratio", "as_good") == "from length 128 on"
    lead = {32: {"ratio": 17.9, "as_good": True}}
    assert bench_length.holds_from(lead, "ratio", "as_good") == "at no length measured"


def test_the_docs_length_sweep_is_the_recorded_runs_figures():
    """docs/bench_length.md is the recorded rows' table; docs/benchmark.md states the rows' fitted
    growth and ReFusion's leads as computed from them."""
    report = json.loads((ROOT / "docs" / "bench_length.json").read_text())
    rows = report["rows"]
    fits, lead = bench_length.growth(rows), bench_length.leads(rows)
    assert [r["length"] for r in rows][::len(bench_length.decoders(32))] == [32, 64, 128, 256, 512]
    assert (ROOT / "docs" / "bench_length.md").read_text().startswith(
        bench_length.length_table(rows, fits, lead))
    text = " ".join((ROOT / "docs" / "benchmark.md").read_text().split())
    mdm = [b for label, b in fits.items() if label.startswith("MDM")]
    refusion = sorted(b for label, b in fits.items() if label.startswith("ReFusion"))
    assert f"b is {min(mdm):.2f} to {max(mdm):.2f}" in text
    assert f"the ARM's is {fits['ARM next token']:.2f}" in text
    assert f"ReFusion's is {refusion[0]:.2f} and {refusion[1]:.2f}" in text
    table = {int(line.split(" | ")[0][2:]): [c.strip(" |*") for c in line.split(" | ")[1:]]
             for line in (ROOT / "docs" / "benchmark.md").read_text().splitlines()
             if line.startswith(tuple(f"| {L} | " for L in lead))}
    assert list(table) == list(lead)
    for L, v in lead.items():   # ms per token of the ARM and the MDM at one token a step; leads
        at = {r["label"]: r for r in rows if r["length"] == L}
        one = next(r for r in at.values() if r["method"] == "mdm" and r["settings"]["steps"] == L)
        assert table[L][:2] == [f"{at['ARM next token']['ms_per_token']:.2f}",
                                f"{one['ms_per_token']:.2f}"]
        assert table[L][-2:] == [f"{v['ratio']:.1f}x", f"{v['ratio_one_per_step']:.1f}x"]
