"""
The paper's comparison at small scale, in one run: ReFusion against an autoregressive model (ARM)
and a LLaDA-style masked diffusion model (MDM), same size, same data, same training budget.

    python bench.py                                  # CPU default, about 27 minutes on 2 cores
    python bench.py --datasets=arith --max_iters=2000 --device=cuda

For each data set it trains (or reuses, from out_dir) one model per objective plus a ReFusion
model fine-tuned from the ARM (the paper's recipe; its extra budget is stated in its row), decodes
the same validation prompts with every decoder and a small sweep of their speed knobs, and writes
out_dir/bench.json, out_dir/bench.md and, when matplotlib is installed, out_dir/bench.png
(quality against tokens/s, like the paper's Figure 1). Every figure comes from this run.
"""

import ast
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import train
from checkpoint import load_checkpoint, model_from_checkpoint
from configurator import parse_args, require, run_cli, settings_in
from corpora import arithmetic_answer, arithmetic_expected
from data import TokenDataset, decode, get_tokenizer
from generate import MDMSettings, RefusionSettings
from model import ModelConfig, Transformer
from prepare import prepare
from sampler import make_decoder, prompt_generator

# -----------------------------------------------------------------------------
# default config
out_dir = "bench"          # trained models, bench.json, bench.md and bench.png go here
datasets = ("arith", "stdlib")  # built-in data sets to train and decode on
num_prompts = 40           # validation prompts decoded by every decoder
max_new_tokens = 128       # generation length of every decoder, rounded up to whole blocks of slots
slot_size = 8              # slot size S of the ReFusion rows
num_blocks = 4             # serial blocks of the ReFusion rows
max_iters = 600            # training budget of each model (iterations of batch_size samples)
finetune_iters = 600       # extra budget of the ReFusion model started from the ARM
batch_size = 32            # samples per training step
n_layer = 4                # every model's transformer blocks
n_head = 4                 # ... attention heads
n_embd = 128               # ... and width
learning_rate = 3e-3       # peak learning rate of every model
block_size = 0             # 0: 192 for arith, 256 for stdlib
device = "cpu"             # cpu, cuda, cuda:N or mps
compile = False            # torch.compile the training forward pass (GPU runs)
seed = 1337                # training seed of every model (decodes are greedy)
retrain = False            # train again even when out_dir holds the models
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())
BLOCK_SIZE = {"arith": 192, "arith-1m": 192, "stdlib": 256}
ANSWERED = ("arith", "arith-1m")  # data sets whose responses end in an answer that can be checked


def train_model(cfg, dataset, name, objective, iters, init_from=None):
    """Train one model into out_dir/<dataset>-<name> and return the dir. A finished model trained
    with the same settings (and, for a fine-tune, after the checkpoint it starts from) is reused;
    one interrupted part-way is resumed; anything else is trained again from the start."""
    out = os.path.join(cfg["out_dir"], f"{dataset}-{name}")
    ckpt_file = os.path.join(out, "ckpt.pt")
    settings = dict(dataset=dataset, objective=objective, max_iters=iters, eval_interval=max(iters // 4, 1),
                    block_size=cfg["block_size"] or BLOCK_SIZE[dataset],
                    **{k: cfg[k] for k in ("batch_size", "n_layer", "n_head", "n_embd", "learning_rate", "seed")})
    flags = [f"--out_dir={out}", f"--device={cfg['device']}", f"--compile={cfg['compile']}"]
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
    print(f"\n== training {dataset}-{name}: {' '.join(flags)}")
    train.main(flags)
    return out


def quality(dataset, query, text):
    """1.0 if the generation is right: arith, the exact answer; stdlib, the function parses with at
    least one statement after its docstring (the prompt alone already parses)."""
    if dataset in ANSWERED:
        return float(arithmetic_answer(text) == arithmetic_expected(query))
    try:
        function = ast.parse(query + text).body[0]
    except (SyntaxError, ValueError, IndexError):
        return 0.0
    return float(len(function.body) > 1)


def decoder_settings(cfg, n_slots):
    """(row label, method, model name, decoder kwargs) for every row of the table."""
    S = cfg["slot_size"]
    L = n_slots * S
    rows = [("ARM", "ar", "ar", {})]
    for model in ("refusion", "refusion-ft"):
        for blocks, slot_thr, token_thr in ((cfg["num_blocks"], 0.9, 0.3), (cfg["num_blocks"], 0.7, 0.1),
                                            (1, 0.9, 0.3)):
            rows.append((f"ReFusion{'-ft' * (model != 'refusion')} B={blocks} slot>{slot_thr} token>{token_thr}",
                         "refusion", model, dict(slot_size=S, num_blocks=blocks, slot_threshold=slot_thr,
                                                 token_threshold=token_thr)))
        rows.append((f"ReFusion{'-ft' * (model != 'refusion')} left-to-right (one slot per block)", "refusion",
                     model, dict(slot_size=S, num_blocks=n_slots, slot_threshold=0.9, token_threshold=0.3)))
    block = 32 if L % 32 == 0 else L      # LLaDA's semi-autoregressive blocks of 32 where they fit
    for steps, block in ((L, L), (L // 2, block), (L // 4, block)):
        rows.append((f"MDM steps={steps} block={block}", "mdm", "mdm", dict(steps=steps, block_length=block)))
    return rows


def run_decoder(method, model, prompts, meta, max_new_tokens, settings):
    """Decode every prompt with sampler's decoder for `method`, prompt i with its own generator seeded
    with i (prompt_generator; used when settings ask for a temperature above 0), so no decode depends
    on the warm-up or on the others. Returns the texts and summed statistics."""
    cfg = {"temperature": 0.0, "steps": 0, "block_length": 0, **settings, "method": method,
           "max_new_tokens": max_new_tokens}
    device = next(model.parameters()).device
    decode_fn, _ = make_decoder(cfg, model, meta, torch.Generator(device))  # the warm-up's generator
    decode_fn(prompts[0])  # warm-up, untimed
    outs = [decode_fn(p, generator=prompt_generator(device, 0, i)) for i, p in enumerate(prompts)]
    texts = [[t for t in o.tokens if t != meta["eos_id"]] for o in outs]
    tokens, nfe, seconds = sum(len(o.tokens) for o in outs), sum(o.nfe for o in outs), sum(o.seconds for o in outs)
    return texts, {"tokens": tokens, "nfe": nfe, "tpf": tokens / nfe, "seconds": seconds,
                   "tokens_per_s": tokens / seconds}


def validation_prompts(cfg, dataset):
    """The first num_prompts validation prompts (lists of token ids) that leave room in the context
    for the generation, and the generation's number of slots. Raises ValueError when none fits."""
    block = cfg["block_size"] or BLOCK_SIZE[dataset]
    n_slots = RefusionSettings(cfg["max_new_tokens"], slot_size=cfg["slot_size"], num_blocks=cfg["num_blocks"]).n_slots
    val = TokenDataset(prepare(dataset, "bytes", block), "val")
    prompts = []
    for i in range(len(val)):
        prompt = val.sample(i)[0]
        if len(prompt) + n_slots * cfg["slot_size"] <= block:
            prompts.append(prompt)
        if len(prompts) == cfg["num_prompts"]:
            break
    if not prompts:
        raise ValueError(f"no {dataset} validation prompt leaves room for {n_slots * cfg['slot_size']} new tokens "
                         f"in the context of {block}; lower --max_new_tokens or raise --block_size")
    return prompts, n_slots


def bench_dataset(cfg, dataset, prompts, n_slots):
    """Train or reuse the four models of one data set, decode its validation prompts (from
    validation_prompts, with the generation's number of slots) with every decoder setting, and
    return one row (dict) per setting with quality, tokens, NFE, TPF, seconds, tokens/s and the
    speed-ups over the ARM and the default MDM."""
    iters, ft = cfg["max_iters"], cfg["finetune_iters"]
    dirs = {name: train_model(cfg, dataset, name, name, iters) for name in ("ar", "refusion", "mdm")}
    dirs["refusion-ft"] = train_model(cfg, dataset, "refusion-ft", "refusion", ft,
                                      init_from=os.path.join(dirs["ar"], "ckpt.pt"))
    ckpts = {name: load_checkpoint(d, cfg["device"]) for name, d in dirs.items()}
    models = {name: model_from_checkpoint(c, cfg["device"]) for name, c in ckpts.items()}
    meta = ckpts["ar"]["meta"]
    L = n_slots * cfg["slot_size"]
    enc = get_tokenizer(meta["tokenizer"])
    queries = [decode(enc, p) for p in prompts]
    rows, live = [], train.live_progress()
    for label, method, name, kwargs in tqdm(decoder_settings(cfg, n_slots), desc=f"decode {dataset}", disable=not live):
        texts, stats = run_decoder(method, models[name], prompts, meta, L, kwargs)
        if not live:
            print(f"decode {dataset}: {label}: {stats['tokens']} tokens, TPF {stats['tpf']:.2f}, "
                  f"{stats['tokens_per_s']:.0f} tokens/s", flush=True)
        scores = [quality(dataset, q, decode(enc, t)) for q, t in zip(queries, texts)]
        budget = iters + (ft if name == "refusion-ft" else 0)
        rows.append({"dataset": dataset, "method": method, "model": name, "label": label, "settings": kwargs,
                     "train_iters": budget, "val_loss": ckpts[name]["best_val_loss"],
                     "quality": {"accuracy" if dataset in ANSWERED else "parse_rate": sum(scores) / len(scores)},
                     **stats})
    ar_speed = rows[0]["tokens_per_s"]
    mdm_speed = next(r["tokens_per_s"] for r in rows if r["method"] == "mdm")
    for r in rows:
        r["speedup_vs_ar"], r["speedup_vs_mdm"] = r["tokens_per_s"] / ar_speed, r["tokens_per_s"] / mdm_speed
    return rows


def markdown_table(rows):
    """The rows as a markdown table, one line per decoder setting."""
    lines = ["| data | decoder | train iters | quality | tokens | NFE | TPF | tokens/s | vs ARM | vs MDM |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        (metric, q), = r["quality"].items()
        lines.append(f"| {r['dataset']} | {r['label']} | {r['train_iters']} | {metric} {q:.1%} | {r['tokens']} | "
                     f"{r['nfe']} | {r['tpf']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup_vs_ar']:.2f}x | "
                     f"{r['speedup_vs_mdm']:.1f}x |")
    return "\n".join(lines)


def plot(rows, path):
    """Quality against tokens/s per data set, one marker per decoder (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    colors = {"ar": "tab:blue", "refusion": "tab:red", "refusion-ft": "tab:purple", "mdm": "tab:green"}
    for ax, ds in zip(axes[0], datasets):
        ds_rows = [r for r in rows if r["dataset"] == ds]
        markers = {}
        for r in ds_rows:
            markers[r["model"]] = ax.scatter(r["tokens_per_s"], next(iter(r["quality"].values())),
                                             color=colors[r["model"]])
        ax.legend(markers.values(), markers.keys())
        ax.set_xscale("log")
        ax.set_xlabel("tokens/s (log scale)")
        ax.set_ylabel(next(iter(ds_rows[0]["quality"])))
        ax.set_title(ds)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def machine():
    """What the figures were measured on."""
    import platform
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine()}


def training_step_times(cfg, dataset, steps=20):
    """Seconds per training step (batch draw, the objective's batch layout, forward, backward,
    AdamW) of the ReFusion and AR objectives on the same batches and model shape, interleaved so
    both see the same machine load. Returns {"refusion": s, "ar": s, "ratio": refusion / ar}."""
    block, device = cfg["block_size"] or BLOCK_SIZE[dataset], cfg["device"]
    data_dir = prepare(dataset, "bytes", block)
    train_data = TokenDataset(data_dir, "train")
    meta = train_data.meta
    models, optims, times = {}, {}, {"refusion": 0.0, "ar": 0.0}
    for objective in times:
        torch.manual_seed(cfg["seed"])
        models[objective] = Transformer(ModelConfig(vocab_size=meta["vocab_size"], block_size=block,
                                                    n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                                                    n_embd=cfg["n_embd"])).to(device)
        optims[objective] = torch.optim.AdamW(models[objective].parameters(), lr=1e-4)
    step_cfg = dict(train.DEFAULTS, slot_sizes=(4, 8))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)  # wait for queued GPU work
    for i in range(steps + 3):                                     # the first 3 rounds warm up, untimed
        for objective in sorted(times, reverse=i % 2 == 1):         # alternate which one goes first
            rng, gen = np.random.default_rng(i), torch.Generator().manual_seed(i)   # same batch for both
            sync()
            t0 = time.perf_counter()
            tokens, prompt_len, length = train_data.get_batch(cfg["batch_size"], rng, device)
            batch = train.make_batch(dict(step_cfg, objective=objective), tokens, prompt_len, length,
                                     meta["mask_id"], gen)
            with train.autocast_for(device):
                logits = models[objective](batch.idx, batch.position_ids, key_mask=batch.key_mask)
            train.hybrid_loss(logits.float(), batch)[0].backward()
            optims[objective].step()
            optims[objective].zero_grad(set_to_none=True)
            sync()
            if i >= 3:
                times[objective] += (time.perf_counter() - t0) / steps
    return dict(times, ratio=times["refusion"] / times["ar"])


def check_bench_config(cfg):
    """Check every setting (not the data: see validation_prompts) before any training starts.
    Raises ValueError with the fix."""
    for ds in cfg["datasets"]:
        if ds not in BLOCK_SIZE:
            raise ValueError(f"--datasets={ds}: the benchmark knows {', '.join(BLOCK_SIZE)}")
    require(cfg, ("num_prompts", "max_iters", "finetune_iters", "batch_size", "n_layer", "n_head", "n_embd"),
            "positive", lambda v: v > 0)
    require(cfg, ("block_size",), "0 or more", lambda v: v >= 0)
    require(cfg, ("learning_rate",), "positive and finite", lambda v: 0 < v < math.inf)
    refusion = RefusionSettings(cfg["max_new_tokens"], slot_size=cfg["slot_size"], num_blocks=cfg["num_blocks"])
    for _, method, _, settings in decoder_settings(cfg, refusion.n_slots):
        if method == "mdm":
            MDMSettings(refusion.gen_len, **settings)


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    check_bench_config(cfg)
    # prepares the data and raises before any training if no prompt fits
    prompts = {ds: validation_prompts(cfg, ds) for ds in cfg["datasets"]}
    os.makedirs(cfg["out_dir"], exist_ok=True)
    rows = [r for ds in cfg["datasets"] for r in bench_dataset(cfg, ds, *prompts[ds])]
    step_times = {ds: training_step_times(cfg, ds) for ds in cfg["datasets"]}
    table = markdown_table(rows) + "\n\n" + "\n".join(
        f"Training step ({ds}, batch {cfg['batch_size']}): ReFusion {t['refusion'] * 1e3:.0f} ms, AR "
        f"{t['ar'] * 1e3:.0f} ms, ratio {t['ratio']:.2f}x" for ds, t in step_times.items())
    with open(os.path.join(cfg["out_dir"], "bench.json"), "w") as f:
        json.dump({"config": cfg, "machine": machine(), "rows": rows, "training_step_seconds": step_times}, f,
                  indent=2)
    with open(os.path.join(cfg["out_dir"], "bench.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)
    if plot(rows, os.path.join(cfg["out_dir"], "bench.png")):
        print(f"wrote {cfg['out_dir']}/bench.png")
    print(f"wrote {cfg['out_dir']}/bench.json and {cfg['out_dir']}/bench.md")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
