"""Cost against the answer's length (tools/bench_length.py): the sweep's plumbing on two short
lengths with tiny models (not its figures), the fitted growth and the transform-long task."""

import json

import pytest

from support.corpora import DATASETS, score, transform_expected
from tools import bench_length


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


def test_a_length_the_task_does_not_have_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--lengths: 100 is not an answer length of "
                                         "transform-long; choose from 32, 64, 128, 256, 512"):
        bench_length.main(["--lengths=(32,100)", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()
