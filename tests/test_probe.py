"""python -m tools.probe: what one forward pass costs against the tokens it is fed, and what that
allows ReFusion (support.benchmark.pass_costs, free_tokens, refusion_speedups).

Run: python -m pytest -q tests/test_probe.py
"""

import json

import pytest
import torch

import train
from helpers import tiny_model, tiny_run_flags
from model import ModelConfig
from support.benchmark import free_tokens, pass_costs, refusion_speedups
from support.hardware import pick_dtype
from tools import probe


class Spy(torch.nn.Module):
    """A tiny model whose passes are recorded: (name, tokens fed, tokens cached before)."""

    def __init__(self, name, calls):
        super().__init__()
        self.model, self.name, self.calls = tiny_model(), name, calls

    def new_kv_cache(self, max_len, max_batch=1):
        return self.model.new_kv_cache(max_len, max_batch)

    def forward(self, idx, position_ids, kv_cache=None):
        self.calls.append((self.name, idx.shape[1], kv_cache.length))
        assert position_ids[0, 0].item() == kv_cache.length   # true positions after the cached ones
        return self.model(idx, position_ids, kv_cache=kv_cache)


def test_pass_costs_times_every_model_and_width_in_turn_after_the_same_prefix():
    calls = []
    models = {"a": Spy("a", calls), "b": Spy("b", calls)}
    costs = pass_costs(models, prompt_len=6, fed=(1, 4), repeats=3)
    assert set(costs) == {"a", "b"} and all(set(c) == {1, 4} for c in costs.values())
    assert all(ms > 0 for c in costs.values() for ms in c.values())
    # the prefixes, then 4 rounds (the first warms up), each model and width once per round, each
    # pass after exactly the 6 cached tokens
    assert calls == [("a", 6, 0), ("b", 6, 0)] + \
        [(name, k, 6) for _ in range(4) for name in "ab" for k in (1, 4)]


def test_free_tokens_and_the_speedup_refusion_can_reach():
    costs = {"float32": {1: 10.0, 8: 12.0, 32: 20.0}, "bfloat16": {1: 8.0, 8: 10.5, 32: 40.0}}
    assert free_tokens(costs["float32"]) == 8 and free_tokens(costs["bfloat16"]) == 1
    assert free_tokens(costs["bfloat16"], ratio=1.4) == 8
    # against the cheapest 1-token pass (8 ms): 5 tokens per forward, passes of 8 and 32 tokens
    assert refusion_speedups(costs, 5.0, (8, 32)) == pytest.approx(
        {"float32": 8 / (16.0 / 5), "bfloat16": 8 / (25.25 / 5)})


def test_the_probe_of_a_checkpoint(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=1"])   # context 64
    capsys.readouterr()
    out = str(tmp_path / "run")
    probe.main([f"--out_dir={out}", "--prompt_len=32", "--fed=1,8,16,64", "--repeats=2",
                "--pass_mix=8,16", "--json", f"--plot={tmp_path / 'curve'}"])
    r = json.loads(capsys.readouterr().out)
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert list(r["ms"]) == ["float32", "bfloat16"] and r["dropped"] == [64]  # 32 + 64 > 64
    assert all(list(c) == ["1", "8", "16"] for c in r["ms"].values())
    # a model this small stays float32 on any CPU
    assert r["auto"] == "float32" and ("under 10M" in r["auto_why"] or "no bf16" in r["auto_why"])
    costs = {d: {int(k): ms for k, ms in c.items()} for d, c in r["ms"].items()}
    assert r["free_tokens"] == {d: free_tokens(c) for d, c in costs.items()}
    assert r["refusion_speedup"] == pytest.approx(refusion_speedups(costs, 5.0, (8, 16)))
    # a run's out_dir given as --init_from, as train.py takes it; one dtype: nothing to compare
    probe.main([f"--init_from={out}", "--prompt_len=32", "--fed=1,8", "--repeats=1",
                "--pass_mix=8", "--dtypes=float32"])
    text = capsys.readouterr().out
    assert "| float32 |" in text and "bfloat16 |" not in text and "--dtype=auto takes" in text
    assert "decodes faster in" not in text


SMOLLM2 = ModelConfig(vocab_size=49153, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                      intermediate_size=1536)


@pytest.mark.parametrize("machine_ms, advice", [
    # an Intel Xeon with AVX512_BF16 and no AMX: float32 measured faster than the rule's bf16
    ({"float32": {1: 29.0, 32: 70.0}, "bfloat16": {1: 33.0, 32: 86.0}},
     "; by these costs ReFusion decodes faster in float32: pass --dtype=float32 to take it"),
    # an AMD EPYC with the same flag: the measurement agrees with the rule
    ({"float32": {1: 64.0, 32: 149.0}, "bfloat16": {1: 49.0, 32: 83.0}},
     "; by these costs ReFusion decodes faster in bfloat16"),
])
def test_the_probe_says_what_auto_takes_and_what_its_measurement_shows(machine_ms, advice):
    auto, why = pick_dtype("auto", "cpu", SMOLLM2, "AVX512 BF16")
    speedups = refusion_speedups(machine_ms, 5.0, (32,))
    r = {"model": "smollm2", "params_m": 134.5, "device": "cpu", "prompt_len": 64, "repeats": 12,
         "machine": {"gpu": None, "processor": "a CPU", "cpu_kind": "AVX512 BF16",
                     "cpu_capability": "AVX512", "cpu_threads": 2, "torch": "2.13"},
         "dropped": [], "ms": machine_ms,
         "free_tokens": {d: free_tokens(c) for d, c in machine_ms.items()},
         "tpf": 5.0, "pass_mix": [32], "refusion_speedup": speedups,
         "next_token_dtype": min(machine_ms, key=lambda d: machine_ms[d][1]),
         "refusion_dtype": max(speedups, key=speedups.get), "auto": auto, "auto_why": why}
    assert probe.report_text(r).splitlines()[-1] == (
        "--dtype=auto takes bfloat16, as this CPU (AVX512 BF16) multiplies bf16 natively" + advice)


@pytest.mark.parametrize("flags, message", [
    (["--dtypes=float16"], "--dtypes=float16: name float32, bfloat16 or both"),
    (["--fed=4,8"], "1 among them"),
    (["--fed=1,8", "--pass_mix=32"], "--pass_mix=32: 32 not among --fed; add them to --fed"),
    (["--fed=1,2,8", "--pass_mix=2,8", "--tpf=5.5"],
     r"--tpf=5.5: a pass commits at most the tokens it is fed, so TPF cannot pass the mean of "
     r"--pass_mix \(5\)"),
    (["--tpf=0"], "--tpf=0.0: must be positive"),
    (["--plot=x.jpg"], "pictures are PNG files"),
])
def test_probe_settings_are_checked_before_the_model_is_read(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        probe.main([f"--out_dir={tmp_path / 'none'}"] + flags)


def test_a_pass_mix_past_the_context_is_refused(tmp_path, qa_file):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=1"])
    with pytest.raises(ValueError, match=r"--pass_mix: 64 tokens after --prompt_len=32 pass "
                                         "the model's context of 64"):
        probe.main([f"--out_dir={tmp_path / 'run'}", "--prompt_len=32", "--fed=1,64",
                    "--pass_mix=64", "--repeats=1"])


def test_an_mdm_checkpoint_is_refused_naming_what_the_probe_prices(tmp_path, qa_file):
    """An MDM runs neither ReFusion nor next-token decoding: no speed-ups of them are printed for
    it, before any timing."""
    train.main(tiny_run_flags(tmp_path, qa_file, "mdm", objective="mdm") + ["--max_iters=1"])
    with pytest.raises(ValueError, match=r"holds a masked diffusion model \(--objective=mdm\).*"
                                         r"runs neither ReFusion nor next-token decoding"):
        probe.main([f"--out_dir={tmp_path / 'mdm'}", "--repeats=1"])
