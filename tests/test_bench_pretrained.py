"""The benchmark on a pretrained model (tools/bench_pretrained.py), on a tiny random Llama folder:
the same path as SmolLM2's (the fine-tunes from the folder under bf16 autocast, every point decoded
in bf16 and float32, interleaved), not its figures."""

import json

import pytest

import train
from helpers import ROOT, save_tiny_hf_folder
from support.report import best_mdm, first_quality, headline
from tools import bench_pretrained


def test_quick_run_fine_tunes_the_three_models_and_decodes_every_point(tmp_path, monkeypatch,
                                                                       capsys):
    """Next token, ReFusion and (quotes has its config file) the MDM the Dream way: bidirectional,
    from the folder's causal weights, shifted prediction; each decoded, the MDM shifted."""
    pytest.importorskip("transformers")
    save_tiny_hf_folder(tmp_path / "llama", family="llama", mask=False)
    monkeypatch.chdir(tmp_path)
    # bfloat16 asked for: the float32 point is then a point of its own, on any machine
    flags = ["--quick", "--init_from=llama", "--tasks=quotes", f"--data_root={tmp_path / 'data'}",
             "--dtype=bfloat16"]
    bench_pretrained.main(flags)
    report = json.loads((tmp_path / "bench-pretrained-quick" / "bench.json").read_text())
    rows = report["rows"]
    labels = [r["label"] for r in rows]
    assert labels[:4] == ["SmolLM2-ft next token", "SmolLM2-ft next token, float32",
                          "Hugging Face generate (SmolLM2-ft weights)",
                          "ReFusion-SmolLM2 next token"]
    assert {r["settings"].get("infill") for r in rows[4:6]} == {"paper", "speculative"}
    # verify="exact" (SPEC 4.5): the ReFusion fine-tune's next-token decoding, fewer passes
    assert labels[6] == "ReFusion-SmolLM2 S=8 verify=exact"
    assert (rows[6]["tokens"], rows[6]["quality"]) == (rows[3]["tokens"], rows[3]["quality"])
    assert rows[6]["nfe"] <= rows[3]["nfe"]
    # LLaDA's confidence, then Dream's rules on the same schedule
    assert labels[7:] == ["MDM-SmolLM2 4 token(s)/step, block 48",
                          "MDM-SmolLM2 4 token(s)/step, block 48, margin (Dream)",
                          "MDM-SmolLM2 4 token(s)/step, block 48, entropy (Dream)"]
    assert [r["settings"]["confidence"] for r in rows[7:]] == ["prob", "margin", "entropy"]
    for mdm in rows[7:]:
        assert mdm["method"] == "mdm" and mdm["settings"]["mdm_shift"] is True
        assert mdm["train_options"]["mdm_shift"] is True
        assert mdm["train_options"]["gen_length"] == 48
        assert mdm["nfe"] == 2 * 12                                   # 48 tokens, 4 a step
    mdm = best_mdm(rows)
    for r in rows:
        assert r["nfe"] == r["forward_calls"] > 0 and r["tokens"] > 0 and r["peak_mb"] >= 0
        assert r["train_options"]["dtype"] == "auto" and r["train_iters"] == 2
        assert r["speedup_vs_mdm"] == pytest.approx(r["tokens_per_s"] / mdm["tokens_per_s"])
    assert rows[0]["same_tokens_as_first"] == 2                     # the first point against itself
    assert [r["settings"]["dtype"] for r in rows] == ["bfloat16", "float32"] + ["bfloat16"] * 8
    table = (tmp_path / "bench-pretrained-quick" / "bench.md").read_text()
    assert "smollm2 quotes" in table
    # the throughput table: the next-token fine-tune, ReFusion's headline point and the MDM,
    # batches of 1, 2
    batched = report["batched"]["quotes"]["rows"]
    assert [(r["decoder"], r["batch_size"]) for r in batched] == [
        (label, B) for label in ("SmolLM2-ft next token", batched[2]["decoder"], mdm["label"])
        for B in (1, 2)]
    assert batched[2]["decoder"] in labels[4:] and "Batched decoding (smollm2 quotes, bfloat16, " \
        "2 prompts" in table
    capsys.readouterr()
    bench_pretrained.main(flags)                                     # the fine-tunes are reused
    assert capsys.readouterr().out.count("== reusing") == 3


def test_the_readmes_smollm2_table_is_the_recorded_runs_headline():
    """README's SmolLM2 rows, under the small models', are the recorded runs' headlines: quotes from
    docs/bench_smollm2_mdm.json (the three fine-tunes), then the tasks only docs/bench_smollm2.json
    has (arith). Per task the next-token fine-tune, the MDM where there is one, then per infill
    mode ReFusion's fastest point within 1 point of it (or its most accurate); every speed-up is
    against that task's first row, or the best MDM's."""
    runs = {name: json.loads((ROOT / "docs" / f"{name}.json").read_text())["rows"]
            for name in ("bench_smollm2_mdm", "bench_smollm2")}
    three_way = {r["task"] for r in runs["bench_smollm2_mdm"]}
    shown = runs["bench_smollm2_mdm"] + [r for r in runs["bench_smollm2"]
                                         if r["task"] not in three_way]
    small = headline(json.loads((ROOT / "docs" / "bench.json").read_text())["rows"])
    rows_lines = "\n".join(headline(shown).splitlines()[2:])     # under the small models' rows
    assert small + "\n" + rows_lines in (ROOT / "README.md").read_text(encoding="utf-8")
    assert best_mdm([r for r in runs["bench_smollm2_mdm"] if r["task"] == "smollm2 quotes"])
    for name, rows in runs.items():
        for task in dict.fromkeys(r["task"] for r in rows):
            task_rows = [r for r in rows if r["task"] == task]
            assert task_rows[0]["label"] == "SmolLM2-ft next token"
            assert task_rows[0]["speedup_vs_ar"] == 1.0 and first_quality(task_rows[0]) > 0
            mdm = best_mdm(task_rows)
            for r in task_rows:
                assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] /
                                                           task_rows[0]["tokens_per_s"])
                if mdm is not None:
                    assert r["speedup_vs_mdm"] == pytest.approx(r["tokens_per_s"] /
                                                                mdm["tokens_per_s"])
        assert (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8").startswith(
            headline(rows))


def test_a_checkpoint_older_than_a_training_setting_is_recorded_with_its_default():
    """A fine-tune saved before --mdm_shift existed has no such key: its row says False (train.py's
    default then), and every setting the checkpoint has is its own."""
    old = {k: v for k, v in train.DEFAULTS.items() if k != "mdm_shift"} | {"ar_fraction": 0.25}
    options = bench_pretrained.train_options(old)
    assert options["mdm_shift"] is False and options["ar_fraction"] == 0.25
    assert options == {k: dict(old, mdm_shift=False)[k] for k in bench_pretrained.TRAIN_OPTIONS}


def test_an_empty_list_of_tasks_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--tasks=\(\): name at least one task"):
        bench_pretrained.main(["--tasks=()", "--throughput_task=", f"--out_dir={tmp_path / 'b'}"])
    assert not (tmp_path / "b").exists()
