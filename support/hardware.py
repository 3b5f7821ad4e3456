"""
What the machine's matrix units do, and the dtype --dtype=auto takes there (docs/benchmark.md).

    cpu_kind()            AVX2, AVX512, AVX512 BF16 or AMX: the code paths torch's CPU kernels take
    native_bf16(device)   whether bf16 matmuls run on the device's own units, and why (or why not)
    pick_dtype(dtype, device, config)
                          --dtype=auto by a rule that measures nothing: bfloat16 where bf16 is
                          native (on a CPU, for SMALL_MODEL parameters or more), else float32
    settle_dtype(cfg, config)   the same for a decoding command's settings, its note on stderr
    machine()             what a figure was measured on: Python, torch, CPU, its kind, GPU
"""

import importlib.metadata
import importlib.util
import os
import platform
import sys

import torch

from model import Transformer


def cpuinfo(field):
    """The first value of a field of /proc/cpuinfo ("model name", "flags"); None without one."""
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
    """The code paths torch takes on this CPU: its kernels' capability (ATEN_CPU_CAPABILITY) and
    oneDNN's bf16 units where onednn_allows them: "AVX2", "AVX512", "AVX512 BF16", "AMX", or with
    the kernels below AVX-512 "AVX2, oneDNN BF16" or "AVX2, oneDNN AMX". The arguments stand in for
    the machine's own values (tests)."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags and onednn_allows("AVX512_CORE_AMX", onednn_cap):
        units = "AMX"
    elif "avx512_bf16" in flags and onednn_allows("AVX512_CORE_BF16", onednn_cap):
        units = "BF16"
    else:
        return capability
    if not capability.startswith("AVX512"):
        return f"{capability}, oneDNN {units}"
    return "AMX" if units == "AMX" else f"{capability} BF16"


def native_bf16(device, kind=None):
    """(native, why) for bf16 matmuls on device ("cpu", "cuda", "cuda:N", "mps"): True on a CUDA
    GPU with bf16 units and a CPU whose cpu_kind (or `kind`) ends in BF16 or AMX; False on MPS."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} multiplies bf16 natively"
        return False, f"{name} does not multiply bf16 natively"
    if device.startswith("mps"):
        return False, "bf16 on MPS is not measured here"
    kind = cpu_kind() if kind is None else kind
    if kind.endswith(("AMX", "BF16")):
        return True, f"this CPU ({kind}) multiplies bf16 natively"
    return False, f"this CPU ({kind}) has no bf16 matrix units: bf16 would be converted to float32"


# Below this many parameters a CPU pass is bound by the cost of each operation, and float32 is as
# fast or faster even with bf16 units (tools.probe on AVX512 BF16).
SMALL_MODEL = 10_000_000


def pick_dtype(dtype, device, config, kind=None):
    """(dtype name, note) for a model of ModelConfig `config` on device: "float32" and "bfloat16"
    as given (note None); "auto": bfloat16 where native_bf16 (on a CPU, for SMALL_MODEL parameters
    or more), else float32, the note saying why. kind stands in for cpu_kind() (tests). Raises
    ValueError for another dtype."""
    if dtype in ("float32", "bfloat16"):
        return dtype, None
    if dtype != "auto":
        raise ValueError(f"--dtype={dtype!r}: choose auto, float32 or bfloat16")
    native, why = native_bf16(device, kind)
    n = num_params(config)
    if native and device.startswith("cpu") and n < SMALL_MODEL:
        native = False
        why = (f"{why}, but a model of {n / 1e6:.2g}M parameters (under {SMALL_MODEL / 1e6:.0f}M) "
               "is faster in float32 on a CPU")
    chosen = "bfloat16" if native else "float32"
    return chosen, f"--dtype=auto: {chosen}, as {why}"


def num_params(config):
    """The parameters of a Transformer of this ModelConfig, counted without allocating them."""
    with torch.device("meta"):
        return Transformer(config).num_params()


def settle_dtype(cfg, config):
    """Set cfg["dtype"] to pick_dtype's choice on cfg["device"], its note on stderr. Raises
    ValueError for a dtype not among auto, float32 and bfloat16."""
    cfg["dtype"], note = pick_dtype(cfg["dtype"], cfg["device"], config)
    if note:
        print(f"note: {note}", file=sys.stderr)


def machine():
    """What a figure was measured on, a dict: Python, torch and transformers (None without it)
    versions, CPU model, capability, cpu_kind and threads, GPU (None without one)."""
    # Linux names the CPU model in /proc/cpuinfo, platform does not
    processor = cpuinfo("model name") or platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(), "processor": processor,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_kind": cpu_kind(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "transformers": importlib.metadata.version("transformers")
            if importlib.util.find_spec("transformers") else None}
