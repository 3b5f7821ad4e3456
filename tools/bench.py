"""
The paper's comparison at small scale: ReFusion against an autoregressive model (ARM) and a
LLaDA-style masked diffusion model (MDM) of the same size, data and training budget, on three tasks
from parallel-friendly to strictly serial (TASKS: transform, arith, stdlib; docs/benchmark.md).

    python -m tools.bench              # the full run (TASKS' recipes), 92 minutes on 2 CPU cores
    python -m tools.bench --quick      # one task, tiny models, a small sweep, into bench-quick/

Per task it trains (or reuses, from out_dir) an ARM, a ReFusion model and an MDM, and ReFusion and
an MDM fine-tuned from the ARM, then decodes the same validation prompts at every point
(decoder_points), and on throughput_task also in batches. It writes out_dir/bench.json (every
point), bench.md (the headline, then the highlights) and, with matplotlib, bench.png (quality
against speed relative to the ARM).
"""

import math
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train
from configurator import INFILL_MODES, explicit_keys, parse_args, require, run_cli, settings_in
from model import ModelConfig, Transformer
from sampler import MDMSettings, RefusionSettings
from support.benchmark import (Point, Timed, batch_throughput, check_batch_settings,
                               compiled_vs_eager, confidence_points, exact_points, free_tokens,
                               hf_generate, model_pass_costs, point_config, refusion_sweep)
from support.checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint
from support.corpora import score
from support.hardware import machine, num_params, settle_dtype
from support.prepare import TokenDataset, prepare
from support.report import (NAMES, best_mdm, compiled_table, decoding_mode, fastest_close,
                            first_quality, headline, highlights_table, most_accurate,
                            throughput_table, write_report)
from support.runs import check_writable, live_progress
from sampler import make_decoder
from support.tokenizer import decode, get_tokenizer, vocab_size

# -----------------------------------------------------------------------------
# default config
out_dir = "bench"          # models, bench.json, bench.md and bench.png (--quick: bench-quick)
tasks = ("transform", "arith", "stdlib")  # any of TASKS
quick = False              # a smoke run: QUICK's task, models, budget and sweep
num_prompts = 100          # validation prompts decoded by every decoder (fewer when fewer fit)
max_iters = 0              # training budget of each model; 0: the task's recipe (TASKS)
finetune_iters = 0  # extra budget of the models from the ARM (ReFusion-ft, MDM-ft); 0: the recipe's
finetune_lr = 0.0          # their peak learning rate; 0: the recipe's
dataset = ""  # the data set of a one-task run, e.g. arith-1m on a GPU; empty: the recipe's
block_size = 0             # the models' context; 0: the recipe's
max_new_tokens = 0         # every decoder's generation length; 0: the recipe's
n_layer = 0                # the models' transformer blocks; 0: the recipe's
n_head = 0                 # ... attention heads
n_embd = 0                 # ... width
batch_size = 0             # ... samples per training step
learning_rate = 0.0        # ... peak learning rate (from scratch)
device = "cpu"             # cpu, cuda or mps: training and decoding
dtype = "auto"             # every decode's weights: auto (bf16 where native), float32, bfloat16
compile = False            # torch.compile training; and decode throughput_task's picks compiled too
throughput_task = "transform"  # the task whose ARM, ReFusion and MDM are also decoded in batches
batch_sizes = (1, 4, 16, 64)   # ... of these sizes (generate_batch), max(...) prompts
seed = 1337                # training seed of every model (decodes are greedy)
retrain = False            # train again even when out_dir holds the models
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())

# Each task's recipe, sized so that the ARM reaches its quality on 2 CPU cores (docs/benchmark.md).
# ReFusion-ft's options (SPEC section 3): on the serial tasks they keep the ARM's next-token
# pathway, which infill="speculative" decodes with.
MODEL = dict(n_layer=4, n_head=4, n_embd=128, batch_size=32, learning_rate=3e-3)
KEEP_THE_ARM = dict(finetune_lr=1e-3,
                    refusion_ft_options=dict(slot_end_labels=True, ar_fraction=0.5))
TASKS = {
    # 72 new tokens: the longest answer (a 63-letter mirror, its newline and EOS) fits the
    # MDM's canvas
    "transform": dict(MODEL, dataset="transform", block_size=200, max_new_tokens=72, max_iters=2000,
                      finetune_iters=800, finetune_lr=3e-3, refusion_ft_options={}),
    "arith": dict(MODEL, **KEEP_THE_ARM, dataset="arith-small", block_size=128, max_new_tokens=64,
                  max_iters=1500, finetune_iters=1000),
    "stdlib": dict(MODEL, **KEEP_THE_ARM, dataset="stdlib", block_size=256, max_new_tokens=128,
                   max_iters=400, finetune_iters=400),
}
# the settings that replace a recipe's when given (non-empty, non-zero)
OVERRIDES = ("dataset", "block_size", "max_new_tokens", "max_iters", "finetune_iters", "n_layer",
             "n_head", "n_embd", "batch_size", "learning_rate", "finetune_lr")
# the ReFusion sweep: every slot size x (slot_threshold, token_threshold) x serial blocks
SWEEP = dict(slot_sizes=(4, 8, 16), thresholds=((0.9, 0.3), (0.7, 0.1), (0.5, 0.0)),
             serial_num_blocks=(1, 4))
QUICK_NOTE = ("A --quick run checks the plumbing only: its models train for a few steps, so its "
              "qualities (0% among them) and speeds say nothing about the method; "
              "python -m tools.bench measures it.")
QUICK = dict(out_dir="bench-quick", tasks=("transform",), num_prompts=8,
             model=dict(n_layer=2, n_head=2, n_embd=64, max_iters=60, finetune_iters=30),
             sweep=dict(slot_sizes=(8,), thresholds=((0.9, 0.3), (0.5, 0.0)),
                        serial_num_blocks=(1,)), step_times=3, batch_sizes=(1, 2, 4, 8))


def recipe(cfg, task):
    """TASKS[task] with the run's overrides: --quick's, then every setting given non-zero."""
    r = dict(TASKS[task], **(QUICK["model"] if cfg["quick"] else {}))
    return r | {key: cfg[key] for key in OVERRIDES if cfg[key]}


def train_model(cfg, task, name, objective, init_from=None):
    """Train `task`'s model `name` (objective `objective`) into out_dir/<task>-<name>; return the
    directory. From scratch, or from the checkpoint init_from with the fine-tune budget; an MDM on
    the canvas it decodes. One finished with the same settings (after init_from) is reused, one cut
    short is resumed."""
    r = recipe(cfg, task)
    out = os.path.join(cfg["out_dir"], f"{task}-{name}")
    ckpt_file = os.path.join(out, "ckpt.pt")
    iters, lr = ((r["finetune_iters"], r["finetune_lr"]) if init_from
                 else (r["max_iters"], r["learning_rate"]))
    options = r["refusion_ft_options"] if name == "refusion-ft" else {}
    settings = dict(dataset=r["dataset"], objective=objective, max_iters=iters,
                    eval_interval=max(iters // 4, 1), seed=cfg["seed"], learning_rate=lr,
                    min_lr=lr / 10 if init_from else train.DEFAULTS["min_lr"],
                    gen_length=(r["max_new_tokens"] if objective == "mdm"
                                else train.DEFAULTS["gen_length"]),
                    **{k: r[k]
                       for k in ("block_size", "batch_size", "n_layer", "n_head", "n_embd")},
                    **{k: options.get(k, train.DEFAULTS[k])
                       for k in ("slot_end_labels", "ar_fraction")})
    flags = [f"--out_dir={out}", f"--device={cfg['device']}", f"--compile={cfg['compile']}",
             f"--dtype={training_dtype(cfg['device'])}"]
    if os.path.exists(ckpt_file) and not cfg["retrain"]:
        ckpt = load_checkpoint(ckpt_file)
        same = (all(ckpt["config"].get(k) == v for k, v in settings.items())
                and not (init_from and os.path.getmtime(init_from) > os.path.getmtime(ckpt_file)))
        if same and ckpt["iter_num"] == iters:
            print(f"== reusing {out}: trained for {iters} iterations with the same settings")
            return out
        if same:
            print(f"== resuming {out} at iteration {ckpt['iter_num']} of {iters}")
            train.main(flags + ["--init_from=resume"])
            return out
    shutil.rmtree(out, ignore_errors=True)
    flags += [f"--{k}={v}" for k, v in settings.items()]
    if init_from:
        flags += [f"--init_from={init_from}", f"--warmup_iters={min(50, iters // 10)}"]
    print(f"\n== training {task}-{name}: {' '.join(flags)}")
    train.main(flags)
    return out

def validation_prompts(cfg, task):
    """(prompts, references), lists of token-id lists: the first num_prompts validation samples that
    leave room for every decoder's generation. Raises ValueError when none does."""
    r = recipe(cfg, task)
    L = r["max_new_tokens"]
    room = max([L] + [RefusionSettings(L, **knobs).gen_length
                      for _, method, _, knobs in decoder_points(cfg, task) if method == "refusion"])
    val = TokenDataset(prepare(r["dataset"], "bytes", r["block_size"]), "val")
    fits = val.first_fitting(cfg["num_prompts"], room, r["block_size"])
    if not fits:
        raise ValueError(f"no {task} validation prompt leaves room for {room} new tokens in the "
                         f"context of {r['block_size']}; change the task's recipe "
                         "(TASKS in tools/bench.py)")
    if len(fits) < cfg["num_prompts"]:
        print(f"note: {len(fits)} {task} validation prompts leave room for {room} new tokens in "
              f"the context of {r['block_size']}; decoding those, not {cfg['num_prompts']}")
    return [p for p, _ in fits], [q for _, q in fits]

# -----------------------------------------------------------------------------
# decoding, timed


def run_decoder(method, model, prompts, ids, settings):
    """Decode every prompt with `method`'s decoder (settings: its knobs and max_new_tokens), prompt
    i with its own generator. Returns (id lists without EOS, speed figures): Point.measure."""
    decode_fn, _ = make_decoder(point_config(method, settings), ids, None)
    return Point(model, ids, settings["max_new_tokens"], decode_fn).measure(prompts)


def decoder_points(cfg, task):
    """[(label, method, model name, knobs)] of a task: the ARM; both MDMs at 1, 2 and 4 tokens a
    step (the MDM-ft also by Dream's rules, SPEC 4); both ReFusion models over the sweep, each point
    with each infill mode (SPEC 4.1), and verify="exact" at each slot size (SPEC 4.5)."""
    L = recipe(cfg, task)["max_new_tokens"]
    sweep = QUICK["sweep"] if cfg["quick"] else SWEEP
    points = [("ARM", "next_token", "ar", {})]
    semi_ar = max(b for b in range(1, 33) if L % b == 0)
    for model in ("mdm", "mdm-ft"):
        for per_step in (1, 2, 4):
            block = L if per_step == 1 else semi_ar
            if not (L // per_step and (L // per_step) % (L // block) == 0):
                continue  # no schedule of this length
            label = f"{NAMES[model]} {per_step} token(s)/step, block {block}"
            dream = model == "mdm-ft" and per_step > 1     # also by Dream's confidence rules
            points += [(lab, "mdm", model, knobs) for lab, knobs in confidence_points(
                label, dict(steps=L // per_step, block_length=block), dream)]
    for model in ("refusion", "refusion-ft"):
        points += [(label, "refusion", model, knobs)
                   for label, knobs in [*refusion_sweep(sweep, NAMES[model], INFILL_MODES),
                                        *exact_points(sweep["slot_sizes"], NAMES[model])]]
    return points


def bench_task(cfg, task, prompts, references):
    """Train or reuse a task's five models and decode its prompts at every point. Returns (rows: a
    dict per point, with quality, speed and speed-ups over the ARM and the MDM; {"train", "decode"}
    minutes; batched_points' result on throughput_task, else None)."""
    r = recipe(cfg, task)
    iters, ft = r["max_iters"], r["finetune_iters"]
    t0 = time.perf_counter()
    dirs = {name: train_model(cfg, task, name, name) for name in ("ar", "refusion", "mdm")}
    for name in ("refusion", "mdm"):   # the paper's recipe, and Dream's: start from the ARM
        dirs[f"{name}-ft"] = train_model(cfg, task, f"{name}-ft", name,
                                         init_from=os.path.join(dirs["ar"], "ckpt.pt"))
    t1 = time.perf_counter()
    ckpts = {name: load_checkpoint(d, cfg["device"]) for name, d in dirs.items()}
    models = {name: model_from_checkpoint(c, cfg["device"]).to(getattr(torch, cfg["dtype"]))
              for name, c in ckpts.items()}
    meta = ckpts["ar"]["meta"]
    ids = decoder_ids(meta)
    enc = get_tokenizer(meta["tokenizer"])
    queries, refs = [decode(enc, p) for p in prompts], [decode(enc, q[:-1]) for q in references]

    def point(label, method, name, knobs, texts, speed):
        scores = [score(r["dataset"], q, decode(enc, t), ref)
                  for q, t, ref in zip(queries, texts, refs)]
        quality = {m: float(np.mean([s[m] for s in scores])) for m in scores[0]}
        return {"task": task, "dataset": r["dataset"], "label": label, "method": method,
                "model": name, "settings": knobs,
                "train_iters": iters + (ft if name.endswith("-ft") else 0),
                "train_options": r["refusion_ft_options"] if name == "refusion-ft" else {},
                "val_loss": ckpts[name]["best_val_loss"], "quality": quality, **speed}

    rows, live = [], live_progress()
    for label, method, name, knobs in tqdm(decoder_points(cfg, task), desc=f"decode {task}",
                                           disable=not live):
        texts, speed = run_decoder(method, models[name], prompts, ids,
                                   dict(knobs, max_new_tokens=r["max_new_tokens"]))
        rows.append(point(label, method, name, knobs, texts, speed))
        if not live:  # a log file gets one line per point instead of progress-bar frames
            print(f"decode {task}: {label}: {speed['tokens']} tokens, TPF {speed['tpf']:.2f}, "
                  f"{speed['tokens_per_s']:.0f} tokens/s", flush=True)
    hf = hf_generate(models["ar"], prompts, ids, r["max_new_tokens"])
    if hf is not None:
        rows.insert(1, point("Hugging Face generate (ARM weights)", "hf", "ar", {}, *hf))
    ar_speed = rows[0]["tokens_per_s"]
    mdm_speed = best_mdm(rows)["tokens_per_s"]
    for row in rows:
        row["speedup_vs_ar"], row["speedup_vs_mdm"] = (row["tokens_per_s"] / ar_speed,
                                                       row["tokens_per_s"] / mdm_speed)
    batched = (batched_points(cfg, rows, models, ids, prompts, r["max_new_tokens"])
               if task == cfg["throughput_task"] else None)
    return rows, {"train": (t1 - t0) / 60, "decode": (time.perf_counter() - t1) / 60}, batched


def batched_points(cfg, rows, models, ids, prompts, max_new_tokens):
    """The throughput table (support.benchmark.batch_throughput) of the ARM, ReFusion's headline
    point and the MDM compared with, at each batch size; with compile, compiled beside eager."""
    ar_quality = first_quality(rows[0])
    refusion = [r for r in rows if r["method"] == "refusion"]
    picks = [rows[0], fastest_close(refusion, ar_quality) or most_accurate(refusion),
             best_mdm(rows)]
    decoders = {}
    for row in picks:
        knobs = point_config(row["method"], row["settings"], max_new_tokens=max_new_tokens)
        decoders[row["label"]] = models[row["model"]], make_decoder(knobs, ids, None)[0]
    sizes = QUICK["batch_sizes"] if cfg["quick"] else cfg["batch_sizes"]
    return dict(batch_throughput(decoders, prompts, sizes),
                compiled=compiled_vs_eager(decoders, prompts) if cfg["compile"] else None)


def highlights(rows):
    """The table's rows, row["why"] saying why: the baselines; per ReFusion model and decoding mode
    its fastest point within 1 point of the ARM's quality, its most accurate, its fastest."""
    chosen = []
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        reference = best_mdm(task_rows)
        chosen += [dict(r, why="baseline, the MDM compared with" if r is reference else "baseline")
                   for r in task_rows if r["method"] != "refusion"]
        ar_quality = first_quality(task_rows[0])
        for model, mode in [(m, i) for m in ("refusion", "refusion-ft")
                            for i in (*INFILL_MODES, "exact")]:
            points = [r for r in task_rows
                      if r["model"] == model and decoding_mode(r["settings"]) == mode]
            picks = {"fastest within 1 point of the ARM": fastest_close(points, ar_quality),
                     "most accurate": most_accurate(points),
                     "fastest": max(points, key=lambda r: r["tokens_per_s"])}
            reasons = {}                                    # id of a point -> (point, its reasons)
            for why, row in picks.items():
                if row is not None:
                    reasons.setdefault(id(row), (row, []))[1].append(why)
            chosen += [dict(row, why=", ".join(whys)) for row, whys in reasons.values()]
    return chosen


def training_dtype(device):
    """The dtype the benchmark's models train in: bfloat16 autocast on a GPU, else float32."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def training_step_times(cfg, task, steps=20):
    """Seconds per training step of the ReFusion and AR objectives on the same batches and model,
    interleaved. Returns {"refusion": s, "ar": s, "ratio": refusion / ar}."""
    r, device = recipe(cfg, task), cfg["device"]
    train_data = TokenDataset(prepare(r["dataset"], "bytes", r["block_size"]), "train")
    meta = train_data.meta
    models, optims = {}, {}
    for objective in ("refusion", "ar"):
        torch.manual_seed(cfg["seed"])
        models[objective] = Transformer(ModelConfig(vocab_size=meta["vocab_size"],
                                                    block_size=r["block_size"],
                                                    n_layer=r["n_layer"], n_head=r["n_head"],
                                                    n_embd=r["n_embd"])).to(device)
        optims[objective] = torch.optim.AdamW(models[objective].parameters(), lr=1e-4)
    step_cfg = dict(train.DEFAULTS, slot_sizes=(4, 8))

    def train_step(objective, rng, gen):
        """One step of the objective on the batch that rng and gen draw."""
        tokens, prompt_len, length = train_data.get_batch(r["batch_size"], rng, device)
        batch = train.make_batch(dict(step_cfg, objective=objective), tokens, prompt_len, length,
                                 meta, gen)
        with train.autocast_for(device, training_dtype(device)):
            logits = models[objective](batch.idx, batch.position_ids, attn_mask=batch.attn_mask)
        train.hybrid_loss(logits.float(), batch)[0].backward()
        optims[objective].step()
        optims[objective].zero_grad(set_to_none=True)

    timers = {objective: Timed(train_step, device) for objective in models}
    for i in range(steps + 3):
        for objective in sorted(models, reverse=i % 2 == 1):        # alternate which one goes first
            # same batch for both
            timers[objective](objective, np.random.default_rng(i), torch.Generator().manual_seed(i))
    # the first 3 rounds warmed up
    times = {objective: statistics.mean(t.seconds[3:]) for objective, t in timers.items()}
    return dict(times, ratio=times["refusion"] / times["ar"])


def arm_pass_costs(cfg, task):
    """{k: ms} of one cached forward pass of the task's ARM fed k tokens (model_pass_costs)."""
    model = model_from_checkpoint(load_checkpoint(os.path.join(cfg["out_dir"], f"{task}-ar")),
                                  cfg["device"])
    return model_pass_costs(model, cfg["dtype"], 3 if cfg["quick"] else 12)


def check_bench_config(cfg):
    """Check every setting before any training (the data: validation_prompts). Raises ValueError."""
    for task in cfg["tasks"]:
        if task not in TASKS:
            raise ValueError(f"--tasks={task}: the benchmark knows {', '.join(TASKS)}")
        L = recipe(cfg, task)["max_new_tokens"]
        for _, method, _, knobs in decoder_points(cfg, task):
            if method == "mdm":
                MDMSettings(L, **knobs)
            if method == "refusion":
                RefusionSettings(L, **knobs)
    check_batch_settings(cfg)
    if cfg["dataset"] and len(cfg["tasks"]) > 1:
        raise ValueError(f"--dataset={cfg['dataset']} replaces one task's data: "
                         "name that task alone in --tasks")
    require(cfg, ("num_prompts",), "positive", lambda v: v > 0)
    require(cfg, OVERRIDES[1:-1], "0 or more (0: the task's recipe)", lambda v: v >= 0)
    require(cfg, ("learning_rate",), "0 or more and finite (0: the task's recipe)",
            lambda v: 0 <= v < math.inf)
    # the settings are good: auto takes the rule's dtype for the largest task's models
    shapes = [ModelConfig(vocab_size=vocab_size(get_tokenizer("bytes")),
                          **{k: recipe(cfg, task)[k] for k in ("block_size", "n_layer", "n_head",
                                                               "n_embd")})
              for task in cfg["tasks"]]
    settle_dtype(cfg, max(shapes, key=num_params, default=ModelConfig()))


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    if cfg["quick"]:
        if tuple(cfg["tasks"]) != tuple(tasks):
            raise ValueError(f"--quick runs {', '.join(QUICK['tasks'])} alone: "
                             "drop --tasks, or drop --quick")
        cfg.update(tasks=QUICK["tasks"], num_prompts=min(cfg["num_prompts"], QUICK["num_prompts"]))
        if "out_dir" not in explicit_keys(cfg, DEFAULTS, argv):  # never over a full run's models
            cfg["out_dir"] = QUICK["out_dir"]
    check_bench_config(cfg)
    check_writable(cfg["out_dir"])
    if cfg["quick"]:
        print(QUICK_NOTE, flush=True)
    t0 = time.perf_counter()
    # prepares the data and raises before any training if no prompt fits
    prompts = {task: validation_prompts(cfg, task) for task in cfg["tasks"]}
    os.makedirs(cfg["out_dir"], exist_ok=True)
    results = {task: bench_task(cfg, task, *prompts[task]) for task in cfg["tasks"]}
    rows = [row for task_rows, _, _ in results.values() for row in task_rows]
    task_minutes = {task: minutes for task, (_, minutes, _) in results.items()}
    batched = {task: b for task, (_, _, b) in results.items() if b is not None}
    step_times = {task: training_step_times(cfg, task, QUICK["step_times"] if cfg["quick"] else 20)
                  for task in cfg["tasks"]}
    pass_ms = {task: arm_pass_costs(cfg, task) for task in cfg["tasks"]}
    minutes = (time.perf_counter() - t0) / 60
    table = (QUICK_NOTE + "\n\n" if cfg["quick"] else "") + headline(rows) + "\n\n"
    table += highlights_table(highlights(rows)) + "\n\n" + "\n".join(
        f"Training step ({task}, batch {recipe(cfg, task)['batch_size']}): "
        f"ReFusion {t['refusion'] * 1e3:.0f} ms, AR {t['ar'] * 1e3:.0f} ms, ratio {t['ratio']:.2f}x"
        for task, t in step_times.items())
    for task, b in batched.items():
        table += "\n\n" + throughput_table(b["rows"], task, b["n_prompts"])
        if b["compiled"]:
            table += "\n\n" + compiled_table(b["compiled"], task)
    table += "\n\n" + "\n".join(
        f"One cached forward pass of the {task} ARM, k tokens after 32, {cfg['dtype']} (ms): "
        + ", ".join(f"{k}: {ms:.2f}" for k, ms in costs.items())
        + f"; free tokens (<= 1.25x one): {free_tokens(costs)} (python -m tools.probe)"
        for task, costs in pass_ms.items())
    table += "\n\n" + "\n".join(
        f"{task}: training {m['train']:.1f} minutes (5 models; near 0 when reused), "
        f"decoding {m['decode']:.1f} minutes" for task, m in task_minutes.items())
    host = machine()
    table += (f"\n\nWhole run: {minutes:.1f} minutes on {host['processor']} "
              f"({host['cpu_capability']}, {host['cpu_threads']} threads)")
    report = {"config": cfg, "machine": host, "minutes": minutes, "task_minutes": task_minutes,
              "rows": rows, "training_step_seconds": step_times, "batched": batched,
              "forward_ms": pass_ms}
    write_report(cfg["out_dir"], report, table)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
