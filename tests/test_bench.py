"""The side-by-side benchmark (bench.py)."""

import json

import pytest
import torch

import bench
from checkpoint import load_checkpoint, save_checkpoint
from configurator import parse_args
from generate import DecodeSettings, generate_ar
from helpers import tiny_model



def test_bench_at_toy_size_reuses_only_models_trained_with_the_same_settings(tmp_path, monkeypatch, capsys):
    """bench.py end to end: every row's TPF is its tokens / NFE and its speed-ups are over the ARM
    row and the first MDM row. A second run reuses the trained models; one interrupted part-way is
    resumed; a changed setting retrains the models, and with the ARM the fine-tune started from it."""
    monkeypatch.chdir(tmp_path)                                       # data/ and bench/ land here
    flags = ["--datasets=arith", "--max_iters=2", "--finetune_iters=2", "--num_prompts=2", "--batch_size=4",
             "--n_layer=1", "--n_head=2", "--n_embd=32", "--max_new_tokens=32", "--num_blocks=2"]
    with pytest.raises(ValueError, match="no arith validation prompt leaves room for 176 new tokens"):
        bench.main(flags + ["--max_new_tokens=176"])                  # refused before any training
    assert not (tmp_path / "bench" / "arith-ar").exists()
    bench.main(flags)
    printed = capsys.readouterr()                                     # not a terminal: plain lines, no bar frames
    assert "\r" not in printed.err and "iter 0: loss " in printed.out and "decode arith: ARM: " in printed.out
    rows = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    ar_row, mdm_row = rows[0], next(r for r in rows if r["method"] == "mdm")
    assert ar_row["label"] == "ARM" and ar_row["nfe"] == ar_row["tokens"]     # one token per forward
    for r in rows:
        assert r["tpf"] == r["tokens"] / r["nfe"]
        assert r["speedup_vs_ar"] == r["tokens_per_s"] / ar_row["tokens_per_s"]
        assert r["speedup_vs_mdm"] == r["tokens_per_s"] / mdm_row["tokens_per_s"]
        assert 0.0 <= r["quality"]["accuracy"] <= 1.0
    names = ["arith-ar", "arith-mdm", "arith-refusion", "arith-refusion-ft"]
    ckpts = [tmp_path / "bench" / n / "ckpt.pt" for n in names]
    stamps = lambda: [p.stat().st_mtime_ns for p in ckpts]           # noqa: E731
    first = stamps()
    interrupted = load_checkpoint(str(ckpts[1]))
    interrupted["iter_num"] = 1                                       # as if stopped after one step
    save_checkpoint(str(ckpts[1].parent), interrupted)
    capsys.readouterr()
    bench.main(flags)
    out = capsys.readouterr().out
    assert out.count("== reusing") == 3 and "== resuming bench/arith-mdm at iteration 1 of 2" in out
    assert load_checkpoint(str(ckpts[1]))["iter_num"] == 2
    assert [a == b for a, b in zip(stamps(), first)] == [True, False, True, True]
    second = stamps()
    bench.main([f for f in flags if f != "--max_iters=2"] + ["--max_iters=3"])
    assert all(a != b for a, b in zip(stamps(), second))             # all four retrained, the fine-tune too


@pytest.mark.parametrize("flag", ["--learning_rate=nan", "--learning_rate=inf", "--batch_size=0", "--block_size=-1"])
def test_bench_settings_are_checked_before_any_work(flag):
    with pytest.raises(ValueError, match=f"{flag.split('=')[0]}=.*: must be"):
        bench.check_bench_config(parse_args(bench.DEFAULTS, [flag]))


def test_each_prompt_is_sampled_from_its_own_seeded_generator():
    """bench decodes prompt i with a generator seeded with i, whatever the warm-up drew: the same
    tokens as the decoder given torch.Generator().manual_seed(i) for that prompt alone."""
    model, meta = tiny_model(), {"eos_id": 39, "mask_id": 38, "pad_id": 37}
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    texts, _ = bench.run_decoder("ar", model, prompts, meta, 12, {"temperature": 1.0})
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        out = generate_ar(model, prompt, DecodeSettings(12, temperature=1.0), eos_id=39,
                          generator=torch.Generator().manual_seed(i), banned_ids=(38, 37))
        assert text == [t for t in out.tokens if t != 39]
