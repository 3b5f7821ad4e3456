"""tools.bench_exact: verify="exact" (SPEC 4.5) beside next-token decoding and the paper's decoder
on a checkpoint's validation prompts."""

import json
import re

import pytest

import train
from configurator import ConfigError, run_cli
from helpers import tiny_run_flags
from tools import bench_exact


def test_exact_rows_give_next_token_decodings_texts_in_no_more_passes(tmp_path, qa_file, capsys):
    """Every verify="exact" row's texts are next-token decoding's, in no more passes; the table has
    a row per point and the JSON the same figures."""
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=30"])
    capsys.readouterr()
    out_json = tmp_path / "exact.json"
    bench_exact.main([f"--out_dir={tmp_path / 'run'}", "--num_prompts=4", "--first=1",
                      "--slot_sizes=1,4", "--max_new_tokens=16", "--slot_size=4",
                      f"--out_json={out_json}"])
    printed = capsys.readouterr().out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["label"] for r in rows][2:] == ["exact S=1", "exact S=4"]
    assert rows[0]["label"] == "next token" and rows[1]["label"].startswith("paper S=")
    n = len(rows[0]["outs"])
    assert n == 4 and json.loads(out_json.read_text())["first"] == 1
    for row in rows[2:]:
        assert row["outs"] == rows[0]["outs"] and row["identical"] == n
        assert row["nfe"] <= rows[0]["nfe"]
        assert re.search(rf"\| {row['label']} \| {n} of {n} \| - \| {row['tokens']} \| "
                         rf"{row['nfe']} \|", printed)
    assert rows[0]["nfe"] == rows[0]["tokens"]     # next-token decoding: a pass a token


def test_bad_settings_are_refused_before_the_model_is_read(tmp_path):
    for flag, message in [("--num_prompts=0", "--num_prompts=0: must be at least 1"),
                          ("--first=-1", "--first=-1: must be a prompt index >= 0"),
                          ("--slot_sizes=4,0", r"--slot_sizes=\(4, 0\): must be slot sizes >= 1")]:
        with pytest.raises((ConfigError, SystemExit), match=message):
            run_cli(bench_exact.main, [f"--out_dir={tmp_path / 'none'}", flag])
