"""
What the machine's matrix units do, and the dtype that pays there.

    cpu_kind()            AVX2, AVX512, AVX512 BF16 or AMX: the code paths torch's CPU kernels take
    native_bf16(device)   whether bf16 matmuls run on the device's own units, and why (or why not)
    pick_dtype(dtype, device, config)
                          --dtype=auto made concrete: bfloat16 where bf16 is native and, on a
                          CPU, measured to be faster for this model (measured_costs), else float32

On a CPU without bf16 units every bf16 matmul is converted to float32 and back: a 32-token pass of
SmolLM2 then costs 13x a 1-token pass in bf16 against 2.4x in float32 (AVX2 code paths), while with
AVX-512 BF16 it costs 1.7x (docs/benchmark.md, "What a forward pass costs"; `python -m
tools.probe`). The flag alone does not settle it: on an Intel Xeon with AVX512_BF16 and no AMX,
float32 is the faster dtype for SmolLM2's decoding and training, so --dtype=auto times one layer
of the model in both dtypes once per machine and keeps the verdict.

    machine()             what a figure was measured on: Python, torch, CPU, its kind, GPU
"""

import copy
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import torch
from filelock import FileLock, Timeout

from model import Transformer
from support.files import write_atomic


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
    """The code paths torch takes on this CPU, each library for what it runs: torch's own kernels
    at its capability (AVX2, AVX512, ...; lowered by ATEN_CPU_CAPABILITY), the matmuls through
    oneDNN, natively in bf16 where the CPU has bf16 units and ONEDNN_MAX_CPU_ISA lets oneDNN use
    them (onednn_allows). "AVX2", "AVX512", "AVX512 BF16", "AMX", or, with torch's kernels lowered
    below AVX-512 while oneDNN still multiplies bf16, "AVX2, oneDNN BF16" (or "AVX2, oneDNN AMX").
    The arguments stand in for the machine's own values (tests)."""
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
    """(True or False, why) for bf16 matmuls on device ("cpu", "cuda", "cuda:N", "mps"): native on
    a CUDA GPU that supports bf16 and a CPU whose oneDNN multiplies bf16 on its own units (cpu_kind
    "AVX512 BF16", "AMX", "AVX2, oneDNN BF16", ...); on MPS, float32 is kept."""
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


# Below this many parameters a CPU pass is bound by the cost of each operation, not by its
# arithmetic, and float32 is as fast or faster even with bf16 units (tools.probe, AVX512 BF16, a
# 1-token pass: the quick start's 0.9M-parameter model 2.4 to 2.9 ms in float32, 3.3 to 4.4 in
# bf16; 14M parameters 12.0 and 11.7; SmolLM2's 135M 64 and 49).
SMALL_MODEL = 10_000_000

# What the measured choice times (time_dtypes): a decoding pass of 32 tokens, ReFusion's widest
# usual pass, and a training step over 512 tokens. With the same bf16 flag, float32 is the faster
# at both on an Intel Xeon without AMX and bf16 on an AMD EPYC (docs/benchmark.md).
MEASURED_TOKENS = {"decode": 32, "train": 512}


def time_dtypes(config, work, repeats=7):
    """{"float32": ms, "bfloat16": ms} on this CPU for one layer of a model of this ModelConfig
    (random weights, a 1,024-token vocabulary), the median of repeats, the dtypes interleaved after
    an untimed round. work "decode": a forward pass of MEASURED_TOKENS["decode"] tokens without
    gradients, the weights in the dtype; "train": forward and backward over MEASURED_TOKENS["train"]
    tokens, the weights float32 and the matmuls under bf16 autocast or not, as train.py."""
    layer = dataclasses.replace(config, n_layer=1, vocab_size=1024)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(layer)
    T = min(layer.block_size, MEASURED_TOKENS[work])
    B = MEASURED_TOKENS[work] // T
    idx, pos = torch.zeros(B, T, dtype=torch.long), torch.arange(T).expand(B, T)
    models = {"float32": model, "bfloat16": model if work == "train" else
              copy.deepcopy(model).to(torch.bfloat16)}

    def step(dtype):
        if work == "decode":
            with torch.no_grad():
                models[dtype](idx, pos)
        else:
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
                logits = model(idx, pos)
            logits.float().mean().backward()

    ms = {d: [] for d in models}
    for i in range(repeats + 1):
        for d in ms:
            t0 = time.perf_counter()
            step(d)
            if i:
                ms[d].append((time.perf_counter() - t0) * 1e3)
    return {d: statistics.median(v) for d, v in ms.items()}


def verdicts_file():
    """Where measured dtype verdicts are kept: $XDG_CACHE_HOME/refusion/dtype.json, ~/.cache by
    default. A relative XDG_CACHE_HOME is ignored, as the XDG spec says; with no home directory
    known either (HOME unset, no passwd entry), None: nothing is kept, never a folder named ~ in
    the current directory."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        cache = os.path.join(home, ".cache")
    return os.path.join(cache, "refusion", "dtype.json")


def measured_costs(config, work, kind):
    """time_dtypes(config, work) on this machine, measured once and kept in verdicts_file() under
    the processor, its kind, torch's version, the threads and the layer's shape. An unreadable file,
    or a verdict of another shape than {"float32": ms, "bfloat16": ms} (positive, finite), is
    measured again; a file that cannot be written is left as it is. Returns (costs, where they are
    kept: the file, or None when it could not be written)."""
    c = config
    key = " | ".join((str(cpuinfo("model name")), kind, f"torch {torch.__version__}",
                      f"{torch.get_num_threads()} threads", work,
                      f"layer {c.n_embd} x {c.intermediate_size}, {c.n_head} / {c.n_kv_head} "
                      f"heads of {c.head_dim}"))
    path = verdicts_file()
    if path is None:
        return time_dtypes(config, work), None
    kept = read_verdicts(path)
    if is_verdict(kept.get(key)):
        return kept[key], path
    costs = time_dtypes(config, work)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # read again under a lock: another process may have kept a verdict while this one timed
        with FileLock(path + ".lock", timeout=30):
            kept = read_verdicts(path)
            write_atomic(path, lambda f: f.write(json.dumps(dict(kept, **{key: costs}),
                                                            indent=1).encode()))
    except (OSError, Timeout):
        return costs, None
    return costs, path


def read_verdicts(path):
    """The verdicts kept in path (a dict), or {} when it is missing or unreadable."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def is_verdict(entry):
    """True for a kept verdict of the right shape: {"float32": ms, "bfloat16": ms}, each a positive,
    finite number (measured_costs measures anything else again)."""
    return isinstance(entry, dict) and all(
        type(entry.get(d)) in (int, float) and 0 < entry[d] < float("inf")
        for d in ("float32", "bfloat16"))


def pick_dtype(dtype, device, config=None, kind=None, work="decode"):
    """(dtype name, note): "float32" and "bfloat16" as given (note None); "auto": float32 unless
    bf16 matmuls are native on device (native_bf16) and, on a CPU, the model of this ModelConfig
    (None: a large one, not timed) has at least SMALL_MODEL parameters and one of its layers runs
    work ("decode" or "train") faster in bf16 (measured_costs), with the note saying which and why.
    Raises ValueError for another value."""
    if dtype in ("float32", "bfloat16"):
        return dtype, None
    if dtype != "auto":
        raise ValueError(f"--dtype={dtype!r}: choose auto, float32 or bfloat16")
    native, why = native_bf16(device, kind)
    n = num_params(config) if config is not None else None
    if native and device.startswith("cpu") and n is not None and n < SMALL_MODEL:
        native, why = False, (f"{why}, but a model of {n / 1e6:.2g}M parameters (under "
                              f"{SMALL_MODEL / 1e6:.0f}M) is faster in float32 on a CPU")
    elif native and device.startswith("cpu") and n is not None:
        ms, kept = measured_costs(config, work, kind or cpu_kind())
        native = ms["bfloat16"] < ms["float32"]
        what = "training step" if work == "train" else "decoding pass"
        where = f"measured once, kept in {kept}" if kept else \
            f"measured now: {verdicts_file() or 'no cache folder'} could not be written, so it " \
            "is measured each time"
        why = (f"{why} {'and' if native else 'but'} a {what} of {MEASURED_TOKENS[work]} tokens "
               f"through one of this model's layers took {ms['bfloat16']:.1f} ms in bf16 against "
               f"{ms['float32']:.1f} in float32 here ({where})")
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
    cfg["dtype"], note = pick_dtype(cfg["dtype"], cfg["device"], config)
    if note:
        print(f"note: {note}", file=sys.stderr)


def machine():
    """What the figures were measured on: Python, torch, transformers (None when not installed), CPU
    model, the vector instructions torch's CPU kernels use (AVX2, AVX512, ...; with bf16 units:
    support.hardware.cpu_kind) and threads, GPU if any."""
    # Linux names the CPU model in /proc/cpuinfo, platform does not
    processor = cpuinfo("model name") or platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(), "processor": processor,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_kind": cpu_kind(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "transformers": importlib.metadata.version("transformers")
            if importlib.util.find_spec("transformers") else None}
