"""The side-by-side benchmark (tools/bench.py)."""

import importlib.util
import json
import math
import time

import pytest
import torch

from configurator import parse_args
from helpers import ROOT, tiny_model
from sampler import DecodeSettings, generate_next_token, make_decoder
from support.benchmark import Point, Timed, point_config
from support.checkpoint import load_checkpoint, save_checkpoint
from support.corpora import score, transform_records
from support.report import decoding_mode, markdown_table
from tools import bench

ROW_FIELDS = {"task", "dataset", "label", "method", "model", "settings", "train_iters", "val_loss",
              "quality", "tokens", "nfe", "tpf", "seconds", "tokens_per_s", "forward_calls",
              "ms_per_forward", "bookkeeping_share", "speedup_vs_ar", "speedup_vs_mdm"}
QUICK = ["--quick", "--max_iters=3", "--finetune_iters=2", "--num_prompts=2"]


def test_quick_run_writes_every_field_of_the_three_files(tmp_path, monkeypatch, capsys):
    """python -m tools.bench --quick, shortened: bench.json holds every point with every field,
    bench.md the table, bench.png the plot. The figures themselves are not checked, only that they
    are consistent."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)                                 # data/ and bench-quick/ land here
    bench.main(QUICK)
    assert not (tmp_path / "bench").exists()                    # a smoke run leaves a full run be
    # not a terminal: plain lines, no bar frames
    printed = capsys.readouterr()
    assert ("\r" not in printed.err and "iter 0: loss " in printed.out and
            "decode transform: ARM: " in printed.out)
    report = json.loads((tmp_path / "bench-quick" / "bench.json").read_text())
    rows = report["rows"]
    assert ({"python", "torch", "transformers", "cpu_threads", "processor", "cpu_capability"} <=
            set(report["machine"]) and report["minutes"] > 0)
    # the quick run trains its 5 models
    minutes = report["task_minutes"]["transform"]
    assert (minutes["train"] > 0 and minutes["decode"] > 0 and
            minutes["train"] + minutes["decode"] <= report["minutes"])
    refusion = [r for r in rows if r["method"] == "refusion"]
    # QUICK's sweep, both models, both infill modes
    # and verify="exact" at the sweep's slot size (SPEC 4.5): at most a pass a token
    assert len(refusion) == 2 * (2 * 2 + 1)
    assert {decoding_mode(r["settings"]) for r in refusion} == {"paper", "speculative", "exact"}
    assert all(r["nfe"] <= r["tokens"] for r in refusion if r["settings"].get("verify") == "exact")
    mdm_rows = [r for r in rows if r["method"] == "mdm"]
    # 1, 2 and 4 tokens per step each; the MDM-ft at 2 and 4 also by Dream's two rules
    assert [r["model"] for r in mdm_rows] == ["mdm"] * 3 + ["mdm-ft"] * 7
    assert [r["settings"]["confidence"] for r in mdm_rows] == ["prob"] * 4 + [
        "prob", "margin", "entropy"] * 2
    for prob, *dream in (mdm_rows[4:7], mdm_rows[7:]):      # same schedule, same NFE
        assert all(r["settings"]["steps"] == prob["settings"]["steps"] and
                   r["nfe"] == prob["nfe"] for r in dream)
    # "vs MDM" compares with the MDM point of the best quality, the fastest of those
    mdm_row = max(mdm_rows, key=lambda r: (r["quality"]["exact"], r["tokens_per_s"]))
    ar_row = rows[0]
    # one token per forward
    assert ar_row["label"] == "ARM" and ar_row["nfe"] == ar_row["tokens"]
    for r in rows:
        assert (ROW_FIELDS <= set(r) and set(r["quality"]) == {"exact"} and
                0 <= r["quality"]["exact"] <= 1)
        assert all(math.isfinite(r[k])
                   for k in ("tpf", "tokens_per_s", "ms_per_forward", "bookkeeping_share"))
        assert r["tpf"] == r["tokens"] / r["nfe"] and 0 <= r["bookkeeping_share"] < 1
        # the model's own count equals the decoder's NFE
        assert r["forward_calls"] == r["nfe"]
        assert r["speedup_vs_ar"] == r["tokens_per_s"] / ar_row["tokens_per_s"]
        assert r["speedup_vs_mdm"] == r["tokens_per_s"] / mdm_row["tokens_per_s"]
    # the throughput table: ARM, ReFusion's headline point, the MDM; batches of 1 and 2 prompts
    batched = report["batched"]["transform"]["rows"]
    assert [(r["decoder"], r["batch_size"]) for r in batched] == [
        (label, B) for label in ("ARM", batched[2]["decoder"], bench.best_mdm(rows)["label"])
        for B in (1, 2)]
    for r in batched:
        first = next(b for b in batched if b["decoder"] == r["decoder"])
        ar = next(b for b in batched
                  if b["decoder"] == "ARM" and b["batch_size"] == r["batch_size"])
        assert r["vs_batch_1"] == r["tokens_per_s"] / first["tokens_per_s"]
        assert r["vs_first"] == r["tokens_per_s"] / ar["tokens_per_s"]
        assert r["tokens_per_s"] == r["tokens"] / r["seconds"] and 0 <= r["identical"] <= 1
        assert r["identical"] == 1 or r["batch_size"] > 1
    # what a pass of the ARM costs here, as tools.probe measures it
    costs = {int(k): ms for k, ms in report["forward_ms"]["transform"].items()}
    assert list(costs)[0] == 1 and all(ms > 0 for ms in costs.values())
    steps = report["training_step_seconds"]["transform"]
    assert steps["ratio"] == steps["refusion"] / steps["ar"]
    table = (tmp_path / "bench-quick" / "bench.md").read_text()
    assert (table.startswith(bench.QUICK_NOTE + "\n\n" + bench.headline(rows) +
                             "\n\n| task | decoder | why |") and
            "Training step (transform" in table and
            f"One cached forward pass of the transform ARM, k tokens after 32, "
            f"{report['config']['dtype']} (ms): 1: " in table and
            "Batched decoding (transform, 2 prompts; tokens/s over all of them)" in table)
    check_headline(rows)
    assert "fastest" in table and (tmp_path / "bench-quick" / "bench.png").stat().st_size > 10_000
    # with transformers installed, Hugging Face's generate on the ARM's weights is a row of its own,
    # and greedy decoding of the same weights gives what our cached ARM decoder gives
    hf_rows = [r for r in rows if r["method"] == "hf"]
    assert len(hf_rows) == (importlib.util.find_spec("transformers") is not None)
    for hf_row in hf_rows:
        assert (hf_row["tokens"], hf_row["quality"]) == (ar_row["tokens"], ar_row["quality"])


def check_headline(rows):
    """The README's table lists, per task, the ARM, the MDM compared with, and per decoding mode
    (each infill mode, and verify="exact" where the rows hold it) one ReFusion point: no point of
    that mode within 1 point of the ARM is faster, and when none is within 1 point, none is more
    accurate."""
    by_label = {(r["task"], r["label"]): r for r in rows}
    lines = bench.headline(rows).splitlines()[2:]
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        labels = [line.split(" | ")[1] for line in lines if line.startswith(f"| {task} |")]
        modes = list(dict.fromkeys(decoding_mode(r["settings"]) for r in task_rows
                                   if r["method"] == "refusion"))
        assert modes[:2] == ["paper", "speculative"] and set(modes) <= {*modes[:2], "exact"}
        assert labels[:2] == ["ARM", bench.best_mdm(task_rows)["label"]]
        assert len(labels) == 2 + len(modes)
        ar_quality = bench.first_quality(task_rows[0])
        for label, mode in zip(labels[2:], modes):
            pick = by_label[task, label]
            points = [r for r in task_rows
                      if r["method"] == "refusion" and decoding_mode(r["settings"]) == mode]
            assert pick in points
            close = [r for r in points if bench.first_quality(r) >= ar_quality - 0.01]
            if close:
                assert pick in close and all(r["tokens_per_s"] <= pick["tokens_per_s"]
                                             for r in close)
            else:
                assert all(bench.first_quality(r) <= bench.first_quality(pick) for r in points)


def test_the_readmes_benchmark_table_is_the_recorded_runs_headline():
    rows = json.loads((ROOT / "docs" / "bench.json").read_text())["rows"]
    check_headline(rows)
    assert bench.headline(rows) in (ROOT / "README.md").read_text(encoding="utf-8")


def test_transform_answers_are_checked_independently():
    """The transform task's checker against hand-computed answers, and every generated record."""
    assert score("transform", "copy: abcabcabcabcabcz\n",
                 "abcabcabcabcabcz\n", "") == {"exact": 1.0}
    assert score("transform", "upper: " + "ab" * 16 + "\n", "AB" * 16 + "\n", "") == {"exact": 1.0}
    assert score("transform", "shift: " + "az" * 24 + "\n", "ba" * 24 + "\n", "") == {"exact": 1.0}
    assert score("transform", "mirror: " + "abz" * 21 + "\n",
                 "zya" * 21 + "\n", "") == {"exact": 1.0}
    assert score("transform", "copy: abcabcabcabcabcz\n", "abcabcabcabcabcz", "") == {"exact": 0.0}
    for r in transform_records(200):
        assert score("transform", r["query"], r["response"], "") == {"exact": 1.0}
        assert 17 <= len(r["response"]) <= 64


def test_bench_reuses_only_models_trained_with_the_same_settings(tmp_path, monkeypatch, capsys):
    """A second run reuses the trained models; one interrupted part-way is resumed; a changed
    setting retrains the models, and with the ARM the fine-tune started from it. A recipe whose
    prompts cannot fit is refused before any training."""
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as patch, \
         pytest.raises(ValueError, match="no transform validation prompt leaves room for "
                                         "192 new tokens"):
        # 190 new tokens, rounded up to whole 8-token slots: 192, more than the shortest
        # prompt leaves
        patch.setitem(bench.TASKS, "transform", dict(bench.TASKS["transform"], max_new_tokens=190))
        bench.main(QUICK)
    assert not (tmp_path / "bench-quick" / "transform-ar").exists()
    bench.main(QUICK)
    names = ["transform-ar", "transform-mdm", "transform-refusion", "transform-refusion-ft",
             "transform-mdm-ft"]
    ckpts = [tmp_path / "bench-quick" / n / "ckpt.pt" for n in names]
    stamps = lambda: [p.stat().st_mtime_ns for p in ckpts]           # noqa: E731
    first = stamps()
    interrupted = load_checkpoint(str(ckpts[1]))
    interrupted["iter_num"] = 1                                       # as if stopped after one step
    save_checkpoint(str(ckpts[1].parent), interrupted)
    capsys.readouterr()
    bench.main(QUICK)
    out = capsys.readouterr().out
    assert (out.count("== reusing") == 4 and
            "== resuming bench-quick/transform-mdm at iteration 1 of 3" in out)
    assert load_checkpoint(str(ckpts[1]))["iter_num"] == 3
    assert [a == b for a, b in zip(stamps(), first)] == [True, False, True, True, True]
    second = stamps()
    bench.main([f for f in QUICK if f != "--max_iters=3"] + ["--max_iters=4"])
    # all five retrained, the fine-tunes too
    assert all(a != b for a, b in zip(stamps(), second))


@pytest.mark.parametrize("flag", ["--learning_rate=nan", "--learning_rate=inf", "--batch_size=-1",
                                  "--block_size=-1", "--num_prompts=0"])
def test_bench_settings_are_checked_before_any_work(flag):
    with pytest.raises(ValueError, match=f"{flag.split('=')[0]}=.*: must be"):
        bench.check_bench_config(parse_args(bench.DEFAULTS, [flag]))


@pytest.mark.parametrize("flags,message", [
    (["--batch_sizes=4,16"], "--batch_sizes=4,16: give ascending batch sizes from 1"),
    (["--batch_sizes=1,16,4"], "--batch_sizes=1,16,4: give ascending"),
    (["--tasks=arith", "--throughput_task=transform"],
     "--throughput_task=transform: not among --tasks \\(arith\\)"),
    (["--tasks=()", "--throughput_task="], "--tasks=\\(\\): name at least one task")])
def test_batch_settings_are_checked_before_any_work(flags, message):
    with pytest.raises(ValueError, match=message):
        bench.check_bench_config(parse_args(bench.DEFAULTS, flags))


def test_quick_refuses_tasks_it_would_not_run(tmp_path):
    with pytest.raises(ValueError, match="--quick runs transform alone: "
                                         "drop --tasks, or drop --quick"):
        bench.main(["--quick", "--tasks=transform,nope", f"--out_dir={tmp_path / 'bench'}"])
    assert not (tmp_path / "bench").exists()                          # refused before any work


def test_each_prompt_is_sampled_from_its_own_seeded_generator():
    """bench decodes prompt i with a generator seeded with i, whatever the warm-up drew: the same
    tokens as the decoder given torch.Generator().manual_seed(i) for that prompt alone."""
    model, ids = tiny_model(), {"eos_ids": (39,), "mask_id": 38, "pad_id": 37}
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    texts, _ = bench.run_decoder("next_token", model, prompts, ids,
                                 {"temperature": 1.0, "max_new_tokens": 12})
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        out = generate_next_token(model, prompt, DecodeSettings(12, temperature=1.0), eos_ids=(39,),
                          generator=torch.Generator().manual_seed(i), banned_ids=(38, 37))
        assert text == [t for t in out.tokens if t != 39]


def test_nothing_is_close_to_an_arm_that_got_nothing_right():
    """A point is "within 1 point of the ARM" only where the ARM got something right: next to a
    --quick run's ARM at 0%, no point is tagged close, and the headline takes the most accurate."""
    points = [{"quality": {"exact": q}, "tokens_per_s": s} for q, s in ((0.0, 10.0), (0.0, 20.0))]
    assert bench.fastest_close(points, 0.0) is None
    assert bench.fastest_close(points, 0.005)["tokens_per_s"] == 20.0  # 0% is within 1 of 0.5%
    assert bench.fastest_close(points + [{"quality": {"exact": 0.5}, "tokens_per_s": 1.0}],
                               0.5)["tokens_per_s"] == 1.0


def test_a_markdown_table_writes_every_cell_with_str_and_aligns_the_columns_asked():
    assert markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == (
        "| a | b |\n| --- | --- |\n| 1 | x |\n| 2.5 | None |")
    assert markdown_table(["a", "b", "c"], [], right=(0, 2)) == (
        "| a | b | c |\n| ---: | --- | ---: |")


def test_a_timer_keeps_each_calls_seconds_and_on_asking_what_it_returned(monkeypatch):
    ticks = iter([10.0, 10.5, 20.0, 22.0, 30.0, 31.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    timed = Timed(lambda x: 2 * x, "cpu", keep=True)
    assert [timed(3), timed(4)] == [6, 8]
    assert timed.seconds == [0.5, 2.0] and timed.results == [6, 8]
    unkept = Timed(lambda x: 2 * x, "cpu")
    assert unkept(5) == 10 and unkept.seconds == [1.0] and unkept.results == []


def test_a_timer_waits_for_a_gpu_before_and_after_each_call_and_never_for_a_cpu(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(device))
    Timed(lambda: events.append("call"), "cuda:1")()
    assert events == [torch.device("cuda:1"), "call", torch.device("cuda:1")]
    Timed(lambda: events.append("call on the CPU"), "cpu")()
    assert events[3:] == ["call on the CPU"]


def test_a_point_times_every_forward_pass_of_its_decodes_and_none_of_its_warm_up():
    model, ids = tiny_model(), {"eos_ids": (39,), "mask_id": 38, "pad_id": 37}
    decode, _ = make_decoder(point_config("next_token", {"max_new_tokens": 5}), ids, None)
    point = Point(model, ids, 5, decode)
    _, figures = point.measure([[1, 2, 3], [4, 5, 6, 7]])
    assert figures["forward_calls"] == len(point.timer.seconds) == figures["nfe"] == 10
    forward_s = sum(point.timer.seconds)
    assert all(s > 0 for s in point.timer.seconds) and forward_s < figures["seconds"]
    assert figures["ms_per_forward"] == 1e3 * forward_s / 10
    assert figures["bookkeeping_share"] == 1 - forward_s / figures["seconds"]
