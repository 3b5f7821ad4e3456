"""
What the benchmarks (python -m tools.bench, python -m tools.bench_pretrained) measure and how they
report it:

    train_or_reuse                       a benchmark's model: trained, reused or resumed
    TimedModel, counting, speed_figures  forward passes counted and timed; a point's figures
    Point                                one decoder over the prompts, called prompt by prompt
    peak_above                           the peak resident memory of a decode above the weights
    hf_model, hf_decode                  Hugging Face transformers on the same weights, greedy
    headline, highlights_table           the tables (the README's, bench.md's)
    batch_throughput, throughput_table   tokens/s and latency at batch 1, 4, 16, 64
    plot, machine                        quality against speed; what the figures were measured on
    pass_costs, model_pass_costs, free_tokens, refusion_speedups
                                         what one forward pass costs against the tokens it is fed,
                                         and what that allows ReFusion (python -m tools.probe)
"""

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import statistics
import time

import torch
import torch.nn as nn

from configurator import explicit_keys, parse_args
from support.batching import generate_batch
from support.checkpoint import load_checkpoint
from support.compiled import CompiledModel
from support.files import write_atomic
from support.hardware import cpu_kind, cpuinfo
from support.runs import hold_out_dir
from support.sampling import prompt_generator

# -----------------------------------------------------------------------------
# the models


def train_or_reuse(train_main, train_defaults, flags, retrain=False):
    """Train a benchmark's model with train.py's flags into their out_dir, unless it is there: a
    finished model trained with the same settings (those flags give, but out_dir, data_root,
    device and init_from) and after the checkpoint it starts from is reused, one interrupted
    part-way is resumed, anything else is trained anew. train_main, train_defaults: train.main and
    train.DEFAULTS (support/ does not import the scripts). Returns the training's wall-clock
    minutes, a resumed model's across its runs (the checkpoint's train_minutes), a reused model's
    as recorded when it was trained (out_dir/train_minutes.json)."""
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


class TimedModel(nn.Module):
    """The model, with the wall-clock seconds of its forward passes counted (see counting), so that
    decode time splits into model time and bookkeeping."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
        self.forward, self.calls = counting(model.forward, next(model.parameters()).device)

    def new_kv_cache(self, max_len, max_batch=1):
        return self.model.new_kv_cache(max_len, max_batch)


def counting(forward, device):
    """forward wrapped to count its calls and their wall-clock seconds (waiting for the GPU where
    there is one): (wrapped, {"n": calls, "seconds": s})."""
    calls, sync = ({"n": 0, "seconds": 0.0},
                   torch.cuda.synchronize if device.type == "cuda" else (lambda: None))

    def wrapped(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        sync()
        calls["n"] += 1
        calls["seconds"] += time.perf_counter() - t0
        return out
    return wrapped, calls


class Point:
    """One decoder of a benchmark over its prompts, called prompt by prompt (the benchmarks call
    every point in turn): its forward passes timed (TimedModel, or counting Hugging Face's
    forward), its outputs, seconds, NFE and the peak memory of its decodes above the loaded models.
    model: a Transformer, or with decode None a Hugging Face model (hf_model); decode: a one-prompt
    decoder as sampling.make_decoder returns it."""

    def __init__(self, model, ids, max_new_tokens, decode=None):
        self.ids, self.max_new_tokens, self.decode = ids, max_new_tokens, decode
        device = next(model.parameters()).device
        if decode is None:
            self.hf = model
            self.hf.forward, self.calls = counting(model.forward, device)
        else:
            self.model = TimedModel(model)
            self.calls = self.model.calls
        self.device, self.outs, self.seconds, self.nfe, self.peak_mb = device, [], 0.0, 0, 0.0

    def run(self, prompt, i):
        """Decode prompt i (an id list): (its tokens, EOS included, seconds, forward passes)."""
        if self.decode is None:
            before = self.calls["n"]
            tokens, seconds = hf_decode(self.hf, prompt, self.ids, self.max_new_tokens)
            return tokens, seconds, self.calls["n"] - before
        out = self.decode(self.model, prompt, generator=prompt_generator(self.device, 0, i))
        return out.tokens, out.seconds, out.nfe

    def __call__(self, prompt, i):
        """Decode prompt i and add it to the point's figures."""
        (tokens, seconds, nfe), peak = peak_above(lambda: self.run(prompt, i))
        self.outs.append(tokens)
        self.seconds, self.nfe = self.seconds + seconds, self.nfe + nfe
        self.peak_mb = max(self.peak_mb, peak or 0.0)

    def warm_up(self, prompt):
        """One untimed decode (the first forward passes pay one-time costs), then the counts
        reset."""
        self.run(prompt, 0)
        self.calls.update(n=0, seconds=0.0)

    def figures(self):
        """The point's speed figures so far (speed_figures)."""
        return speed_figures(sum(len(o) for o in self.outs), self.nfe, self.seconds, self.calls)


def pass_costs(models, prompt_len=64, fed=(1, 2, 4, 8, 16, 32, 64, 128), repeats=12):
    """Milliseconds of one cached forward pass of k tokens after prompt_len cached ones, for every
    model of models ({name: Transformer}, e.g. one per dtype) and every k in fed: the median of
    repeats, interleaved (each round times every model and k once, in turn, after a first round
    that warms up) so that all see the same machine load. Returns {name: {k: ms}}."""
    caches, times = {}, {name: {k: [] for k in fed} for name in models}
    devices = {name: next(model.parameters()).device for name, model in models.items()}
    with torch.inference_mode():
        for name, model in models.items():
            device = devices[name]
            caches[name] = model.new_kv_cache(prompt_len + max(fed))
            model(torch.zeros(1, prompt_len, dtype=torch.long, device=device),
                  torch.arange(prompt_len, device=device)[None], kv_cache=caches[name])
        for round_ in range(repeats + 1):
            for name, model in models.items():
                device = devices[name]
                sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
                for k in fed:
                    sync()
                    t0 = time.perf_counter()
                    model(torch.zeros(1, k, dtype=torch.long, device=device),
                          torch.arange(prompt_len, prompt_len + k, device=device)[None],
                          kv_cache=caches[name])
                    sync()
                    if round_:
                        times[name][k].append(time.perf_counter() - t0)
                    caches[name].crop(prompt_len)
    return {name: {k: 1e3 * statistics.median(t) for k, t in ks.items()}
            for name, ks in times.items()}


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
    """What ReFusion decoding can reach against the fastest next-token decoding of these costs
    ({name: {k: ms}}): at `tpf` tokens per forward pass, its passes fed the numbers of tokens in
    pass_mix (each as often), it spends mean(cost of those passes) / tpf ms per token, against the
    smallest cost of a 1-token pass. Returns {name: speed-up}."""
    best = min(c[1] for c in costs.values())
    return {name: best / (statistics.mean(c[k] for k in pass_mix) / tpf)
            for name, c in costs.items()}


def speed_figures(tokens, nfe, seconds, calls):
    """A point's speed figures: tokens, NFE (as the decoder counts it), TPF (tokens / NFE), seconds,
    tokens/s, the forward calls the model saw (counting: equal to NFE), ms per forward pass and the
    share of decode time spent outside the model's forward passes."""
    return {"tokens": tokens, "nfe": nfe, "tpf": tokens / nfe, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "forward_calls": calls["n"],
            "ms_per_forward": 1e3 * calls["seconds"] / calls["n"],
            "bookkeeping_share": 1 - calls["seconds"] / seconds}


def hf_model(model, dtype=None):
    """Hugging Face transformers' model with the same weights as our Transformer `model` (module
    names map one to one): Qwen3ForCausalLM where it normalizes queries and keys, else
    LlamaForCausalLM (SmolLM2), in dtype (default: the model's), in eval mode on its device.
    Returns None where transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    c = model.config
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd,
                 intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                 num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
                 max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
                 rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                 tie_word_embeddings=c.tie_embeddings)
    if c.qk_norm:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attention_bias=False,
                                                                    mlp_bias=False))
    hf.load_state_dict({("" if k == "lm_head.weight" else "model.") + k: v
                        for k, v in model.state_dict().items()})
    weights = next(model.parameters())
    return hf.to(weights.device, dtype or weights.dtype).eval()


def hf_decode(hf, prompt, ids, max_new_tokens):
    """Greedy `generate` of one prompt (ids: a list) with its KV cache, the mask and pad ids
    suppressed as ours are (ids: {"eos_ids", "mask_id", "pad_id"}); a batch of one stops at its
    first EOS. Returns (the generated ids, EOS included, wall-clock seconds)."""
    device = next(hf.parameters()).device
    x = torch.tensor([prompt], device=device)
    suppress = [i for i in (ids["mask_id"], ids["pad_id"])
                if i is not None and i not in ids["eos_ids"]]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=list(ids["eos_ids"]),
                          pad_token_id=ids["eos_ids"][0], suppress_tokens=suppress or None)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def hf_generate(model, prompts, ids, max_new_tokens):
    """The reference a user would otherwise pick, over every prompt: hf_decode of hf_model(model)
    (a warm-up first, untimed). Returns (texts: the id lists without EOS, speed figures), or None
    without transformers."""
    hf = hf_model(model)
    if hf is None:
        return None
    hf_decode(hf, prompts[0], ids, max_new_tokens)  # warm-up, untimed
    hf.forward, calls = counting(hf.forward, next(model.parameters()).device)
    outs = [hf_decode(hf, p, ids, max_new_tokens) for p in prompts]
    tokens = sum(len(o) for o, _ in outs)
    seconds = sum(s for _, s in outs)
    return ([[t for t in o if t not in ids["eos_ids"]] for o, _ in outs],
            speed_figures(tokens, calls["n"], seconds, calls))

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
# reporting


def best_mdm(rows):
    """The MDM point that "vs MDM" compares with: the best quality of any MDM point (either model,
    any schedule), and the fastest of the points that reach it; None where no row is an MDM's."""
    return max((r for r in rows if r["method"] == "mdm"),
               key=lambda r: (first_quality(r), r["tokens_per_s"]), default=None)


def fastest_close(points, ar_quality):
    """The fastest of the points whose quality is within 1 point of the ARM's, or None when none
    is, or when the ARM got nothing right (a --quick run's models): then nothing is close to it."""
    if ar_quality <= 0:
        return None
    close = [r for r in points if first_quality(r) >= ar_quality - 0.01]
    return max(close, key=lambda r: r["tokens_per_s"]) if close else None


def most_accurate(points):
    """The point of the best quality, the fastest of those that tie."""
    return max(points, key=lambda r: (first_quality(r), r["tokens_per_s"]))


def headline(rows):
    """The README's table: per task the ARM, the MDM point "vs MDM" compares with, and for each
    infill mode the best ReFusion point of either model (its fastest point within 1 point of the
    ARM's quality, or, when none is, its most accurate point, the fastest of those that tie), as
    markdown. rows: bench.json's points, the ARM's first in each task."""
    lines = ["| task | decoder | quality | tokens | TPF | tokens/s | vs ARM | vs MDM |",
             "| --- " * 8 + "|"]
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        ar_quality = first_quality(task_rows[0])
        picks = [task_rows[0]] + [r for r in [best_mdm(task_rows)] if r is not None]
        refusion = [r for r in task_rows if r["method"] == "refusion"]
        for infill in dict.fromkeys(r["settings"]["infill"] for r in refusion):
            points = [r for r in refusion if r["settings"]["infill"] == infill]
            picks.append(fastest_close(points, ar_quality) or most_accurate(points))
        for r in picks:
            lines.append(f"| {task} | {r['label']} | {quality_text(r)} | {r['tokens']} | "
                         f"{r['tpf']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup_vs_ar']:.2f}x | "
                         f"{speedup_text(r.get('speedup_vs_mdm'), 1)} |")
    return "\n".join(lines)


def first_quality(row):
    """A point's quality measure: the first metric of its task (exact, accuracy or parse_rate)."""
    return next(iter(row["quality"].values()))


def speedup_text(ratio, digits=2):
    """A speed-up as a table shows it ("4.29x"), or "-" where there is nothing to compare with."""
    return "-" if ratio is None else f"{ratio:.{digits}f}x"


def quality_text(row):
    """A point's quality metrics as text: "parse_rate 83.9%, first_line 1.1%"."""
    return ", ".join(f"{m} {q:.1%}" for m, q in row["quality"].items())


def highlights_table(rows):
    """The highlighted rows as a markdown table."""
    lines = ["| task | decoder | why | train iters | quality | tokens | NFE | TPF | tokens/s | "
             "ms/forward | bookkeeping | vs ARM | vs MDM |", "| --- " * 13 + "|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['label']} | {r['why']} | {r['train_iters']} | "
                     f"{quality_text(r)} | {r['tokens']} | {r['nfe']} | {r['tpf']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['ms_per_forward']:.2f} | "
                     f"{r['bookkeeping_share']:.0%} | {r['speedup_vs_ar']:.2f}x | "
                     f"{speedup_text(r.get('speedup_vs_mdm'), 1)} |")
    return "\n".join(lines)


# the plot's series: (colour, marker)
STYLE = {"ARM": ("tab:blue", "s"), "HF generate": ("tab:cyan", "D"), "MDM": ("tab:olive", "v"),
         "MDM-ft (from the ARM)": ("tab:green", "^"),
         "ReFusion, paper infill": ("tab:red", "o"),
         "ReFusion, infill=speculative": ("tab:orange", "o"),
         "ReFusion-ft, paper infill": ("tab:purple", "o"),
         "ReFusion-ft, infill=speculative": ("tab:pink", "o")}
# the small benchmark's models, as its rows name them
NAMES = {"ar": "ARM", "mdm": "MDM", "mdm-ft": "MDM-ft", "refusion": "ReFusion",
         "refusion-ft": "ReFusion-ft"}


def series(row):
    """The plot's series of a point: its row's "series", or for the small benchmark's rows (which
    have none) the model and, for ReFusion, the infill mode."""
    if "series" in row:
        return row["series"]
    if row["method"] == "hf":
        return "HF generate"
    if row["method"] == "refusion":
        infill = "paper infill" if row["settings"]["infill"] == "paper" else "infill=speculative"
        return f"{NAMES[row['model']]}, {infill}"
    return "MDM-ft (from the ARM)" if row["model"] == "mdm-ft" else NAMES[row["model"]]


def plot(rows, path):
    """Per task, quality against tokens/s relative to the ARM (log scale): every ReFusion point, per
    model and infill mode, with its frontier (the points no other point beats in both), the ARM, the
    MDM points of both MDMs and the Hugging Face row. Needs matplotlib; returns False without it."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    task_names = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(task_names), figsize=(6 * len(task_names), 4.5), squeeze=False)
    style = dict(STYLE)
    colors = iter(["tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:blue", "tab:red"])
    for r in rows:  # a series the table above does not name gets a colour of its own
        name = series(r)
        if name not in style:
            style[name] = (next(colors, "black"), "o" if r["method"] == "refusion" else "s")

    for ax, task in zip(axes[0], task_names):
        task_rows = [r for r in rows if r["task"] == task]
        for name, (color, marker) in style.items():
            pts = [r for r in task_rows if series(r) == name]
            if not pts:
                continue
            xs, ys = [r["speedup_vs_ar"] for r in pts], [first_quality(r) for r in pts]
            ax.scatter(xs, ys, color=color, marker=marker, label=name, alpha=0.8)
            if pts[0]["method"] == "refusion":
                frontier = sorted((x, y) for x, y in zip(xs, ys)
                                  if not any(x2 >= x and y2 > y or x2 > x and y2 >= y
                                             for x2, y2 in zip(xs, ys)))
                ax.plot(*zip(*frontier), color=color, alpha=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("tokens/s relative to the ARM (log scale)")
        ax.set_ylabel(next(iter(task_rows[0]["quality"])))
        ax.set_title(task)
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    return True


def point_config(method, knobs, **extra):
    """sampling.make_decoder's config of one benchmark point: greedy, the paper's infill and no MDM
    schedule unless knobs (the point's settings) say otherwise, then extra (max_new_tokens) and
    the method."""
    return {"temperature": 0.0, "steps": 0, "block_length": 0, "infill": "paper", **knobs,
            **extra, "method": method}


def refusion_sweep(sweep, name, infill_modes):
    """(label, knobs) of every ReFusion point of a sweep, for the model called name: each infill
    mode (sampler.INFILL_MODES; support/ does not import the scripts) x slot size x (slot, token)
    thresholds x serial blocks, in that order. sweep: {"slot_sizes", "thresholds",
    "serial_num_blocks"}."""
    for infill in infill_modes:
        for S in sweep["slot_sizes"]:
            for slot_thr, token_thr in sweep["thresholds"]:
                for blocks in sweep["serial_num_blocks"]:
                    yield (f"{name} S={S} serial={blocks} slot>{slot_thr} token>{token_thr} "
                           f"infill={infill}",
                           dict(slot_size=S, serial_num_blocks=blocks, infill=infill,
                                slot_threshold=slot_thr, token_threshold=token_thr))


# Dream's confidence rules (sampler.generate_mdm's confidence, opt-in; SPEC section 4)
DREAM_RULES = ("margin", "entropy")


def confidence_points(label, knobs, dream):
    """(label, knobs) of an MDM schedule's points: LLaDA's confidence ("prob") under label, then,
    where dream is true, each of DREAM_RULES with ", <rule> (Dream)" after label. knobs: the
    schedule's settings (steps, block_length), to which each point adds its confidence."""
    return [(label if rule == "prob" else f"{label}, {rule} (Dream)", dict(knobs, confidence=rule))
            for rule in ("prob",) + (DREAM_RULES if dream else ())]


def batch_throughput(decoders, prompts, batch_sizes, rounds=1):
    """Throughput and latency of each decoder decoding the first max(batch_sizes) prompts,
    batch_size prompts at a time (the sizes above the prompts there are left out).

    decoders: {label: (model, a one-prompt decoder as sampling.make_decoder returns it)}, greedy;
    the first is the one "vs first" compares with. batch_sizes: ascending, the first 1 (each prompt
    decoded alone, as the rest of the benchmark does: the reference). Interleaved: each round runs
    every batch size, and in it every decoder, in turn; the figures are the median round's.
    Returns {"n_prompts", "rows"}: a row per (decoder, batch size) with tokens, seconds (wall),
    tokens_per_s, latency_ms (the mean over prompts of its decode's seconds: from its batch's
    start to its end), vs_batch_1 (tokens/s over the decoder's at batch 1), vs_first (over the
    first decoder's at the same batch size) and identical (the share of prompts whose tokens equal
    their batch-1 decode's).
    """
    prompts = prompts[:max(batch_sizes)]
    batch_sizes = [B for B in batch_sizes if B <= len(prompts)]
    print(f"decode in batches of {', '.join(map(str, batch_sizes))}: {len(prompts)} prompts",
          flush=True)
    runs = {}                                    # (label, batch size) -> [(seconds, outs)] a round
    for _ in range(rounds):
        for B in batch_sizes:
            for label, (model, decode) in decoders.items():
                t0 = time.perf_counter()
                outs = ([decode(model, p) for p in prompts] if B == 1 else
                        generate_batch(model, decode, prompts, B))
                runs.setdefault((label, B), []).append((time.perf_counter() - t0, outs))
    rows = []
    for (label, B), timed in runs.items():
        seconds, outs = sorted(timed, key=lambda t: t[0])[len(timed) // 2]
        alone = runs[label, batch_sizes[0]][0][1]
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
    """Each decoder eager and compiled (support.compiled.CompiledModel, a fresh one per decoder, so
    that its graphs are its own), greedy, over the prompts: first an untimed decode of every prompt
    through the CompiledModel (what compiling costs: its graphs and seconds), then each prompt
    eager and compiled in turn. decoders: {label: (model, a one-prompt decoder)}. Returns
    {"n_prompts", "rows"}, a row per decoder: tokens_per_s (eager), compiled_tokens_per_s,
    vs_eager, identical (the share of prompts whose tokens equal the eager decode's), graphs,
    compile_s."""
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


def compiled_table(compiled, task):
    """compiled_vs_eager's result as markdown."""
    rows = compiled["rows"]
    lines = [f"Compiled decoding (--compile; {task}, {compiled['n_prompts']} prompts, one at a "
             "time):", "",
             "| decoder | eager tokens/s | compiled tokens/s | vs eager | identical to eager | "
             "graphs | compile (s) |", "| --- " * 7 + "|"]
    lines += [f"| {r['decoder']} | {r['tokens_per_s']:.0f} | {r['compiled_tokens_per_s']:.0f} | "
              f"{r['vs_eager']:.2f}x | {r['identical']:.0%} | {r['graphs']} | "
              f"{r['compile_s']:.0f} |" for r in rows]
    return "\n".join(lines)


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


def throughput_table(rows, task, n_prompts):
    """batch_throughput's rows as markdown, then a line per decoder after the first saying at which
    batch size the first (the ARM) is as fast as it, if it is within the sizes measured."""
    first = rows[0]["decoder"]
    lines = [f"Batched decoding ({task}, {n_prompts} prompts; tokens/s over all of them):", "",
             f"| decoder | batch | tokens/s | vs batch 1 | vs {first} | latency per prompt (ms) | "
             "identical to batch 1 |", "| --- " * 7 + "|"]
    lines += [f"| {r['decoder']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
              f"{r['vs_batch_1']:.2f}x | {r['vs_first']:.2f}x | {r['latency_ms']:.0f} | "
              f"{r['identical']:.0%} |" for r in rows]
    lines.append("")
    for label in dict.fromkeys(r["decoder"] for r in rows if r["decoder"] != first):
        own = [r for r in rows if r["decoder"] == label]
        caught = next((r["batch_size"] for r in own if r["vs_first"] <= 1), None)
        lines.append(f"{first} is at least as fast as {label} from batch {caught} on."
                     if caught else f"{label} is faster than {first} at every batch size "
                     f"measured, up to {own[-1]['batch_size']}.")
    return "\n".join(lines)


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


def write_report(out_dir, report, table):
    """Write a run into out_dir, each file atomically: bench.json (report: a dict whose "rows" are
    the points), bench.md (table: its markdown) and, with matplotlib, bench.png (plot); print the
    table and what was written."""
    write_atomic(os.path.join(out_dir, "bench.json"),
                 lambda f: f.write(json.dumps(report, indent=2).encode()))
    write_atomic(os.path.join(out_dir, "bench.md"), lambda f: f.write((table + "\n").encode()))
    print("\n" + table)
    if plot(report["rows"], os.path.join(out_dir, "bench.png")):
        print(f"wrote {out_dir}/bench.png")
    print(f"wrote {out_dir}/bench.json and {out_dir}/bench.md")
