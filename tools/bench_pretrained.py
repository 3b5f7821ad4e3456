"""
The paper's recipe on a real model, on a laptop: SmolLM2-135M-Instruct fine-tuned into ReFusion
against the same model fine-tuned by next-token prediction (and by the MDM objective where a task
has its config file), on tasks whose answers code checks (docs/pretrained.md).

    python -m tools.convert_gguf smollm2       # once: the model (docs/pretrained.md)
    python -m tools.bench_pretrained           # both tasks; fine-tunes found in out_dir are reused

For each task (TASKS) it fine-tunes, or reuses from out_dir, a model per config file
(config/finetune_smollm2_<task>.py, _ar.py, _mdm.py), then decodes the same validation prompts at
every point (smollm2_points), each prompt by every point in turn, and on throughput_task also in
batches. It writes out_dir/bench.json (the rows of tools.bench's, the model named), bench.md and
bench.png.
"""

import os
import sys
import time

import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train
from configurator import INFILL_MODES, explicit_keys, parse_args, require, run_cli, settings_in
from sampler import RefusionSettings
from support.benchmark import (Point, batch_throughput, check_batch_settings, compiled_vs_eager,
                               confidence_points, exact_points, free_tokens, model_pass_costs,
                               point_config, refusion_sweep, train_or_reuse)
from support.checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint
from support.corpora import score
from support.hardware import machine, settle_dtype
from support.hf_folder import hf_model_config
from support.hf_reference import hf_model
from support.prepare import TokenDataset, prepare
from support.report import (MODE_NAMES, best_mdm, compiled_table, decoding_mode, fastest_close,
                            first_quality, headline, highlights_table, most_accurate,
                            throughput_table, write_report)
from support.runs import check_writable, live_progress
from sampler import make_decoder
from support.tokenizer import decode, get_tokenizer

# -----------------------------------------------------------------------------
# default config
init_from = "smollm2"      # the pretrained folder (python -m tools.convert_gguf smollm2 writes it)
out_dir = "bench-smollm2"  # the fine-tuned models, bench.json, bench.md and bench.png
tasks = ("quotes", "arith")  # any of TASKS
num_prompts = 100          # validation prompts decoded by every point (fewer when fewer fit)
dtype = "auto"             # the decodes' weights but the float32 point's: auto, bf16 where native
data_root = "data"         # where the prepared data sets live
device = "cpu"             # cpu, cuda or mps: the fine-tunes and the decodes
retrain = False            # fine-tune again even when out_dir holds the models
quick = False              # a smoke run: QUICK's budget, prompts and sweep (tests: a tiny folder)
throughput_task = "quotes"  # the task whose next-token and ReFusion decoders also run in batches
batch_sizes = (1, 4, 16, 64)  # ... of these sizes (generate_batch), max(...) prompts
compile = False            # also decode them compiled, each beside eager (support/compiled.py)
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# each task's data set and the decoders' generation length (its longest validation response: 45
# SmolLM2 tokens, EOS included); arith-small's operands of 2 and 3 digits let a 30-minute CPU
# fine-tune teach the next-token baseline the task
TASKS = {"quotes": dict(dataset="quotes", max_new_tokens=48),
         "arith": dict(dataset="arith-small", max_new_tokens=48)}
# the ReFusion sweep: every slot size x (slot_threshold, token_threshold) x serial blocks x infill
SWEEP = dict(slot_sizes=(8, 16, 32), thresholds=((0.9, 0.3), (0.7, 0.1)), serial_num_blocks=(1,))
QUICK = dict(out_dir="bench-pretrained-quick", num_prompts=2,
             train=["--max_iters=2", "--eval_interval=1", "--eval_iters=1", "--warmup_iters=1",
                    "--batch_size=2"],
             sweep=dict(slot_sizes=(8,), thresholds=((0.9, 0.3),), serial_num_blocks=(1,)),
             mdm_sweep=dict(tokens_per_step=(4,), block_lengths=(0,), dream_at=(4,)),
             batch_sizes=(1, 2))
NAMES = {"ar": "SmolLM2-ft", "refusion": "ReFusion-SmolLM2", "mdm": "MDM-SmolLM2"}  # fine-tunes
# the MDM's schedules, where a task has its fine-tune (config/finetune_smollm2_<task>_mdm.py):
# tokens committed per step, each over the whole canvas and over semi-autoregressive blocks of 16;
# at dream_at tokens per step over the whole canvas, also by Dream's confidence rules (SPEC 4)
MDM_SWEEP = dict(tokens_per_step=(1, 2, 4, 8), block_lengths=(0, 16), dream_at=(4, 8))

# -----------------------------------------------------------------------------
# the fine-tunes


def config_file(task, kind):
    """The config file of a task's fine-tune: kind "refusion", "ar" (next token) or "mdm"."""
    name = f"finetune_smollm2_{task}{'' if kind == 'refusion' else '_' + kind}.py"
    return os.path.join(ROOT, "config", name)


def kinds(task):
    """The fine-tunes of a task: next token and ReFusion, and the MDM where its config file is."""
    return ("ar", "refusion") + (("mdm",) if os.path.isfile(config_file(task, "mdm")) else ())


def fine_tune(cfg, task, kind):
    """Fine-tune init_from with the task's config file into out_dir/<task>-<kind>, or reuse or
    resume it (support.benchmark.train_or_reuse). Returns (the directory, its minutes)."""
    out = os.path.join(cfg["out_dir"], f"{task}-{kind}")
    flags = [config_file(task, kind), f"--init_from={cfg['init_from']}", f"--out_dir={out}",
             f"--data_root={cfg['data_root']}", f"--device={cfg['device']}"]
    flags += QUICK["train"] if cfg["quick"] else []
    return out, train_or_reuse(train.main, train.DEFAULTS, flags, cfg["retrain"])

# -----------------------------------------------------------------------------
# the points and their decodes


def smollm2_points(cfg, task):
    """[(label, series, method, model, dtype, knobs)] of a task, the baseline first: the next-token
    fine-tune by us (in cfg's dtype and float32) and by Hugging Face's generate; the ReFusion
    fine-tune's next-token decoding and its sweep, each infill mode, and verify="exact" at each
    slot size; the MDM over MDM_SWEEP."""
    dt, sweep = cfg["dtype"], QUICK["sweep"] if cfg["quick"] else SWEEP
    ar, rf = NAMES["ar"], NAMES["refusion"]
    points = [(f"{ar} next token", f"{ar} next token", "next_token", "ar", dt, {}),
              (f"{ar} next token, float32", f"{ar} next token, float32", "next_token", "ar",
               "float32", {}),
              (f"Hugging Face generate ({ar} weights)", "HF generate", "hf", "ar", dt, {}),
              (f"{rf} next token", f"{rf} next token", "next_token", "refusion", dt, {})]
    for label, knobs in [*refusion_sweep(sweep, rf, INFILL_MODES),
                         *exact_points(sweep["slot_sizes"], rf)]:
        series = f"{rf}, {MODE_NAMES[decoding_mode(knobs)]}"
        points.append((label, series, "refusion", "refusion", dt, knobs))
    if "mdm" in kinds(task):
        L = TASKS[task]["max_new_tokens"]
        mdm_sweep = QUICK["mdm_sweep"] if cfg["quick"] else MDM_SWEEP
        for per_step in mdm_sweep["tokens_per_step"]:
            for block in mdm_sweep["block_lengths"]:
                label = f"{NAMES['mdm']} {per_step} token(s)/step, block {block or L}"
                dream = per_step in mdm_sweep["dream_at"] and not block
                points += [(lab, NAMES["mdm"], "mdm", "mdm", dt, knobs) for lab, knobs in
                           confidence_points(label, dict(steps=L // per_step, block_length=block),
                                             dream)]
    return points if dt != "float32" else [p for p in points if not p[0].endswith(", float32")]


def smollm2_prompts(cfg, task, enc_name, block_size):
    """(prompts, references), lists of token-id lists: the first num_prompts validation samples that
    leave room for every point's generation. Raises ValueError when none does."""
    L = TASKS[task]["max_new_tokens"]
    room = max([L] + [RefusionSettings(L, **p[5]).gen_length for p in smollm2_points(cfg, task)
                      if p[2] == "refusion"])
    data_dir = prepare(TASKS[task]["dataset"], enc_name, block_size, cfg["data_root"])
    val = TokenDataset(data_dir, "val")
    fits = val.first_fitting(cfg["num_prompts"], room, block_size)
    if not fits:
        raise ValueError(f"no {task} validation prompt leaves room for {room} new tokens in the "
                         f"context of {block_size}")
    return [p for p, _ in fits], [q for _, q in fits]


TRAIN_OPTIONS = ("slot_sizes", "slot_end_labels", "ar_fraction", "mdm_shift", "gen_length",
                 "learning_rate", "batch_size", "dtype")


def train_options(config):
    """TRAIN_OPTIONS from a checkpoint's config, train.py's default for one it lacks."""
    return {k: config.get(k, train.DEFAULTS[k]) for k in TRAIN_OPTIONS}


def bench_smollm2_task(cfg, task):
    """Fine-tune or reuse a task's models and decode its prompts at every point, interleaved.
    Returns (rows, {"train", "decode"} minutes, smollm2_batched_points' result or None)."""
    t0 = time.perf_counter()
    tuned = {kind: fine_tune(cfg, task, kind) for kind in kinds(task)}
    t1 = time.perf_counter()
    ckpts = {kind: load_checkpoint(d, cfg["device"]) for kind, (d, _) in tuned.items()}
    meta = ckpts["ar"]["meta"]
    ids, enc = decoder_ids(meta), get_tokenizer(meta["tokenizer"])
    block_size = ckpts["ar"]["model_args"]["block_size"]
    prompts, references = smollm2_prompts(cfg, task, meta["tokenizer"], block_size)
    models, points = {}, [(*p[:5], dict(p[5], mdm_shift=ckpts[p[3]]["config"]["mdm_shift"])
                               if p[2] == "mdm" else p[5]) for p in smollm2_points(cfg, task)]
    for _, _, method, kind, dt, _ in points:
        key = (method == "hf", kind, dt)
        if key not in models:
            model = model_from_checkpoint(ckpts[kind], cfg["device"]).to(getattr(torch, dt))
            models[key] = hf_model(model) if method == "hf" else model
    L = TASKS[task]["max_new_tokens"]
    decoders = [Point(models[method == "hf", kind, dt], ids, L, None if method == "hf" else
                      make_decoder(point_config(method, knobs, max_new_tokens=L), ids,
                                   torch.Generator(cfg["device"]))[0])
                for _, _, method, kind, dt, knobs in points]
    for d in decoders:
        d.warm_up(prompts[0][:8])
    live = live_progress()
    for i, prompt in enumerate(tqdm(prompts, desc=f"decode {task}", disable=not live)):
        for k in range(len(decoders)):                  # every point, the order rotating
            decoders[(i + k) % len(decoders)](prompt, i)
        if not live and i % 10 == 0:
            print(f"decode {task}: prompt {i + 1} of {len(prompts)}", flush=True)
    queries, refs = [decode(enc, p) for p in prompts], [decode(enc, q[:-1]) for q in references]
    rows, first = [], decoders[0].outs
    for (label, series, method, kind, dt, knobs), d in zip(points, decoders):
        texts = [decode(enc, [t for t in o if t not in ids["eos_ids"]]) for o in d.outs]
        scores = [score(TASKS[task]["dataset"], q, t, ref)
                  for q, t, ref in zip(queries, texts, refs)]
        c = ckpts[kind]["config"]
        rows.append({"task": f"smollm2 {task}", "dataset": TASKS[task]["dataset"],
                     "base": os.path.basename(os.path.normpath(cfg["init_from"])),
                     "label": label, "series": series, "method": method,
                     "model": f"smollm2-{kind}", "settings": dict(knobs, dtype=dt),
                     "train_iters": c["max_iters"], "train_minutes": tuned[kind][1],
                     "train_options": train_options(c),
                     "val_loss": ckpts[kind]["best_val_loss"],
                     "quality": {m: sum(s[m] for s in scores) / len(scores) for m in scores[0]},
                     "same_tokens_as_first": sum(a == b for a, b in zip(d.outs, first)),
                     "peak_mb": d.peak_mb,
                     **d.figures()})
    mdm = best_mdm(rows)
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["speedup_vs_mdm"] = mdm and r["tokens_per_s"] / mdm["tokens_per_s"]
    batched = None
    if task == cfg["throughput_task"]:
        batched = smollm2_batched_points(cfg, rows, points, models, ids, prompts,
                                         TASKS[task]["max_new_tokens"])
    return rows, {"train": (t1 - t0) / 60, "decode": (time.perf_counter() - t1) / 60}, batched


def smollm2_batched_points(cfg, rows, points, models, ids, prompts, max_new_tokens):
    """The throughput table (support.benchmark.batch_throughput) of the next-token fine-tune,
    ReFusion's headline point and the best MDM point (if any), in cfg's dtype, at each batch size;
    with compile, compiled beside eager."""
    refusion = [r for r in rows if r["method"] == "refusion"]
    picks = [rows[0], fastest_close(refusion, first_quality(rows[0])) or most_accurate(refusion)]
    picks += [r for r in [best_mdm(rows)] if r is not None]
    decoders = {}
    for row in picks:
        label, _, method, kind, dt, _ = next(p for p in points if p[0] == row["label"])
        knobs = point_config(method, row["settings"], max_new_tokens=max_new_tokens)
        decoders[label] = models[False, kind, dt], make_decoder(knobs, ids, None)[0]
    sizes = QUICK["batch_sizes"] if cfg["quick"] else cfg["batch_sizes"]
    return dict(batch_throughput(decoders, prompts, sizes),
                compiled=compiled_vs_eager(decoders, prompts) if cfg["compile"] else None)


def check_bench_pretrained_config(cfg):
    """Check the settings before any work. Raises ValueError with the fix."""
    check_batch_settings(cfg)
    for task in cfg["tasks"]:
        if task not in TASKS:
            raise ValueError(f"--tasks={task}: this benchmark knows {', '.join(TASKS)}")
        for kind in ("refusion", "ar"):  # the MDM's is optional (kinds)
            if not os.path.isfile(config_file(task, kind)):
                raise ValueError(f"{config_file(task, kind)} is missing: the task's fine-tune")
    if not os.path.isfile(os.path.join(cfg["init_from"], "config.json")):
        raise ValueError(f"--init_from={cfg['init_from']}: no Hugging Face folder there; convert "
                         "SmolLM2 first with python -m tools.convert_gguf smollm2")
    settle_dtype(cfg, hf_model_config(cfg["init_from"]))  # auto: bf16 where native
    require(cfg, ("num_prompts",), "positive", lambda v: v > 0)


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    if cfg["quick"]:
        cfg["num_prompts"] = min(cfg["num_prompts"], QUICK["num_prompts"])
        if "out_dir" not in explicit_keys(cfg, DEFAULTS, argv):
            cfg["out_dir"] = QUICK["out_dir"]
    check_bench_pretrained_config(cfg)
    check_writable(cfg["out_dir"])
    t0 = time.perf_counter()
    results = {task: bench_smollm2_task(cfg, task) for task in cfg["tasks"]}
    rows = [row for task_rows, _, _ in results.values() for row in task_rows]
    batched = {task: b for task, (_, _, b) in results.items() if b is not None}
    base = model_from_checkpoint(load_checkpoint(os.path.join(cfg["out_dir"],
                                                              f"{cfg['tasks'][0]}-ar")))
    costs = model_pass_costs(base, cfg["dtype"], repeats=5)   # as tools.probe
    minutes = (time.perf_counter() - t0) / 60
    host = machine()
    table = headline(rows) + "\n\n" + highlights_table([dict(r, why=r["series"]) for r in rows])
    table += "\n\n" + "\n".join(
        f"smollm2 {task}: fine-tunes {', '.join(f'{r} {m:.1f}' for r, m in fine.items())} minutes; "
        f"decoding {spent['decode']:.1f} minutes"
        for task, (task_rows, spent, _) in results.items()
        for fine in [{NAMES[r["model"].split("-")[1]]: r["train_minutes"]
                      for r in task_rows if r["method"] != "hf"}])
    for task, b in batched.items():
        table += "\n\n" + throughput_table(b["rows"], f"smollm2 {task}, {cfg['dtype']}",
                                           b["n_prompts"])
        if b["compiled"]:
            table += "\n\n" + compiled_table(b["compiled"], f"smollm2 {task}, {cfg['dtype']}")
    table += ("\n\nOne cached forward pass of k tokens after 32 cached ones, "
              f"{cfg['dtype']} (ms): " + ", ".join(f"{k}: {ms:.1f}" for k, ms in costs.items())
              + f"; free tokens (<= 1.25x one): {free_tokens(costs)}")
    table += (f"\n\nWhole run: {minutes:.1f} minutes on {host['processor']} "
              f"({host['cpu_capability']}, {host['cpu_threads']} threads)")
    report = {"config": cfg, "machine": host, "minutes": minutes, "forward_ms": costs,
              "task_minutes": {task: spent for task, (_, spent, _) in results.items()},
              "rows": rows, "batched": batched}
    write_report(cfg["out_dir"], report, table)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
