"""--dtype=auto's rule (support.hardware): bfloat16 where the device multiplies bf16 natively, on a
CPU for a model of 10M parameters or more, else float32; the machine's capability mocked, and
emulated in a subprocess. Nothing here is timed.

Run: python -m pytest -q tests/test_hardware.py
"""

import dataclasses
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

NATIVE = " multiplies bf16 natively"
EMULATED = " has no bf16 matrix units: bf16 would be converted to float32"
SMALL_WHY = ", but a model of 0.89M parameters (under 10M) is faster in float32 on a CPU"


@pytest.mark.parametrize("kind, config, chosen, why", [
    ("AVX512 BF16", LARGE, "bfloat16", NATIVE),
    ("AMX", LARGE, "bfloat16", NATIVE),
    ("AVX2, oneDNN BF16", LARGE, "bfloat16", NATIVE),
    ("AVX2, oneDNN AMX", LARGE, "bfloat16", NATIVE),
    ("AVX512", LARGE, "float32", EMULATED),
    ("AVX2", LARGE, "float32", EMULATED),
    ("DEFAULT", LARGE, "float32", EMULATED),
    # a model too small to gain from bf16 on a CPU (the quick start's) stays float32
    ("AVX512 BF16", SMALL, "float32", NATIVE + SMALL_WHY),
    ("AMX", SMALL, "float32", NATIVE + SMALL_WHY),
    ("AVX2, oneDNN BF16", SMALL, "float32", NATIVE + SMALL_WHY),
    ("AVX2, oneDNN AMX", SMALL, "float32", NATIVE + SMALL_WHY),
    ("AVX512", SMALL, "float32", EMULATED),
    ("AVX2", SMALL, "float32", EMULATED),
])
def test_auto_on_a_cpu_takes_bf16_where_it_is_native_for_a_model_of_10m_parameters_or_more(
        kind, config, chosen, why):
    assert pick_dtype("auto", "cpu", config, kind) == (
        chosen, f"--dtype=auto: {chosen}, as this CPU ({kind}){why}")
    # a dtype given is kept, whatever the machine and model
    assert pick_dtype("float32", "cpu", config, kind) == ("float32", None)
    assert pick_dtype("bfloat16", "cpu", config, kind) == ("bfloat16", None)
    with pytest.raises(ValueError, match="--dtype='fp16': choose auto, float32 or bfloat16"):
        pick_dtype("fp16", "cpu", config, kind)


@pytest.mark.parametrize("native, chosen, why", [
    (True, "bfloat16", "NVIDIA A100 multiplies bf16 natively"),
    (False, "float32", "NVIDIA A100 does not multiply bf16 natively")])
def test_auto_on_a_gpu_takes_bf16_where_it_is_native_whatever_the_model(monkeypatch, native,
                                                                        chosen, why):
    """Native means the GPU's own units (torch.cuda.is_bf16_supported without emulation); each
    process under torchrun (cuda:LOCAL_RANK) applies the rule itself and takes the same dtype."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation: asked.append(including_emulation) or native)
    for device in ("cuda", "cuda:1"):
        for config in (LARGE, SMALL):
            note = f"--dtype=auto: {chosen}, as {why}"
            assert pick_dtype("auto", device, config) == (chosen, note)
    assert asked == [False] * 4
    # MPS keeps float32
    assert pick_dtype("auto", "mps", LARGE) == ("float32", "--dtype=auto: float32, as bf16 on MPS "
                                                           "is not measured here")


def test_a_models_parameters_are_counted_without_allocating_them():
    config = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False,
                         qk_norm=False)
    counted = 2 * 300 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * config.intermediate_size + 2 * 64)
    assert num_params(config) == Transformer(config).num_params() == counted


def test_the_avx2_code_paths_forced_on_any_cpu_give_float32():
    """The environment that makes an AVX-512 machine run the AVX2 code paths (docs/benchmark.md)
    is seen as an AVX2 machine; ATEN_CPU_CAPABILITY alone leaves oneDNN's bf16 matmuls native."""
    config = dataclasses.asdict(LARGE)   # SmolLM2-135M's shape, large enough for bf16
    code = ("from model import ModelConfig\n"
            "from support.hardware import cpu_kind, pick_dtype\n"
            f"print(cpu_kind(), pick_dtype('auto', 'cpu', ModelConfig(**{config}))[0])")
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
    why = NATIVE if chosen == "bfloat16" else EMULATED
    used = []
    real_autocast = train.autocast_for
    monkeypatch.setattr(train, "autocast_for",
                        lambda device, dtype: used.append(dtype) or real_autocast(device, dtype))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    assert used == [chosen]
    note = f"--dtype=auto: {chosen}, as this CPU ({kind}){why}\n"
    assert f"process(es), {note}" in capsys.readouterr().out
    sampler.main([f"--out_dir={tmp_path / 'run'}", "--prompt=hi", "--max_new_tokens=8",
                  "--slot_size=4", "--json"])
    assert f"note: {note}" in capsys.readouterr().err
