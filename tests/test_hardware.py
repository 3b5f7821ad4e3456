"""The dtype that pays on the machine: --dtype=auto takes bfloat16 only where bf16 matmuls are
native (support.hardware), with the machine's capability mocked, and emulated in a subprocess.

Run: python -m pytest -q tests/test_hardware.py
"""

import os
import subprocess
import sys

import pytest

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
    ("AVX2", {"avx512f", "avx512_bf16"}, "ALL", "AVX2"),           # ATEN_CPU_CAPABILITY=avx2
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX2", "AVX512"),      # ONEDNN_MAX_CPU_ISA below it
    ("AVX512", {"avx512f", "avx512_bf16"}, "avx512_core", "AVX512"),
    ("AVX512", {"avx512f", "avx512_bf16"}, "AVX512_CORE_VNNI", "AVX512"),
    ("AVX2", {"avx2"}, "ALL", "AVX2"),
    ("DEFAULT", set(), "ALL", "DEFAULT"),
])
def test_the_cpu_kind_is_what_both_kernel_libraries_may_use(capability, flags, onednn_cap, kind):
    assert cpu_kind(capability, flags, onednn_cap) == kind


@pytest.mark.parametrize("kind, chosen", [("AVX512 BF16", "bfloat16"), ("AMX", "bfloat16"),
                                          ("AVX512", "float32"), ("AVX2", "float32")])
def test_auto_takes_bf16_only_where_it_is_native_and_pays(kind, chosen):
    dtype, note = pick_dtype("auto", "cpu", 135_000_000, kind)
    assert dtype == chosen and note.startswith(f"--dtype=auto: {chosen}, as this CPU ({kind})")
    # a model too small to gain from bf16 on a CPU (the quick start's) stays float32
    assert pick_dtype("auto", "cpu", 900_000, kind) == ("float32", (
        f"--dtype=auto: float32, as this CPU ({kind}) multiplies bf16 natively, but a model of "
        "0.9M parameters (under 10M) is faster in float32 on a CPU") if chosen == "bfloat16"
        else note)
    # a dtype given is kept, whatever the machine and model
    assert pick_dtype("float32", "cpu", 135_000_000, kind) == ("float32", None)
    assert pick_dtype("bfloat16", "cpu", 900_000, kind) == ("bfloat16", None)
    with pytest.raises(ValueError, match="--dtype='fp16': choose auto, float32 or bfloat16"):
        pick_dtype("fp16", "cpu", kind=kind)


def test_a_models_parameters_are_counted_without_allocating_them():
    config = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False,
                         qk_norm=False)
    assert num_params(config) == Transformer(config).num_params() == \
        2 * 300 * 64 + 64 + 2 * (4 * 64 * 64 + 3 * 64 * config.intermediate_size + 2 * 64)


def test_the_avx2_code_paths_forced_on_any_cpu_give_float32():
    """The environment that makes an AVX-512 machine run the AVX2 code paths (docs/benchmark.md)
    is seen as an AVX2 machine."""
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


@pytest.mark.parametrize("kind, chosen", [("AVX512 BF16", "bfloat16"), ("AVX2", "float32")])
def test_training_and_decoding_take_the_dtype_auto_picks(tmp_path, qa_file, capsys, monkeypatch,
                                                         kind, chosen):
    monkeypatch.setattr(hardware, "cpu_kind", lambda: kind)
    monkeypatch.setattr(hardware, "SMALL_MODEL", 0)  # the tiny model counts as large enough
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
