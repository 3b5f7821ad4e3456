"""The dtype that pays on the machine: --dtype=auto takes bfloat16 only where bf16 matmuls are
native and, on a CPU, measured faster (support.hardware), with the machine's capability and
timings mocked, and emulated in a subprocess.

Run: python -m pytest -q tests/test_hardware.py
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import sampler
import train
from helpers import ROOT, tiny_run_flags
from support import hardware
from model import ModelConfig, Transformer
from support.hardware import cpu_kind, num_params, pick_dtype


@pytest.mark.parametrize("capability, flags, onednn_cap, kind", [
    ("AVX512", {"avx512f", "avx512_bf16"}, "ALL", "AVX512 BF16"),
    ("AVX512", {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "ALL", "AMX"),
    ("AVX512", {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AVX512_CORE_BF16",
     "AVX512 BF16"),
    ("AVX512", {"avx512f"}, "ALL", "AVX512"),                      # AVX-512 without bf16 units
    # ATEN_CPU_CAPABILITY=avx2 alone: torch's own kernels AVX2, oneDNN's matmuls still bf16
    ("AVX2", {"avx512f", "avx512_bf16"}, "ALL", "AVX2, oneDNN BF16"),
    ("AVX2", {"avx512f", "avx512_bf16", "amx_bf16"}, "ALL", "AVX2, oneDNN AMX"),
    ("AVX2", {"avx512f", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", "AVX2, oneDNN BF16"),
    ("AVX2", {"avx512f", "avx512_bf16"}, "AVX2", "AVX2"),          # ... and ONEDNN_MAX_CPU_ISA
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX2", "AVX512"),      # ONEDNN_MAX_CPU_ISA below it
    ("AVX512", {"avx512f", "avx512_bf16"}, "avx512_core", "AVX512"),
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX512_CORE_VNNI", "AVX512"),
    ("AVX2", {"avx2"}, "ALL", "AVX2"),
    ("DEFAULT", set(), "ALL", "DEFAULT"),
])
def test_the_cpu_kind_is_what_both_kernel_libraries_may_use(capability, flags, onednn_cap, kind):
    assert cpu_kind(capability, flags, onednn_cap) == kind


LARGE = ModelConfig(vocab_size=49153, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
                    intermediate_size=1536)     # SmolLM2-135M's shape
SMALL = ModelConfig(vocab_size=259, n_layer=4, n_head=4, n_embd=128)  # the quick start's


def timed(monkeypatch, tmp_path, bf16_ms, f32_ms):
    """Make time_dtypes return these timings, with a cache of their own (tmp_path), and list the
    (n_embd, work) of each call."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "time_dtypes", lambda config, work: calls.append(
        (config.n_embd, work)) or {"float32": f32_ms, "bfloat16": bf16_ms})
    return calls


@pytest.mark.parametrize("kind, native", [("AVX512 BF16", True), ("AMX", True),
                                          ("AVX2, oneDNN BF16", True), ("AVX2, oneDNN AMX", True),
                                          ("AVX512", False), ("AVX2", False)])
@pytest.mark.parametrize("bf16_ms, f32_ms", [(2.0, 3.0), (3.6, 3.1)])
def test_auto_takes_bf16_only_where_it_is_native_and_measured_faster(monkeypatch, tmp_path, kind,
                                                                     native, bf16_ms, f32_ms):
    calls = timed(monkeypatch, tmp_path, bf16_ms, f32_ms)
    chosen = "bfloat16" if native and bf16_ms < f32_ms else "float32"
    dtype, note = pick_dtype("auto", "cpu", LARGE, kind)
    assert dtype == chosen and note.startswith(f"--dtype=auto: {chosen}, as this CPU ({kind})")
    if native:    # timed once, then the verdict kept is read, for decoding and training apart
        assert f"a decoding pass of 32 tokens through one of this model's layers took " \
               f"{bf16_ms:.1f} ms in bf16 against {f32_ms:.1f} in float32 here" in note
        assert ("and" if chosen == "bfloat16" else "but") in note.split("natively ")[1][:4]
        assert pick_dtype("auto", "cpu", LARGE, kind, work="train")[0] == chosen
        assert pick_dtype("auto", "cpu", LARGE, kind) == (dtype, note)
        assert calls == [(576, "decode"), (576, "train")]
    else:         # nothing to time where bf16 is emulated
        assert "has no bf16 matrix units" in note and calls == []
    # a model too small to gain from bf16 on a CPU (the quick start's) stays float32, untimed
    assert pick_dtype("auto", "cpu", SMALL, kind) == ("float32", (
        f"--dtype=auto: float32, as this CPU ({kind}) multiplies bf16 natively, but a model of "
        f"{num_params(SMALL) / 1e6:.2g}M parameters (under 10M) is faster in float32 on a CPU")
        if native else note)
    assert len(calls) == 2 * native
    # a dtype given is kept, whatever the machine and model
    assert pick_dtype("float32", "cpu", LARGE, kind) == ("float32", None)
    assert pick_dtype("bfloat16", "cpu", SMALL, kind) == ("bfloat16", None)
    with pytest.raises(ValueError, match="--dtype='fp16': choose auto, float32 or bfloat16"):
        pick_dtype("fp16", "cpu", kind=kind)


def test_a_verdict_is_kept_per_machine_and_shape_and_an_unreadable_file_is_measured_again(
        monkeypatch, tmp_path):
    calls = timed(monkeypatch, tmp_path, 2.0, 3.0)
    path = hardware.verdicts_file()
    assert path == str(tmp_path / "refusion" / "dtype.json")
    wide = dataclasses.replace(LARGE, n_embd=1152, n_head=18, n_kv_head=6)
    for config in (LARGE, wide, LARGE, wide):
        assert hardware.measured_costs(config, "decode", "AMX")[0] == {"float32": 3.0,
                                                                      "bfloat16": 2.0}
    assert calls == [(576, "decode"), (1152, "decode")]
    with open(path) as f:
        kept = json.load(f)
    assert len(kept) == 2 and all("AMX | torch " in key for key in kept)
    with open(path, "w") as f:
        f.write("{not json")
    hardware.measured_costs(LARGE, "decode", "AMX")
    assert calls[2:] == [(576, "decode")]
    with open(path) as f:
        assert len(json.load(f)) == 1


@pytest.mark.parametrize("entry", [{}, {"float32": 1.0}, {"float32": "1", "bfloat16": "2"},
                                   {"float32": None, "bfloat16": None}, "fast", None, [1, 2],
                                   {"float32": True, "bfloat16": 1.0},
                                   {"float32": -1.0, "bfloat16": 1.0}])
def test_a_kept_verdict_of_the_wrong_shape_is_measured_again(monkeypatch, tmp_path, entry):
    calls = timed(monkeypatch, tmp_path, 2.0, 3.0)
    hardware.measured_costs(LARGE, "decode", "AMX")
    path = hardware.verdicts_file()
    with open(path) as f:
        key = next(iter(json.load(f)))
    with open(path, "w") as f:
        json.dump({key: entry}, f)
    assert hardware.measured_costs(LARGE, "decode", "AMX") == ({"float32": 3.0, "bfloat16": 2.0},
                                                               path)
    assert len(calls) == 2
    with open(path) as f:
        assert json.load(f) == {key: {"float32": 3.0, "bfloat16": 2.0}}


def test_a_verdict_kept_meanwhile_by_another_process_is_not_lost(monkeypatch, tmp_path):
    """Two processes measuring at once: the one that ends second keeps the first's verdict beside
    its own (it reads the file again, under a lock, before writing)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = hardware.verdicts_file()

    def timed_while_another_keeps_one(config, work):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:                    # the other process, done meanwhile
            json.dump({"another machine's key": {"float32": 1.0, "bfloat16": 4.0}}, f)
        return {"float32": 3.0, "bfloat16": 2.0}

    monkeypatch.setattr(hardware, "time_dtypes", timed_while_another_keeps_one)
    hardware.measured_costs(LARGE, "decode", "AMX")
    with open(path) as f:
        kept = json.load(f)
    assert len(kept) == 2 and kept["another machine's key"] == {"float32": 1.0, "bfloat16": 4.0}


def test_the_cache_folder_is_absolute_or_none(monkeypatch, tmp_path):
    """A relative XDG_CACHE_HOME is ignored (the XDG spec); without a home directory either, no
    verdict is kept (never a folder named ~ in the current directory)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert hardware.verdicts_file() == str(tmp_path / ".cache" / "refusion" / "dtype.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(hardware.os.path, "expanduser", lambda p: p)   # no passwd entry either
    assert hardware.verdicts_file() is None
    calls = []
    monkeypatch.setattr(hardware, "time_dtypes", lambda config, work: calls.append(work) or
                        {"float32": 3.0, "bfloat16": 2.0})
    monkeypatch.chdir(tmp_path)
    assert hardware.measured_costs(LARGE, "decode", "AMX") == ({"float32": 3.0,
                                                                "bfloat16": 2.0}, None)
    assert calls == ["decode"] and not (tmp_path / "~").exists()


def test_a_verdict_that_cannot_be_kept_is_not_said_to_be(monkeypatch, tmp_path):
    timed(monkeypatch, tmp_path, 2.0, 3.0)
    (tmp_path / "refusion").write_text("a file where the cache's folder would be")
    monkeypatch.setattr(hardware, "native_bf16", lambda device, kind: (True, "AMX"))
    _, note = pick_dtype("auto", "cpu", LARGE, "AMX")
    assert "kept in" not in note and "could not be written, so it is measured each time" in note


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # autocast's norms
def test_the_timing_runs_both_dtypes_on_one_layer_and_leaves_the_random_state_as_it_was():
    state = torch.random.get_rng_state()
    for work in ("decode", "train"):
        ms = hardware.time_dtypes(SMALL, work, repeats=2)
        assert set(ms) == {"float32", "bfloat16"} and all(v > 0 for v in ms.values())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_models_parameters_are_counted_without_allocating_them():
    config = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False,
                         qk_norm=False)
    assert num_params(config) == Transformer(config).num_params() == \
        2 * 300 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * config.intermediate_size + 2 * 64)


def test_the_avx2_code_paths_forced_on_any_cpu_give_float32():
    """The environment that makes an AVX-512 machine run the AVX2 code paths (docs/benchmark.md)
    is seen as an AVX2 machine; ATEN_CPU_CAPABILITY alone leaves oneDNN's bf16 matmuls native."""
    code = ("from support.hardware import cpu_kind, pick_dtype\n"
            "print(cpu_kind(), pick_dtype('auto', 'cpu')[0])")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["AVX2", "float32"]
    # oneDNN capped below its bf16 instructions alone: no bf16 units, whatever torch's kernels use
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    kind, dtype = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                 capture_output=True, check=True).stdout.rsplit(maxsplit=1)
    assert "BF16" not in kind and "AMX" not in kind and dtype == "float32"
    # torch's own kernels lowered alone: oneDNN still multiplies bf16 where the CPU has the units
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("DNNL_MAX_CPU_ISA", None)
    kind, dtype = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                 capture_output=True, check=True).stdout.rsplit(maxsplit=1)
    flags = hardware.cpu_flags()
    units = "AMX" if "amx_bf16" in flags else "BF16" if "avx512_bf16" in flags else None
    expected = (f"AVX2, oneDNN {units}", "bfloat16") if units else ("AVX2", "float32")
    assert (kind, dtype) == expected


@pytest.mark.parametrize("kind, chosen", [("AVX512 BF16", "bfloat16"), ("AVX2", "float32")])
def test_training_and_decoding_take_the_dtype_auto_picks(tmp_path, qa_file, capsys, monkeypatch,
                                                         kind, chosen):
    monkeypatch.setattr(hardware, "cpu_kind", lambda: kind)
    monkeypatch.setattr(hardware, "SMALL_MODEL", 0)  # the tiny model counts as large enough
    calls = timed(monkeypatch, tmp_path, 1.0, 2.0)             # ... and runs faster in bf16
    used = []
    real_autocast = train.autocast_for
    monkeypatch.setattr(train, "autocast_for",
                        lambda device, dtype: used.append(dtype) or real_autocast(device, dtype))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    assert used == [chosen]
    assert f"process(es), --dtype=auto: {chosen}, as this CPU ({kind})" in \
        capsys.readouterr().out
    sampler.main([f"--out_dir={tmp_path / 'run'}", "--prompt=hi", "--max_new_tokens=8",
                  "--slot_size=4", "--json"])
    assert f"note: --dtype=auto: {chosen}, as this CPU ({kind})" in capsys.readouterr().err
    assert [work for _, work in calls] == (["train", "decode"] if chosen == "bfloat16" else [])
