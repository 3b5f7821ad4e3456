"""
What the benchmarks (tools.bench, bench_pretrained, bench_length, probe, gpu_report) measure;
support/report.py turns it into tables and pictures.

    train_or_reuse                       a benchmark's model: trained, reused or resumed
    Timed, TimedModel, Point             calls timed; one decoder over the prompts, its figures
    peak_above, hf_generate              a decode's peak memory; Hugging Face's generate, measured
    point_config, refusion_sweep, confidence_points   the settings of a benchmark's points
    decode_lines, batch_throughput       prompts decoded alone or in batches: tokens/s, latency
    compiled_vs_eager                    compiled decoding against eager
    pass_costs, model_pass_costs, free_tokens, refusion_speedups   a pass's cost by its width
    check_batch_settings                 refuse --tasks, --throughput_task or --batch_sizes
"""

import json
import os
import shutil
import statistics
import time

import torch

from configurator import explicit_keys, parse_args
from support.batching import generate_batch, prompt_generator
from support.checkpoint import load_checkpoint
from support.compiled import CompiledModel
from support.files import write_atomic
from support.hf_reference import hf_decode, hf_model
from support.runs import hold_out_dir

# -----------------------------------------------------------------------------
# the models


def train_or_reuse(train_main, train_defaults, flags, retrain=False):
    """Train a benchmark's model with train.py's flags (train_main, train_defaults: train.main,
    train.DEFAULTS) into their out_dir, unless a finished model of the same settings, newer than the
    checkpoint it starts from, is there (reused) or an interrupted one (resumed); retrain: anew.
    Returns the wall-clock minutes it took to train, over all its runs."""
    wanted = parse_args(train_defaults, flags)
    out, start = wanted["out_dir"], wanted["init_from"]
    same_keys = explicit_keys(wanted, train_defaults, flags) - {"out_dir", "data_root", "device",
                                                                "init_from"}
    minutes_file, ckpt_file = (os.path.join(out, name) for name in ("train_minutes.json",
                                                                    "ckpt.pt"))
    if os.path.isfile(ckpt_file) and not retrain and not (
            os.path.isfile(start) and os.path.getmtime(start) > os.path.getmtime(ckpt_file)):
        ckpt = load_checkpoint(out, settings_only=True)
        if all(ckpt["config"].get(k) == wanted[k] for k in same_keys):
            if ckpt["iter_num"] == wanted["max_iters"] and os.path.isfile(minutes_file):
                print(f"== reusing {out}: trained for {ckpt['iter_num']} iterations")
                with open(minutes_file) as f:
                    return json.load(f)["minutes"]
            print(f"== resuming {out} at iteration {ckpt['iter_num']} of {wanted['max_iters']}")
            flags = [f"--out_dir={out}", "--init_from=resume"]
    if "--init_from=resume" not in flags and os.path.isdir(out):
        # trained anew: what is there goes, but only under the run's lock, so that a live run
        # there is refused (ValueError, naming it) instead of losing its files
        with hold_out_dir(out):
            for name in set(os.listdir(out)) - {".lock", ".lock.holder"}:
                path = os.path.join(out, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
    print(f"\n== training {out}: python train.py {' '.join(flags)}", flush=True)
    t0 = time.perf_counter()
    train_main(flags)
    minutes = load_checkpoint(out, settings_only=True).get("train_minutes")
    if minutes is None:  # resumed from a checkpoint that did not record them: this run's only
        minutes = (time.perf_counter() - t0) / 60
    write_atomic(minutes_file, lambda f: f.write(json.dumps({"minutes": minutes}).encode()))
    return minutes

# -----------------------------------------------------------------------------
# measuring


def synchronize(device):
    """Wait for the work queued on device where it is a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """fn with its calls timed: seconds, the wall-clock seconds of each call, the device waited for
    before and after it; results, what each call returned, where keep is true."""

    def __init__(self, fn, device, keep=False):
        self.fn = fn
        self.device = torch.device(device)
        self.keep = keep
        self.seconds = []
        self.results = []

    def __call__(self, *args, **kwargs):
        synchronize(self.device)
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - t0)
        if self.keep:
            self.results.append(out)
        return out


class TimedModel(Timed):
    """A model as the decoders call it (model.DecoderModel: a Transformer, a CompiledModel), its
    forward passes timed (Timed), so that decode time splits into the model's and the decoder's."""

    def __init__(self, model):
        super().__init__(model, next(model.parameters()).device)
        self.config = model.config
        self.new_kv_cache = model.new_kv_cache
        self.parameters = model.parameters


class Point:
    """One decoder of a benchmark over its prompts, prompt by prompt: outputs, seconds, NFE, timed
    forward passes, peak memory above the loaded models. model: a Transformer, or with decode None
    a Hugging Face model (hf_model); decode: a one-prompt decoder (sampler.make_decoder's)."""

    def __init__(self, model, ids, max_new_tokens, decode=None):
        self.ids, self.max_new_tokens, self.decode = ids, max_new_tokens, decode
        device = next(model.parameters()).device
        if decode is None:
            self.hf = model
            self.timer = Timed(model.forward, device)
            self.hf.forward = self.timer
        else:
            self.model = TimedModel(model)
            self.timer = self.model
        self.device, self.outs, self.seconds, self.nfe, self.peak_mb = device, [], 0.0, 0, 0.0

    def run(self, prompt, i):
        """Decode prompt i (an id list): (its tokens, EOS included, seconds, forward passes)."""
        if self.decode is None:
            before = len(self.timer.seconds)
            tokens, seconds = hf_decode(self.hf, prompt, self.ids, self.max_new_tokens)
            return tokens, seconds, len(self.timer.seconds) - before
        out = self.decode(self.model, prompt, generator=prompt_generator(self.device, 0, i))
        return out.tokens, out.seconds, out.nfe

    def __call__(self, prompt, i):
        """Decode prompt i and add it to the point's figures."""
        (tokens, seconds, nfe), peak = peak_above(lambda: self.run(prompt, i))
        self.outs.append(tokens)
        self.seconds, self.nfe = self.seconds + seconds, self.nfe + nfe
        self.peak_mb = max(self.peak_mb, peak or 0.0)

    def warm_up(self, prompt):
        """One untimed decode (paying one-time costs), then the timer emptied."""
        self.run(prompt, 0)
        self.timer.seconds.clear()

    def measure(self, prompts):
        """A warm-up on prompts[0], then every prompt. Returns (id lists without EOS, figures())."""
        self.warm_up(prompts[0])
        for i, prompt in enumerate(prompts):
            self(prompt, i)
        return [[t for t in o if t not in self.ids["eos_ids"]] for o in self.outs], self.figures()

    def figures(self):
        """The point's figures so far (dict): tokens, nfe, tpf, seconds, tokens_per_s,
        forward_calls, ms_per_forward, bookkeeping_share (decode time outside forward passes)."""
        tokens = sum(len(o) for o in self.outs)
        forward_s = sum(self.timer.seconds)
        return {"tokens": tokens, "nfe": self.nfe, "tpf": tokens / self.nfe,
                "seconds": self.seconds, "tokens_per_s": tokens / self.seconds,
                "forward_calls": len(self.timer.seconds),
                "ms_per_forward": 1e3 * forward_s / len(self.timer.seconds),
                "bookkeeping_share": 1 - forward_s / self.seconds}


def pass_costs(models, prompt_len=64, fed=(1, 2, 4, 8, 16, 32, 64, 128), repeats=12):
    """Milliseconds of one cached forward pass of k tokens after prompt_len cached ones, for each
    model ({name: Transformer}) and k in fed: the median of repeats rounds, each timing every model
    and k in turn after a warm-up round. Returns {name: {k: ms}}."""
    devices = {name: next(model.parameters()).device for name, model in models.items()}
    timers = {name: {k: Timed(model, devices[name]) for k in fed} for name, model in models.items()}
    caches = {}
    with torch.inference_mode():
        for name, model in models.items():
            device = devices[name]
            caches[name] = model.new_kv_cache(prompt_len + max(fed))
            model(torch.zeros(1, prompt_len, dtype=torch.long, device=device),
                  torch.arange(prompt_len, device=device)[None], kv_cache=caches[name])
        for _ in range(repeats + 1):
            for name in models:
                device = devices[name]
                for k in fed:
                    timers[name][k](torch.zeros(1, k, dtype=torch.long, device=device),
                                    torch.arange(prompt_len, prompt_len + k, device=device)[None],
                                    kv_cache=caches[name])
                    caches[name].crop(prompt_len)
    # each timer's first call was the warm-up round's
    return {name: {k: 1e3 * statistics.median(t.seconds[1:]) for k, t in ks.items()}
            for name, ks in timers.items()}


def model_pass_costs(model, dtype, repeats, prompt_len=32, fed=(1, 8, 16, 32, 64)):
    """pass_costs of one model in dtype ("float32" or "bfloat16"), for the k of fed its context
    holds after prompt_len tokens: {k: ms} (the benchmarks' line of tools.probe's figures)."""
    fed = tuple(k for k in fed if prompt_len + k <= model.config.block_size)
    return pass_costs({dtype: model.to(getattr(torch, dtype))}, prompt_len, fed, repeats)[dtype]


def free_tokens(costs, ratio=1.25):
    """The most tokens fed to one pass for at most `ratio` times the cost of one token
    (costs: {k: ms}, with k = 1 among them)."""
    return max(k for k, ms in costs.items() if ms <= ratio * costs[1])


def refusion_speedups(costs, tpf, pass_mix):
    """What ReFusion decoding can reach against the fastest 1-token pass of these costs ({name: {k:
    ms}}): at `tpf` tokens per forward, its passes fed the widths in pass_mix (each as often), a
    token costs mean(their costs) / tpf. Returns {name: speed-up}."""
    best = min(c[1] for c in costs.values())
    return {name: best / (statistics.mean(c[k] for k in pass_mix) / tpf)
            for name, c in costs.items()}


def hf_generate(model, prompts, ids, max_new_tokens):
    """hf_decode of hf_model(model) over every prompt, measured as a Point. Returns (the id lists
    without EOS, speed figures), or None without transformers."""
    hf = hf_model(model)
    return None if hf is None else Point(hf, ids, max_new_tokens).measure(prompts)


def resident_kb(field):
    """A field of this process's memory, in kB, from /proc/self/status: "VmRSS" (resident now) or
    "VmHWM" (the peak); None where the system has no such file (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def peak_above(fn):
    """(fn(), the peak resident memory while it ran above the resident memory before, in MB).
    Linux resets the peak on asking (/proc/self/clear_refs); elsewhere the MB are None."""
    before = resident_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        before = None
    result = fn()
    peak = resident_kb("VmHWM") if before is not None else None
    return result, None if peak is None else max(peak - before, 0) / 1024

# -----------------------------------------------------------------------------
# the points a benchmark measures, and measuring many prompts at once


def point_config(method, knobs, **extra):
    """sampler.make_decoder's config of one benchmark point: greedy, the paper's infill and no MDM
    schedule, then knobs (the point's settings), extra (max_new_tokens) and the method."""
    return {"temperature": 0.0, "steps": 0, "block_length": 0, "infill": "paper", **knobs,
            **extra, "method": method}


def refusion_sweep(sweep, name, infill_modes):
    """(label, knobs) of every ReFusion point of a sweep, for the model called name: each infill
    mode (configurator.INFILL_MODES) x slot size x (slot, token) thresholds x serial blocks, in
    that order. sweep: {"slot_sizes", "thresholds", "serial_num_blocks"}."""
    for infill in infill_modes:
        for S in sweep["slot_sizes"]:
            for slot_thr, token_thr in sweep["thresholds"]:
                for blocks in sweep["serial_num_blocks"]:
                    yield (f"{name} S={S} serial={blocks} slot>{slot_thr} token>{token_thr} "
                           f"infill={infill}",
                           dict(slot_size=S, serial_num_blocks=blocks, infill=infill,
                                slot_threshold=slot_thr, token_threshold=token_thr))


def exact_points(slot_sizes, name):
    """(label, knobs) of verify="exact" (SPEC 4.5) at each slot size, for the model called name."""
    return [(f"{name} S={S} verify=exact", dict(slot_size=S, verify="exact")) for S in slot_sizes]


# Dream's confidence rules (sampler.generate_mdm's confidence, opt-in; SPEC section 4)
DREAM_RULES = ("margin", "entropy")


def confidence_points(label, knobs, dream):
    """(label, knobs) of an MDM schedule's points: LLaDA's confidence ("prob") under label, then,
    where dream is true, each of DREAM_RULES with ", <rule> (Dream)" after label. knobs: the
    schedule's settings (steps, block_length), to which each point adds its confidence."""
    return [(label if rule == "prob" else f"{label}, {rule} (Dream)", dict(knobs, confidence=rule))
            for rule in ("prob",) + (DREAM_RULES if dream else ())]


def decode_lines(model, decode, prompts, batch_size):
    """Every prompt decoded, batch_size at a time (1: each alone). Returns (Generations, the
    forward passes run: a batched pass once, a prompt alone's NFE)."""
    if batch_size == 1:
        outs = [decode(model, p) for p in prompts]
        return outs, sum(o.nfe for o in outs)
    passes = []
    outs = generate_batch(model, decode, prompts, batch_size, forwards=passes)
    return outs, len(passes)


def batch_throughput(decoders, prompts, batch_sizes):
    """Throughput and latency of each decoder over the first max(batch_sizes) prompts, batch_size
    at a time (sizes above the number of prompts left out), each size running every decoder.
    decoders: {label: (model, one-prompt decoder)}, greedy. batch_sizes: ascending from 1.
    Returns {"n_prompts", "rows"}: a row per (decoder, batch size) with tokens, seconds (wall),
    tokens_per_s, latency_ms (the mean of each prompt's seconds from its batch's start to its end),
    vs_batch_1 and vs_first (tokens/s over the decoder's at batch 1, over the first decoder's at
    this size) and identical (the share of prompts whose tokens equal their batch-1 decode's)."""
    prompts = prompts[:max(batch_sizes)]
    batch_sizes = [B for B in batch_sizes if B <= len(prompts)]
    print(f"decode in batches of {', '.join(map(str, batch_sizes))}: {len(prompts)} prompts",
          flush=True)
    runs = {}                                  # (label, batch size) -> decode_lines, timed
    for B in batch_sizes:
        for label, (model, decode) in decoders.items():
            device = next(model.parameters()).device
            runs[label, B] = Timed(decode_lines, device, keep=True)
            runs[label, B](model, decode, prompts, B)
    rows = []
    for (label, B), run in runs.items():
        seconds = run.seconds[0]
        outs, _ = run.results[0]
        alone = runs[label, batch_sizes[0]].results[0][0]
        tokens = sum(len(o.tokens) for o in outs)
        rows.append({"decoder": label, "batch_size": B, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds,
                     "latency_ms": 1e3 * sum(o.seconds for o in outs) / len(outs),
                     "identical": sum(o.tokens == a.tokens for o, a in zip(outs, alone)) /
                     len(outs)})
    for row in rows:
        same = {r["decoder"]: r for r in rows if r["batch_size"] == row["batch_size"]}
        alone = next(r for r in rows
                     if r["decoder"] == row["decoder"] and r["batch_size"] == batch_sizes[0])
        row["vs_batch_1"] = row["tokens_per_s"] / alone["tokens_per_s"]
        row["vs_first"] = row["tokens_per_s"] / same[next(iter(decoders))]["tokens_per_s"]
    rows.sort(key=lambda r: (list(decoders).index(r["decoder"]), r["batch_size"]))
    return {"n_prompts": len(prompts), "rows": rows}


def compiled_vs_eager(decoders, prompts):
    """Each decoder ({label: (model, one-prompt decoder)}) eager and compiled (a fresh
    CompiledModel each), greedy: an untimed decode of every prompt compiles the graphs, then each
    prompt runs eager and compiled in turn. Returns {"n_prompts", "rows"}: per decoder
    tokens_per_s (eager), compiled_tokens_per_s, vs_eager, identical (the share of prompts equal to
    eager), graphs and compile_s."""
    rows = []
    for label, (model, decode) in decoders.items():
        compiled = CompiledModel(model)
        graphs, seconds = compiled.compile_for(decode, prompts)
        row = {"decoder": label, "graphs": graphs, "compile_s": seconds}
        outs = [(decode(model, p), decode(compiled, p)) for p in prompts]
        for name, i in (("tokens_per_s", 0), ("compiled_tokens_per_s", 1)):
            row[name] = sum(len(o[i].tokens) for o in outs) / sum(o[i].seconds for o in outs)
        row["vs_eager"] = row["compiled_tokens_per_s"] / row["tokens_per_s"]
        row["identical"] = sum(a.tokens == b.tokens for a, b in outs) / len(outs)
        rows.append(row)
    return {"n_prompts": len(prompts), "rows": rows}


def check_batch_settings(cfg):
    """Raise ValueError unless --tasks names a task, --throughput_task is one of them (or empty: no
    batches) and --batch_sizes ascend from 1, the one-prompt reference."""
    if not cfg["tasks"]:
        raise ValueError("--tasks=(): name at least one task to benchmark, e.g. --tasks=quotes")
    if cfg["throughput_task"] and cfg["throughput_task"] not in cfg["tasks"]:
        raise ValueError(f"--throughput_task={cfg['throughput_task']}: not among --tasks "
                         f"({', '.join(cfg['tasks'])}); name one of them, or '' for no batches")
    sizes = tuple(cfg["batch_sizes"])
    if not sizes or sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"--batch_sizes={','.join(map(str, sizes))}: give ascending batch sizes "
                         "from 1 (the one-prompt reference), e.g. --batch_sizes=1,4,16,64")
