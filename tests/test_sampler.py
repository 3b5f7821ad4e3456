"""The sampling command line (sampler.py)."""

import json

import pytest
import torch

import sampler
import train
from helpers import tiny_model, tiny_run_flags
from sampler import DEFAULTS, make_decoder


def test_cli_builds_each_decoder_and_refuses_an_unknown_method():
    meta = {"eos_id": 39, "mask_id": 38, "pad_id": 37}
    for method, causal, gen_len in [("refusion", True, 16), ("ar", True, 10), ("mdm", False, 10)]:
        cfg = dict(DEFAULTS, method=method, max_new_tokens=10, num_blocks=1)  # refusion: 10 -> 2 slots of 8
        run, settings = make_decoder(cfg, tiny_model(causal=causal), meta, torch.Generator())
        out = run([1, 2, 3])
        assert settings.gen_len == gen_len and 0 < len(out.tokens) <= 10 and out.nfe > 0
    with pytest.raises(ValueError, match="--method='beam': choose one of refusion, ar, mdm"):
        make_decoder(dict(DEFAULTS, method="beam"), tiny_model(), meta, torch.Generator())


def test_sampler_cli_prints_one_json_object_per_sample(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    capsys.readouterr()
    out_dir = f"--out_dir={tmp_path / 'run'}"
    sampler.main([out_dir, "--json", "--num_samples=2", "--max_new_tokens=8", "--slot_size=4", "--num_blocks=1"])
    sampler.main([out_dir, "--json", "--prompt=What is 7 + 7?", "--max_new_tokens=6", "--slot_size=4",
                  "--num_blocks=2", "--method=refusion"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and lines[2]["prompt"] == "What is 7 + 7?"
    for row, limit in zip(lines, (8, 8, 6)):
        assert {"text", "tokens", "nfe", "tpf", "seconds", "tokens_per_s"} <= set(row)
        assert 0 < row["tokens"] <= limit and row["tpf"] == round(row["tokens"] / row["nfe"], 3)
    for bad, message in [(["--num_samples=0"], "--num_samples=0"), (["--prompt_file=nope.txt"], "no such file"),
                         (["--method=mdm"], "trained with a causal objective")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            sampler.main([out_dir] + bad)


def test_sampler_prepares_damaged_validation_data_anew(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    val_bin = next((tmp_path / "data").glob("*/val.bin"))
    whole = val_bin.read_bytes()
    val_bin.write_bytes(whole[:-4])                                   # cut short
    sampler.main([f"--out_dir={tmp_path / 'run'}", "--num_samples=1", "--max_new_tokens=8", "--num_blocks=1", "--json"])
    assert val_bin.read_bytes() == whole
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] >= 1
