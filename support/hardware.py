"""
What the machine's matrix units do, and the dtype that pays there.

    cpu_kind()            AVX2, AVX512, AVX512 BF16 or AMX: the code paths torch's CPU kernels take
    native_bf16(device)   whether bf16 matmuls run on the device's own units, and why (or why not)
    pick_dtype(dtype, device)
                          --dtype=auto made concrete: bfloat16 where bf16 is native, else float32

On a CPU without bf16 units every bf16 matmul is converted to float32 and back: a 32-token pass of
SmolLM2 then costs 13x a 1-token pass in bf16 against 2.4x in float32 (AVX2 code paths), while with
AVX-512 BF16 it costs 1.7x (docs/benchmark.md, "What a forward pass costs"; `python -m
tools.probe`).
"""

import os
import sys

import torch

from model import Transformer


def cpuinfo(field):
    """The first value of a field of Linux's /proc/cpuinfo ("model name", "flags"); None where
    there is no such file or field."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.split(":", 1)[0].strip() == field), None)
    except OSError:
        return None


def cpu_flags():
    """The CPU's feature flags (Linux's /proc/cpuinfo); an empty set elsewhere."""
    return set((cpuinfo("flags") or "").split())


# oneDNN's instruction sets in order; ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA, its older name) caps
# the ones it uses: bf16 matmuls need AVX512_CORE_BF16 or above, AMX AVX512_CORE_AMX or above
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
               "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16",
               "AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16",
               "AVX512_CORE_AMX_FP16")


def onednn_allows(isa, cap=None):
    """Whether oneDNN may use instruction set isa under the cap (default: the environment's
    ONEDNN_MAX_CPU_ISA; unset, ALL or a name not in ONEDNN_ISAS: no cap)."""
    if cap is None:
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    cap = cap.upper()
    return cap not in ONEDNN_ISAS or ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


def cpu_kind(capability=None, flags=None, onednn_cap=None):
    """The code paths torch takes on this CPU: torch's capability (AVX2, AVX512, ...; lowered by
    ATEN_CPU_CAPABILITY), with " BF16" or "AMX" where the CPU multiplies bf16 natively and oneDNN
    may use it (onednn_allows), e.g. "AVX2", "AVX512", "AVX512 BF16", "AMX". The arguments stand
    in for the machine's own values (tests)."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    flags = cpu_flags() if flags is None else flags
    if capability.startswith("AVX512"):
        if "amx_bf16" in flags and onednn_allows("AVX512_CORE_AMX", onednn_cap):
            return "AMX"
        if "avx512_bf16" in flags and onednn_allows("AVX512_CORE_BF16", onednn_cap):
            return f"{capability} BF16"
    return capability


def native_bf16(device, kind=None):
    """(True or False, why) for bf16 matmuls on device ("cpu", "cuda", "cuda:N", "mps"): native on
    a CUDA GPU that supports bf16 and a CPU of kind AVX512 BF16 or AMX (cpu_kind); on MPS, float32
    is kept."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} multiplies bf16 natively"
        return False, f"{name} does not multiply bf16 natively"
    if device.startswith("mps"):
        return False, "bf16 on MPS is not measured here"
    kind = cpu_kind() if kind is None else kind
    if kind == "AMX" or kind.endswith("BF16"):
        return True, f"this CPU ({kind}) multiplies bf16 natively"
    return False, f"this CPU ({kind}) has no bf16 matrix units: bf16 would be converted to float32"


# Below this many parameters a CPU pass is bound by the cost of each operation, not by its
# arithmetic, and float32 is as fast or faster even with bf16 units (tools.probe, AVX512 BF16, a
# 1-token pass: the quick start's 0.9M-parameter model 2.4 to 2.9 ms in float32, 3.3 to 4.4 in
# bf16; 14M parameters 12.0 and 11.7; SmolLM2's 135M 64 and 49).
SMALL_MODEL = 10_000_000


def pick_dtype(dtype, device, num_params=None, kind=None):
    """(dtype name, note): "float32" and "bfloat16" as given (note None); "auto": bfloat16 where
    bf16 matmuls are native on device (native_bf16) and, on a CPU, the model (num_params; None:
    large) has at least SMALL_MODEL parameters, else float32, with the note saying which and why.
    Raises ValueError for another value."""
    if dtype in ("float32", "bfloat16"):
        return dtype, None
    if dtype != "auto":
        raise ValueError(f"--dtype={dtype!r}: choose auto, float32 or bfloat16")
    native, why = native_bf16(device, kind)
    if native and device.startswith("cpu") and num_params is not None and num_params < SMALL_MODEL:
        native, why = False, (f"{why}, but a model of {num_params / 1e6:.2g}M parameters (under "
                              f"{SMALL_MODEL / 1e6:.0f}M) is faster in float32 on a CPU")
    chosen = "bfloat16" if native else "float32"
    return chosen, f"--dtype=auto: {chosen}, as {why}"


def num_params(config):
    """The parameters of a Transformer of this ModelConfig (a tied embedding counted once), counted
    without allocating them."""
    with torch.device("meta"):
        return Transformer(config).num_params()


def settle_dtype(cfg, config):
    """Make cfg["dtype"] concrete for a decoding command, for a model of this ModelConfig
    (pick_dtype on cfg["device"]); --dtype=auto says on stderr what it took and why. Raises
    ValueError for a dtype not among auto, float32 and bfloat16."""
    cfg["dtype"], note = pick_dtype(cfg["dtype"], cfg["device"], num_params(config))
    if note:
        print(f"note: {note}", file=sys.stderr)
