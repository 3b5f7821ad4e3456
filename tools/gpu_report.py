"""
The acceptance check on one GPU: from a bare checkout, within about 8 minutes on one H100-class GPU,
it measures and writes docs/bench_gpu.md and docs/bench_gpu.json, a section each (SECTIONS): the
machine; the quick start trained on the device, and an MDM on the same data and budget; ReFusion,
next-token and MDM decoding of its validation lines at batch 1 and 64, eager and compiled (the
cached decoders compiled at batch 1 only: COMPILED_NOTE), the ms of a pass split into model and
decoder; decoding under each of SDPA's attention backends; the 85M recipe's steady step and MFU; and
what one cached forward pass costs (tools.probe's figures).

    python -m tools.gpu_report                 # on the GPU, into docs/
    python -m tools.gpu_report --device=cpu --quick=True --out=/tmp/gpu_report_try   # plumbing

Each section runs guarded: an error is recorded in the report and the next section still runs;
Ctrl-C stops the run, the report noting the section it stopped in. Once budget_s seconds are spent,
what has not started is skipped, with a note. Both files are rewritten after every section.
"""

import dataclasses
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from unittest.mock import patch

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import sampler
import train
from configurator import check_device, explicit_keys, parse_args, require, run_cli, settings_in
from model import ModelConfig, Transformer
from support import sampling
from support.benchmark import (Timed, TimedModel, decode_lines, free_tokens, pass_costs,
                               train_or_reuse)
from support.checkpoint import load_checkpoint, model_from_checkpoint
from support.compiled import CompiledModel, check_compile
from support.hardware import machine, num_params
from support.prepare import prepare
from support.report import markdown_table, write_json_and_md

# -----------------------------------------------------------------------------
# default config
out = "docs"               # the directory of bench_gpu.md and bench_gpu.json
work_dir = "out-gpu-report"  # the checkpoints of the models it trains
data_root = "data"         # the prepared data (train.py's --data_root)
device = "cuda"            # cuda, cuda:N, or cpu (with --quick: a check of the plumbing)
quick = False              # every section shrunk (QUICK): fewer lines, iterations, widths
budget_s = 480.0           # once this many seconds are spent, what is not started is skipped
sections = ("machine", "quick_start", "decoding", "attention", "recipe_85m", "pass_costs")
num_lines = 50             # the quick start's validation lines decoded by every decoder
batch_sizes = (1, 64)      # decoded at these batch sizes (support.batching.generate_batch)
compile = True             # also compiled (support.compiled); --quick on a CPU: off unless given
dtype = "auto"             # decoding's weights, as sampler.py's --dtype (auto: bf16 on a GPU)
train_iters = 0            # the quick start's and its MDM's iterations; 0: train_quotes.py's
recipe_iters = 30          # iterations of the 85M recipe
steady_iters = 10          # its last iterations, whose median step is the steady one
peak_tflops = 989.0        # the GPU's dense bf16 peak, for the MFU (H100 and H200 SXM: 989)
repeats = 12               # pass_costs: timed rounds, the median kept
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
SECTION_TITLES = {"machine": "Machine", "quick_start": "The quick start, trained on the device",
                  "decoding": "Decoding the quick start's validation lines",
                  "attention": "Which attention kernel decoding takes, and how often it reads",
                  "recipe_85m": "The 85M recipe (config/train_arith_gpu.py)",
                  "pass_costs": "What one forward pass costs (tools.probe's figures), bf16"}
# --quick: the settings it shrinks, and the flags that shrink each training run
QUICK = dict(num_lines=8, batch_sizes=(1, 4), train_iters=20, recipe_iters=6, steady_iters=3,
             repeats=2)
QUICK_TRAIN = ["--n_layer=2", "--n_embd=64", "--batch_size=8", "--eval_iters=2"]
QUICK_RECIPE = ["--dataset=arith", "--n_layer=2", "--n_head=2", "--n_embd=64", "--batch_size=8"]
# SmolLM2-135M's shape, from its config.json (support/hf_folder.py reads it so): random weights
# here, as its GGUF file (support/gguf_file.py) is not carried to the GPU
SMOLLM2_SHAPE = dict(vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3,
                     n_embd=576, head_dim=64, intermediate_size=1536, tie_embeddings=True,
                     qk_norm=False, rope_theta=100000.0, norm_eps=1e-5)
SMOLLM2 = "SmolLM2-135M's shape, random weights"
PROMPT_LEN = 64            # pass_costs: tokens cached before each timed pass, as tools.probe's
FED = (1, 2, 4, 8, 16, 32, 64, 128)  # pass_costs: tokens fed (--quick: 1, 8, 32)
DECODERS = ("ReFusion", "next-token", "MDM")  # the decoding section's decoders, in its order
CACHED = ("ReFusion", "next-token")          # those with a KV cache: compiled at batch 1 only
COMPILED_NOTE = ("Compiled, ReFusion and next-token decoding run at batch 1 only: "
                 "support.compiled's model refuses a pass with both a KV cache and an attention "
                 "mask, which a batch's padded cached passes need, so their batches are measured "
                 "eager. The MDM's passes read no cache: it is measured compiled at every batch "
                 "size.")
SPLIT_NOTE = ("ms per pass: the timed run's wall time over its forward passes (a batched pass "
              "counted once). Model and decoder: a second run over the same lines, untimed "
              "otherwise, whose model is wrapped in a proxy that waits for the device before and "
              "after each forward call (torch.cuda.synchronize; support.benchmark.TimedModel): the "
              "model's share is those calls' wall time, the decoder's the rest of that run, each "
              "per pass. The timed run has no such waits.")

# -----------------------------------------------------------------------------
# running the sections: guarded, within the budget


class Clock:
    """The run's seconds since it started, against its budget (budget_s)."""

    def __init__(self, budget):
        self.t0, self.budget = time.perf_counter(), budget

    def spent(self):
        return time.perf_counter() - self.t0

    def over(self):
        """The note that the budget is spent, or None while it is not."""
        if self.spent() <= self.budget:
            return None
        return f"skipped: the budget of {self.budget:g} s was spent ({self.spent():.1f} s)"


def guarded(fn):
    """fn() as {"result", "seconds"}, or, when it failed, as {"error", "traceback", "seconds"}. A
    failure is an Exception or an exit that says "error: ..." (train.py's for a diverged loss). A
    stop request is no failure and is raised: Ctrl-C (KeyboardInterrupt), or the exit of a training
    run that Ctrl-C or a stop signal interrupted (it saved its checkpoint)."""
    t0 = time.perf_counter()
    try:
        return {"result": fn(), "seconds": time.perf_counter() - t0}
    except (Exception, SystemExit) as e:
        if isinstance(e, SystemExit) and not str(e.code).startswith("error: "):
            raise
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                "seconds": time.perf_counter() - t0}


def free_device_memory():
    """Drop compiled graphs and the allocator's cache: each section starts on an empty device."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_report(cfg):
    """Run cfg["sections"] in turn, each guarded and skipped once the budget is spent, writing both
    files after each. Returns the report (a dict). A stop request (guarded) is raised once both
    files are written with the section it stopped marked so."""
    clock = Clock(cfg["budget_s"])
    report = {"config": cfg, "notes": cfg.pop("notes"), "sections": {}}
    for name in cfg["sections"]:
        note = clock.over()
        if note:
            report["sections"][name] = {"skipped": note}
        else:
            t0 = clock.spent()
            print(f"\n== {name} ({t0:.0f} s spent)", flush=True)
            try:
                report["sections"][name] = guarded(lambda: SECTIONS[name](cfg, clock))
            except BaseException:  # a stop request, the one thing guarded raises: the run ends
                report["sections"][name] = {"stopped": f"stopped by Ctrl-C or a stop signal after "
                                                       f"{clock.spent() - t0:.1f} s; no section "
                                                       "after it ran"}
                report["seconds"] = clock.spent()
                write_json_and_md(cfg["out"], "bench_gpu", report, report_md(report))
                print(f"stopped in {name}: {cfg['out']}/bench_gpu.md and bench_gpu.json hold the "
                      "sections before it", file=sys.stderr)
                raise
            free_device_memory()
        report["seconds"] = clock.spent()
        write_json_and_md(cfg["out"], "bench_gpu", report, report_md(report))
    return report

# -----------------------------------------------------------------------------
# the sections: each fn(cfg, clock) -> a dict of JSON figures


def machine_section(cfg, clock):
    """support.hardware.machine() with, on a GPU, its name, memory, compute capability, driver."""
    info = dict(machine(), device=cfg["device"], cuda=torch.version.cuda)
    if cfg["device"].startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(cfg["device"]))
        info.update(gpu=props.name, gpu_memory_gb=props.total_memory / 1e9,
                    compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, driver=nvidia_driver(),
                    gpus_visible=torch.cuda.device_count())
    return info


def nvidia_driver():
    """The NVIDIA driver's version as nvidia-smi says it, or None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def quick_start_section(cfg, clock):
    """Prepare the quotes corpus, then train the quick start (config/train_quotes.py) and its MDM
    anew on the device: each run's wall time, iterations, parameters and best validation loss."""
    flags = quick_start_flags(cfg)
    settings = parse_args(train.DEFAULTS, flags)
    t0 = time.perf_counter()
    prepare(settings["dataset"], settings["tokenizer"], settings["block_size"], cfg["data_root"])
    result = {"prepare_s": time.perf_counter() - t0, "command": train_command(flags)}
    gen_length = sample_settings(cfg)["max_new_tokens"]
    runs = {"refusion": flags, "mdm": mdm_flags(cfg, gen_length)}
    for name, run_flags in runs.items():
        minutes = train_or_reuse(train.main, train.DEFAULTS, run_flags, retrain=True)
        ckpt = load_checkpoint(parse_args(train.DEFAULTS, run_flags)["out_dir"],
                               settings_only=True)
        result[name] = {"wall_s": 60 * minutes, "iters": ckpt["iter_num"],
                        "best_val_loss": ckpt["best_val_loss"],
                        "params_m": num_params(ModelConfig(**ckpt["model_args"])) / 1e6}
    return result


def train_command(flags):
    """The command that runs train.py with flags, a config file named from the repository."""
    return "python train.py " + " ".join(os.path.relpath(f, ROOT) if f.endswith(".py") else f
                                         for f in flags)


def quick_start_flags(cfg):
    """train.py's flags for the quick start into work_dir/quotes (--quick: shrunk)."""
    flags = [os.path.join(ROOT, "config", "train_quotes.py"), f"--device={cfg['device']}",
             f"--out_dir={os.path.join(cfg['work_dir'], 'quotes')}",
             f"--data_root={cfg['data_root']}"]
    if cfg["train_iters"]:
        flags += [f"--max_iters={cfg['train_iters']}",
                  f"--eval_interval={max(cfg['train_iters'] // 2, 1)}"]
    return flags + (QUICK_TRAIN if cfg["quick"] else [])


def mdm_flags(cfg, gen_length):
    """quick_start_flags for its MDM: bidirectional, on canvases of gen_length (SPEC section 3)."""
    return quick_start_flags(cfg) + [f"--out_dir={os.path.join(cfg['work_dir'], 'quotes-mdm')}",
                                     "--objective=mdm", f"--gen_length={gen_length}",
                                     "--slot_end_labels=False", "--ar_fraction=0.0"]


def sample_settings(cfg):
    """sampler.py's settings of the quick start (config/sample_quotes.py) on the device."""
    return parse_args(sampler.DEFAULTS, [os.path.join(ROOT, "config", "sample_quotes.py"),
                                        f"--device={cfg['device']}", f"--dtype={cfg['dtype']}",
                                        f"--num_samples={cfg['num_lines']}"])


def decoding_section(cfg, clock):
    """ReFusion and next-token decoding of the quick start's model, and its MDM's, over the first
    num_lines validation lines at each batch size, eager then compiled (ReFusion and next-token at
    batch 1 only: COMPILED_NOTE) (decode_run). Returns {"lines", "dtype", "runs", "split", ...}."""
    sample, model, ids, prompts, judge = quick_start_model(cfg)
    mdm = dict(sample, method="mdm", out_dir=os.path.join(cfg["work_dir"], "quotes-mdm"))
    mdm_model, _, mdm_ids, _, mdm_ckpt = sampling.load_model(mdm)
    sampling.fit_mdm_layout(mdm, mdm_ckpt, explicit=False)   # its canvas and shift
    decoders = {"ReFusion": (model, sampler.make_decoder(dict(sample, method="refusion"), ids,
                                                        None)[0]),
                "next-token": (model, sampler.make_decoder(dict(sample, method="next_token"), ids,
                                                          None)[0]),
                "MDM": (mdm_model, sampler.make_decoder(mdm, mdm_ids, None)[0])}
    compiled = {}                                      # model -> its CompiledModel, shared
    runs, alone = [], {}                               # alone: eager batch-1 tokens per decoder
    for mode, label, B in decoding_runs(cfg):
        net, decode = decoders[label]
        row = {"decoder": label, "batch_size": B, "mode": mode}
        note = clock.over()
        if note:
            runs.append(dict(row, skipped=note))
            continue
        if mode == "compiled" and id(net) not in compiled:
            compiled[id(net)] = CompiledModel(net)
        used = compiled[id(net)] if mode == "compiled" else net
        outcome = guarded(lambda: decode_run(used, decode, prompts, B, judge,
                                             warm=mode == "compiled"))
        if "error" in outcome:
            runs.append(dict(row, error=outcome["error"]))
            continue
        # the share of lines whose tokens are those of the eager decode at batch 1
        outs, figures = outcome["result"]
        alone.setdefault(label, [o.tokens for o in outs])
        figures["identical"] = sum(o.tokens == a for o, a in zip(outs, alone[label])) / len(outs)
        runs.append(dict(row, **figures))
        print(f"{label}, batch {B}, {mode}: {figures['right']} of {len(outs)} right, "
              f"TPF {figures['tpf']:.2f}, {figures['tokens_per_s']:.0f} tokens/s", flush=True)
    return {"lines": len(prompts), "dtype": sample["dtype"], "max_new_tokens":
            sample["max_new_tokens"], "mdm_max_new_tokens": mdm["max_new_tokens"],
            "refusion_settings": {k: sample[k] for k in ("slot_size", "serial_num_blocks",
                                                         "slot_threshold", "token_threshold",
                                                         "infill")},
            "runs": runs, "split": SPLIT_NOTE}


def decoding_runs(cfg):
    """(mode, decoder, batch size) of each run of the decoding section, in order: every eager run
    before the compiled ones, so that the budget cuts the compiled ones first; a decoder with a KV
    cache compiled at batch 1 only (COMPILED_NOTE)."""
    modes = ("eager", "compiled") if cfg["compile"] else ("eager",)
    return [(mode, label, B) for mode in modes for label in DECODERS for B in cfg["batch_sizes"]
            if mode == "eager" or B == 1 or label not in CACHED]


def quick_start_model(cfg):
    """(the sampler's settings, model, ids, prompts, judge) of the quick start's model as sampler.py
    loads them; judge(prompt, Generation) -> (text, verdict)."""
    sample = sample_settings(cfg)
    sample["out_dir"] = os.path.join(cfg["work_dir"], "quotes")
    model, enc, ids, _, ckpt = sampling.load_model(sample)
    room = sampler.decoder_settings(dict(sample, method="refusion")).gen_length
    prompts = sampling.load_prompts(sample, enc, ckpt, room, model.config.block_size)
    return sample, model, ids, prompts, sampling.Report(sample, enc, ids, ckpt).judge


def attention_section(cfg, clock):
    """Decoding under each of SDPA's attention backends (next-token and ReFusion, eager, batch 1; an
    error recorded in its row), then next-token decoding reading its tokens every token
    (eos_every=1) beside the device's default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sample, model, ids, prompts, judge = quick_start_model(cfg)
    runs = []
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    for method in ("next_token", "refusion"):
        decode = sampler.make_decoder(dict(sample, method=method), ids, None)[0]
        for name, backend in backends.items():
            row = {"decoder": method, "backend": name}
            note = clock.over()
            if note:
                runs.append(dict(row, skipped=note))
                continue
            with sdpa_kernel(backend):
                outcome = guarded(lambda: decode_run(model, decode, prompts, 1, judge, False))
            runs.append(dict(row, **({"error": outcome["error"]} if "error" in outcome
                                     else outcome["result"][1])))
    # next-token decoding reading every token, beside the device's default (the runs above)
    decode, settings = sampler.make_decoder(dict(sample, method="next_token"), ids, None)
    decode = partial(decode, settings=dataclasses.replace(settings, eos_every=1))
    outcome = guarded(lambda: decode_run(model, decode, prompts, 1, judge, False))
    runs.append(dict({"decoder": "next_token, a read every token", "backend": "default"},
                     **({"error": outcome["error"]} if "error" in outcome
                        else outcome["result"][1])))
    return {"lines": len(prompts), "runs": runs}


def decode_run(model, decode, prompts, batch_size, judge, warm):
    """One decoder over the prompts at one batch size: an untimed run (warm: every prompt,
    compiling; else one), the timed run, then a run split into model and decoder (SPLIT_NOTE).
    Returns (the timed run's Generations, its figures)."""
    graphs = model.graphs if warm else 0            # the process's count so far
    run = Timed(decode_lines, next(model.parameters()).device)
    # untimed: the first passes' one-time costs (with warm, compiling every graph the lines need)
    run(model, decode, prompts if warm else prompts[:1], batch_size)
    # the timed run
    outs, passes = run(model, decode, prompts, batch_size)
    # the timing run: the model's forward calls timed apart, waiting for the device around each
    timed = TimedModel(model)
    run(timed, decode, prompts, batch_size)
    warm_s, seconds, split_s = run.seconds
    model_s = sum(timed.seconds)
    calls = len(timed.seconds)
    # the timed run's figures, its quality by the sampler's verdicts
    tokens = sum(len(o.tokens) for o in outs)
    nfe = sum(o.nfe for o in outs)
    verdicts = [judge(p, o)[1] for p, o in zip(prompts, outs)]   # (metric, 1.0 or 0.0) or None
    right = sum(v is not None and v[1] == 1.0 for v in verdicts)
    figures = {"right": right, "lines": len(outs), "tokens": tokens, "nfe": nfe,
               "tpf": tokens / nfe, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "passes": passes, "ms_per_pass": 1e3 * seconds / passes,
               "model_ms_per_pass": 1e3 * model_s / calls,
               "decoder_ms_per_pass": 1e3 * (split_s - model_s) / calls}
    if warm:  # the first run compiled the graphs: their count and its seconds
        figures.update(compile_s=warm_s, graphs=model.graphs - graphs)
    return outs, figures


def recipe_85m_section(cfg, clock):
    """The 85M recipe (config/train_arith_gpu.py) for recipe_iters iterations: its steady step (the
    median of the last steady_iters), MFU against peak_tflops and tokens/s, the compile apart."""
    out_dir = os.path.join(cfg["work_dir"], "arith-gpu")
    flags = [os.path.join(ROOT, "config", "train_arith_gpu.py"), f"--device={cfg['device']}",
             f"--out_dir={out_dir}", f"--data_root={cfg['data_root']}",
             f"--max_iters={cfg['recipe_iters']}", f"--eval_interval={cfg['recipe_iters']}",
             "--eval_iters=1", f"--peak_tflops={cfg['peak_tflops']}", f"--compile={cfg['compile']}"]
    flags += QUICK_RECIPE if cfg["quick"] else []
    settings = parse_args(train.DEFAULTS, flags)
    # the data first, timed apart (train.py then finds it prepared)
    t0 = time.perf_counter()
    prepare(settings["dataset"], settings["tokenizer"], settings["block_size"], cfg["data_root"])
    prepare_s = time.perf_counter() - t0
    # a run from scratch, each step and each evaluation timed as train.py calls them
    shutil.rmtree(out_dir, ignore_errors=True)
    steps = Timed(train.train_step, cfg["device"], keep=True)      # each (losses, tokens, FLOPs)
    evaluations = Timed(train.estimate_loss, cfg["device"])
    t0 = time.perf_counter()
    with patch.object(train, "train_step", steps):
        with patch.object(train, "estimate_loss", evaluations):
            train.main(flags)
    wall_s = time.perf_counter() - t0
    ckpt = load_checkpoint(out_dir, settings_only=True)
    # the steady state: the medians over the last steps
    steady = list(zip(steps.seconds, steps.results))[-cfg["steady_iters"]:]
    step_s = statistics.median(s for s, _ in steady)
    flops_s = statistics.median(out[2] / s for s, out in steady)
    tokens_s = statistics.median(out[1] / s for s, out in steady)
    return {"dataset": settings["dataset"], "prepare_s": prepare_s, "wall_s": wall_s,
            "params_m": num_params(ModelConfig(**ckpt["model_args"])) / 1e6,
            "batch_size": settings["batch_size"],
            "compile": settings["compile"], "iters": len(steps.seconds),
            "steady_iters": len(steady), "first_step_s": steps.seconds[0],
            "steady_step_ms": 1e3 * step_s, "compile_s": steps.seconds[0] - step_s,
            "evaluation_s": evaluations.seconds,
            "tflops": flops_s / 1e12, "mfu": flops_s / 1e12 / cfg["peak_tflops"],
            "peak_tflops": cfg["peak_tflops"], "tokens_per_s": tokens_s,
            "loss_first": steps.results[0][0][0].item(),
            "loss_last": steps.results[-1][0][0].item(),
            "command": train_command(flags)}


def pass_costs_section(cfg, clock):
    """support.benchmark.pass_costs in bf16, eager and compiled, after PROMPT_LEN cached tokens, of
    the quick start's model and of SmolLM2-135M's shape with random weights (skipped once the budget
    is spent)."""
    fed = (1, 8, 32) if cfg["quick"] else FED

    def costs(model):
        model = model.to(torch.bfloat16).eval()
        variants = {"eager": model}
        if cfg["compile"]:   # the untimed first round compiles the graphs
            variants["compiled"] = CompiledModel(model)
        ks = tuple(k for k in fed if PROMPT_LEN + k <= model.config.block_size)
        ms = pass_costs(variants, PROMPT_LEN, ks, cfg["repeats"])
        return {"params_m": model.num_params() / 1e6, "ms": ms,
                "free_tokens": {name: free_tokens(c) for name, c in ms.items()}}

    def smollm2():
        torch.manual_seed(0)
        with torch.device(cfg["device"]):
            return Transformer(ModelConfig(**SMOLLM2_SHAPE))

    quotes = os.path.join(cfg["work_dir"], "quotes")
    result = {"prompt_len": PROMPT_LEN, "repeats": cfg["repeats"],
              "quick start": guarded(lambda: costs(model_from_checkpoint(
                  load_checkpoint(quotes, cfg["device"]), cfg["device"])))}
    note = clock.over()
    result[SMOLLM2] = {"skipped": note} if note else guarded(lambda: costs(smollm2()))
    return result


SECTIONS = {"machine": machine_section, "quick_start": quick_start_section,
            "decoding": decoding_section, "attention": attention_section,
            "recipe_85m": recipe_85m_section,
            "pass_costs": pass_costs_section}

# -----------------------------------------------------------------------------
# the report: markdown, then both files


def machine_md(r):
    """The machine section as markdown."""
    gpu = r.get("gpu") or "none"
    rows = [["device", r["device"]], ["GPU", gpu], ["GPU memory (GB)", fmt(r.get("gpu_memory_gb"))],
            ["compute capability", r.get("compute_capability", "-")],
            ["NVIDIA driver", r.get("driver") or "- (no nvidia-smi)"],
            ["torch", r["torch"]], ["CUDA (torch's build)", r["cuda"] or "-"],
            ["GPUs visible", r.get("gpus_visible", 0)], ["Python", r["python"]],
            ["CPU", f"{r['processor']} ({r['cpu_kind']}), {r['cpu_threads']} threads"]]
    return markdown_table(["", ""], rows)


def quick_start_md(r):
    """The quick start section as markdown."""
    names = {"refusion": "ReFusion (the quick start)", "mdm": "MDM, same data and budget"}
    header = ["model", "iterations", "parameters (M)", "wall time (s)", "best val loss"]
    rows = [[names[key], r[key]["iters"], f"{r[key]['params_m']:.2f}", f"{r[key]['wall_s']:.1f}",
             f"{r[key]['best_val_loss']:.4f}"] for key in names]
    return (f"`{r['command']}` (the MDM: the same with `--objective=mdm`, its canvas as the "
            f"decoders'); the data prepared first (or found ready) in {r['prepare_s']:.1f} s."
            "\n\n" + markdown_table(header, rows))


def decoding_md(r):
    """The decoding section as markdown: a row per run, then its notes."""
    header = ["decoder", "batch", "mode", "right (exact)", "tokens", "NFE", "TPF", "tokens/s",
              "passes", "ms/pass", "model ms/pass", "decoder ms/pass", "same as eager batch 1",
              "compile (s)"]
    rows = []
    for run in r["runs"]:
        head = [run["decoder"], run["batch_size"], run["mode"]]
        if "right" not in run:
            rows.append(head + [run.get("error") or run["skipped"]] + [""] * 10)
            continue
        rows.append(head + [f"{run['right']} of {run['lines']}", run["tokens"], run["nfe"],
                            f"{run['tpf']:.2f}", f"{run['tokens_per_s']:.0f}", run["passes"],
                            f"{run['ms_per_pass']:.2f}", f"{run['model_ms_per_pass']:.2f}",
                            f"{run['decoder_ms_per_pass']:.2f}", f"{run['identical']:.0%}",
                            fmt(run.get("compile_s"), ".1f") +
                            (f" ({run['graphs']} graphs)" if "graphs" in run else "")])
    knobs = ", ".join(f"{k}={v}" for k, v in r["refusion_settings"].items())
    failed = [run for run in r["runs"] if "error" in run]
    notes = "\n\n" + r["split"]
    if any(run["mode"] == "compiled" for run in r["runs"]):
        notes += "\n\n" + COMPILED_NOTE
    if failed:
        notes += f"\n\n{len(failed)} runs failed, with the error in their row."
    return (f"{r['lines']} validation lines, weights in {r['dtype']}, greedy. ReFusion as "
            f"config/sample_quotes.py decodes ({knobs}, max_new_tokens={r['max_new_tokens']}); "
            "next-token decoding of the same model; the MDM one token per step on its canvas of "
            f"{r['mdm_max_new_tokens']}. Compiled: support.compiled.CompiledModel (CUDA graphs on "
            "a GPU), its first run over the lines untimed (compile).\n\n" +
            markdown_table(header, rows) + notes)


def attention_md(r):
    """The attention section as markdown: a row per decoder and backend."""
    header = ["decoder", "SDPA backend", "right (exact)", "NFE", "tokens/s", "ms/pass",
              "model ms/pass", "decoder ms/pass"]
    rows = []
    for run in r["runs"]:
        head = [run["decoder"], run["backend"]]
        if "right" not in run:
            rows.append(head + [run.get("error") or run["skipped"]] + [""] * 5)
            continue
        rows.append(head + [f"{run['right']} of {run['lines']}", run["nfe"],
                            f"{run['tokens_per_s']:.0f}", f"{run['ms_per_pass']:.2f}",
                            f"{run['model_ms_per_pass']:.2f}", f"{run['decoder_ms_per_pass']:.2f}"])
    return (f"{r['lines']} validation lines, eager, batch 1, each decode under one backend "
            "(torch.nn.attention.sdpa_kernel); the last row reads next-token decoding's tokens "
            "after every token instead of every 16th.\n\n" + markdown_table(header, rows))


def recipe_85m_md(r):
    """The 85M recipe section as markdown."""
    evals = ", ".join(f"{s:.1f}" for s in r["evaluation_s"])
    rows = [["data", f"{r['dataset']}, prepared in {r['prepare_s']:.1f} s"],
            ["model", f"{r['params_m']:.1f}M parameters, batch {r['batch_size']}, "
                      f"compile={r['compile']}"],
            ["iterations", f"{r['iters']} in {r['wall_s']:.1f} s (train.py's whole run)"],
            ["steady step", f"{r['steady_step_ms']:.1f} ms (median of the last "
                            f"{r['steady_iters']})"],
            ["MFU", f"{r['mfu']:.1%} ({r['tflops']:.1f} TFLOP/s of a {r['peak_tflops']:.0f} "
                    "peak)"],
            ["tokens/s", f"{r['tokens_per_s']:.0f}"],
            ["first step", f"{r['first_step_s']:.1f} s" + (
                f": compiling the training graph took ~{r['compile_s']:.1f} s beyond a steady step"
                if r["compile"] else "")],
            ["evaluations (each compiling its graph where the shape is new)", f"{evals} s"],
            ["loss", f"{r['loss_first']:.3f} at the first step, {r['loss_last']:.3f} at the "
                     "last"]]
    return f"`{r['command']}`\n\n" + markdown_table(["", ""], rows)


def pass_costs_md(r):
    """The pass costs section as markdown: a table per model."""
    parts = [f"One cached forward pass of k tokens after {r['prompt_len']} cached ones, bf16 (ms, "
             f"median of {r['repeats']}, interleaved; support.benchmark.pass_costs, as tools.probe "
             "times it). Free tokens: the most a pass takes for at most 1.25x the cost of one."]
    for name in ("quick start", SMOLLM2):
        part = r[name]
        if "result" not in part:
            parts.append(f"**{name}**: " + (part.get("skipped") or f"failed: `{part['error']}`"))
            continue
        ms = part["result"]["ms"]
        ks = list(next(iter(ms.values())))
        rows = [[variant] + [f"{c[k]:.2f}" for k in ks] + [part["result"]["free_tokens"][variant]]
                for variant, c in ms.items()]
        parts.append(f"**{name}** ({part['result']['params_m']:.1f}M parameters):\n\n" +
                     markdown_table(["", *(f"k={k}" for k in ks), "free tokens"], rows))
    return "\n\n".join(parts)


SECTION_MD = {"machine": machine_md, "quick_start": quick_start_md, "decoding": decoding_md,
              "attention": attention_md, "recipe_85m": recipe_85m_md,
              "pass_costs": pass_costs_md}


def fmt(value, spec=".1f"):
    """value formatted by spec, or "-" for None."""
    return "-" if value is None else format(value, spec)


def report_md(report):
    """The whole report as markdown: per section its figures, error or note, and its seconds."""
    cfg = report["config"]
    lines = ["# ReFusion on one GPU", "",
             f"`python -m tools.gpu_report` on {cfg['device']}"
             + (" with --quick (shrunk: a check of the plumbing, not a measurement)"
                if cfg["quick"] else "")
             + f"; the whole run {report['seconds']:.0f} s of a budget of {cfg['budget_s']:.0f} s."]
    lines += [f"Note: {note}" for note in report["notes"]]
    for name, section in report["sections"].items():
        lines += ["", f"## {SECTION_TITLES[name]}", ""]
        note = section.get("skipped") or section.get("stopped")
        if note:
            lines.append(note[0].upper() + note[1:] + ".")
            continue
        if "error" in section:
            lines.append(f"Failed after {section['seconds']:.1f} s: `{section['error']}`")
            continue
        rendered = guarded(lambda: SECTION_MD[name](section["result"]))
        lines.append(rendered.get("result") or f"(not shown: `{rendered.get('error')}`)")
        lines += ["", f"({section['seconds']:.1f} s)"]
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# the command line


def settle_config(cfg, explicit):
    """Check the settings, before any work, and apply --quick (QUICK, for each setting not given).
    Returns the notes the report states. Raises ValueError with the fix."""
    check_device(cfg["device"])
    if not cfg["sections"]:
        raise ValueError(f"--sections=(): name at least one of {', '.join(SECTIONS)}")
    if unknown := [s for s in cfg["sections"] if s not in SECTIONS]:
        raise ValueError(f"--sections: {', '.join(map(repr, unknown))} unknown; choose among "
                         f"{', '.join(SECTIONS)}")
    if len(set(cfg["sections"])) < len(cfg["sections"]):
        raise ValueError(f"--sections={','.join(cfg['sections'])}: name each section once (the "
                         "report holds one entry a section)")
    require(cfg, ("budget_s",), "positive", lambda v: v > 0)
    if not cfg["batch_sizes"] or cfg["batch_sizes"][0] != 1:
        raise ValueError(f"--batch_sizes={','.join(map(str, cfg['batch_sizes']))}: start from 1, "
                         "the one-prompt decode the others are compared with")
    notes = []
    if cfg["quick"]:
        cfg.update({k: v for k, v in QUICK.items() if k not in explicit})
        if not cfg["device"].startswith("cuda") and "compile" not in explicit:
            cfg["compile"] = False
            notes.append("--quick on a CPU skips the compiled variants (slow to compile there); "
                         "--compile=True runs them")
    require(cfg, ("num_lines", "recipe_iters", "steady_iters", "repeats"), "positive",
            lambda v: v > 0)
    if cfg["steady_iters"] >= cfg["recipe_iters"]:
        raise ValueError(f"--steady_iters={cfg['steady_iters']}: keep it below --recipe_iters="
                         f"{cfg['recipe_iters']}, whose first step compiles")
    check_compile(cfg)
    # last, as it creates the folders: the settings above are refused without a trace
    check_writable_folder(cfg["out"], "--out", "the report (bench_gpu.md and bench_gpu.json)")
    check_writable_folder(cfg["work_dir"], "--work_dir", "the checkpoints of the models it trains")
    return notes


def check_writable_folder(path, flag, what):
    """Create the folder path if need be and check that a file can be written in it. Raises
    ValueError naming the flag and what it holds."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"{flag}={path}: cannot write {what} there ({e.strerror or e}); choose a "
                         "folder you can write to") from None


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    cfg["notes"] = settle_config(cfg, explicit_keys(cfg, DEFAULTS, argv))
    report = run_report(cfg)
    print("\n" + report_md(report))
    print(f"wrote {cfg['out']}/bench_gpu.md and {cfg['out']}/bench_gpu.json")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
