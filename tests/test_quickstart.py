"""The README's quick start (config/train_quotes.py, then config/sample_quotes.py), at a tiny size:
the same configs and code path, its summary beside next-token decoding, not the timing or the
figures."""

import re

import sampler
import train
from helpers import ROOT
from support.checkpoint import load_checkpoint


def test_quick_start_trains_and_prints_a_verdict_per_sample_and_a_summary(tmp_path, capsys):
    out, data = f"--out_dir={tmp_path / 'out'}", f"--data_root={tmp_path / 'data'}"
    tiny = ["--max_iters=2", "--n_layer=1", "--n_head=2", "--n_embd=16", "--batch_size=4",
            "--eval_interval=1", "--eval_iters=1"]
    train.main([str(ROOT / "config" / "train_quotes.py"), out, data] + tiny)
    capsys.readouterr()
    sampler.main([str(ROOT / "config" / "sample_quotes.py"), out, "--num_samples=3"])
    printed = capsys.readouterr().out.strip().split("\n")
    verdicts = [line for line in printed
                if re.match(r"(right|wrong) \(exact\): \d+ tokens in \d+ forward", line)]
    assert len(verdicts) == 3
    right = sum(line.startswith("right") for line in verdicts)
    assert re.match(rf"3 samples: {right} of 3 right \(exact\); \d+ tokens in \d+ forward passes, "
                    r".*; next-token decoding \(--method=next_token\) of the same prompts: "
                    r"\d of 3 right "
                    r"\(exact\); (\d+) tokens in \1 forward passes, [\d.]+ tokens/s; "
                    r"speed-up [\d.]+x; the same tokens on \d of 3$",
                    printed[-1])
    cfg = load_checkpoint(str(tmp_path / "out"))["config"]
    assert (cfg["dataset"], cfg["slot_end_labels"], cfg["ar_fraction"]) == ("quotes", True, 0.25)
