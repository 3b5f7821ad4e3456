"""
How each decoder's cost grows with the length of the answer: an ARM, an MDM and a ReFusion model of
the same size on one task whose answers run from 32 to 512 tokens (docs/benchmark.md, "Cost against
the answer's length").

    python -m tools.bench_length           # the whole run, into bench-length/
    python -m tools.bench_length --quick   # a smoke run: tiny models, two short lengths

It trains (or reuses, from out_dir) the ARM from scratch, then ReFusion and an MDM from it, and
decodes the first num_prompts validation prompts of each length with every decoder (decoders),
interleaved. It writes out_dir/bench.json, bench.md (the rows, the growth of ms per token as a power
of the length, ReFusion's lead over the MDM per length), bench.png and bench_length.png (ms per
token against length).
"""

import math
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train
from configurator import explicit_keys, parse_args, require, run_cli, settings_in
from model import ModelConfig
from support.benchmark import Point, point_config, train_or_reuse
from support.checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint
from support.corpora import BLOCK_TOKENS, LONG_LETTERS, score
from support.drawing import pyplot
from support.files import write_atomic
from support.hardware import machine, settle_dtype
from support.prepare import TokenDataset, prepare
from support.report import (best_mdm, fastest_close, first_quality, markdown_table, most_accurate,
                            quality_text, speedup_text, write_report)
from support.runs import check_writable, live_progress
from sampler import make_decoder
from support.tokenizer import decode, get_tokenizer

# -----------------------------------------------------------------------------
# default config
out_dir = "bench-length"   # the models, bench.json, bench.md, bench.png and bench_length.png
dataset = "quotes-long"    # the task: quotes-long or transform-long (LENGTHS)
lengths = (32, 64, 128, 256, 512)  # the answer lengths decoded (byte tokens: text, "\n", EOS)
num_prompts = 8            # validation prompts decoded at each length
block_size = 1040          # the context: the longest prompt (519; quotes-long: 514) and answer
n_layer = 4                # the three models' shape
n_head = 4
n_embd = 128
batch_size = 16            # samples per training step
max_iters = 1000           # the ARM's steps, from scratch, at learning_rate
learning_rate = 3e-3
finetune_iters = 300       # ReFusion's and the MDM's steps from the ARM, at finetune_lr
finetune_lr = 1e-3
mdm_shift = True           # the MDM the Dream way (SPEC section 3); False: LLaDA's
device = "cpu"             # cpu, cuda or mps: training and decoding
dtype = "auto"             # the decodes' weights: auto (bf16 where native), float32, bfloat16
seed = 1337                # training seed of every model (decodes are greedy)
retrain = False            # train again even when out_dir holds the models
quick = False              # a smoke run: QUICK's models, budget, lengths and prompts
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())

# each task's answer lengths (byte tokens, EOS included)
LENGTHS = {"quotes-long": BLOCK_TOKENS, "transform-long": tuple(n + 2 for n in LONG_LETTERS)}
# a smoke run: the plumbing, not the method (its models train for a few steps)
QUICK = dict(out_dir="bench-length-quick", lengths=(32, 64), num_prompts=2, block_size=160,
             n_layer=2, n_head=2, n_embd=64, batch_size=8, max_iters=20, finetune_iters=10)
NAMES = {"ar": "ARM", "refusion": "ReFusion", "mdm": "MDM"}


def decoders(L):
    """[(label, series, method, model, knobs)] at answer length L: the ARM; the MDM at 1 to 32
    tokens a step (one block at 1, blocks of min(32, L) from 2 on); ReFusion with slots of 8, the
    paper's infill, at two thresholds."""
    points = [("ARM next token", "ARM", "next_token", "ar", {})]
    for per_step in (1, 2, 4, 8, 16, 32):
        block = L if per_step == 1 else min(32, L)
        points.append((f"MDM {per_step} token(s)/step, " + ("one block" if per_step == 1 else
                                                            "blocks of 32"),
                       "MDM", "mdm", "mdm", dict(steps=L // per_step, block_length=block)))
    for slot_thr, token_thr in ((0.9, 0.3), (0.7, 0.1)):
        points.append((f"ReFusion S=8 slot>{slot_thr} token>{token_thr}", "ReFusion", "refusion",
                       "refusion", dict(slot_size=8, slot_threshold=slot_thr,
                                        token_threshold=token_thr, infill="paper")))
    return points

# -----------------------------------------------------------------------------
# the models


def train_models(cfg):
    """Train, reuse or resume (support.benchmark.train_or_reuse) the ARM from scratch, then ReFusion
    and the MDM from it. Returns {name: (directory, minutes)}."""
    shape = [f"--{k}={cfg[k]}" for k in ("block_size", "n_layer", "n_head", "n_embd",
                                         "batch_size", "seed", "device")]
    dtype = "bfloat16" if cfg["device"].startswith("cuda") else "float32"  # as tools.bench

    def run(name, objective, iters, lr, *extra):
        out = os.path.join(cfg["out_dir"], name)
        flags = [f"--out_dir={out}", f"--dataset={cfg['dataset']}", f"--objective={objective}",
                 f"--max_iters={iters}", f"--learning_rate={lr}", f"--min_lr={lr / 10}",
                 f"--eval_interval={max(iters // 4, 1)}", f"--dtype={dtype}", *shape, *extra]
        return out, train_or_reuse(train.main, train.DEFAULTS, flags, cfg["retrain"])

    models = {"ar": run("ar", "ar", cfg["max_iters"], cfg["learning_rate"], "--pack=True")}
    start = [f"--init_from={os.path.join(models['ar'][0], 'ckpt.pt')}",
             f"--warmup_iters={min(50, cfg['finetune_iters'] // 10)}"]
    models["refusion"] = run("refusion", "refusion", cfg["finetune_iters"], cfg["finetune_lr"],
                             "--pack=True", *start)
    models["mdm"] = run("mdm", "mdm", cfg["finetune_iters"], cfg["finetune_lr"], "--gen_length=0",
                        f"--mdm_shift={cfg['mdm_shift']}", *start)
    return models

# -----------------------------------------------------------------------------
# decoding at each length


def prompts_of_length(cfg, L):
    """(prompts, answers), lists of token-id lists: the first num_prompts validation samples whose
    answer is L tokens (EOS included) and fits the context. Raises ValueError when none is."""
    val = TokenDataset(prepare(cfg["dataset"], "bytes", cfg["block_size"]), "val")
    found = []
    for i in range(len(val)):
        prompt, answer = val.sample(i)
        if len(answer) == L and len(prompt) + L <= cfg["block_size"]:
            found.append((prompt, answer))
            if len(found) == cfg["num_prompts"]:
                break
    if not found:
        raise ValueError(f"no {cfg['dataset']} validation answer of {L} tokens fits the context of "
                         f"{cfg['block_size']}; raise --block_size or drop {L} from --lengths")
    return [p for p, _ in found], [a for _, a in found]


def bench_length(cfg, L, models, ckpts, ids, enc):
    """Decode the prompts of answer length L with every decoder, interleaved; returns the rows."""
    prompts, answers = prompts_of_length(cfg, L)
    points = [(*p[:4], dict(p[4], mdm_shift=ckpts["mdm"]["config"]["mdm_shift"])
               if p[2] == "mdm" else p[4]) for p in decoders(L)]   # the MDM as it was trained
    timed = []
    for label, series, method, name, knobs in points:
        decode_fn = make_decoder(point_config(method, knobs, max_new_tokens=L), ids,
                                 torch.Generator(cfg["device"]))[0]
        timed.append(Point(models[name], ids, L, decode_fn))
    for d in timed:
        d.warm_up(prompts[0])
    for i, prompt in enumerate(tqdm(prompts, desc=f"decode length {L}",
                                    disable=not live_progress())):
        for k in range(len(timed)):                  # every decoder, the order rotating
            timed[(i + k) % len(timed)](prompt, i)
    queries = [decode(enc, p) for p in prompts]
    rows = []
    for (label, series, method, name, knobs), d in zip(points, timed):
        texts = [decode(enc, [t for t in o if t not in ids["eos_ids"]]) for o in d.outs]
        scores = [score(cfg["dataset"], q, t) for q, t in zip(queries, texts)]
        figures = d.figures()
        rows.append({"task": f"length {L}", "length": L, "dataset": cfg["dataset"], "label": label,
                     "series": series, "method": method, "model": name, "settings": knobs,
                     "prompts": len(prompts), "answer_tokens": sum(map(len, answers)),
                     "quality": {m: sum(s[m] for s in scores) / len(scores) for m in scores[0]},
                     "ms_per_token": 1e3 * figures["seconds"] / figures["tokens"], **figures})
    mdm = best_mdm(rows)
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["speedup_vs_mdm"] = r["tokens_per_s"] / mdm["tokens_per_s"]
    return rows

# -----------------------------------------------------------------------------
# what the rows show


def growth(rows):
    """{decoder label: the exponent b of ms per token ~ length^b, a least-squares fit of the logs},
    None with fewer than two lengths."""
    out = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = [(r["length"], r["ms_per_token"]) for r in rows if r["label"] == label]
        out[label] = (float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]),
                                       1)[0]) if len(pts) > 1 else None)
    return out


def leads(rows):
    """{L: ReFusion's point (its fastest within 1 point of the ARM, else its most accurate) against
    the MDM's best point and the MDM at one token a step: "refusion", "mdm" (labels), "ratio",
    "as_good", "ratio_one_per_step", "as_good_one" (tokens/s ratios; quality >= the MDM's)}."""
    out = {}
    for L in dict.fromkeys(r["length"] for r in rows):
        at = [r for r in rows if r["length"] == L]
        refusion = [r for r in at if r["method"] == "refusion"]
        pick = fastest_close(refusion, first_quality(at[0])) or most_accurate(refusion)
        mdm = best_mdm(at)
        one = next(r for r in at if r["method"] == "mdm" and r["settings"]["steps"] == L)
        out[L] = {"refusion": pick["label"], "mdm": mdm["label"],
                  "ratio": pick["tokens_per_s"] / mdm["tokens_per_s"],
                  "as_good": first_quality(pick) >= first_quality(mdm),
                  "ratio_one_per_step": pick["tokens_per_s"] / one["tokens_per_s"],
                  "as_good_one": first_quality(pick) >= first_quality(one)}
    return out


def holds_from(lead, key, as_good, x=18):
    """In words, the lengths at which lead[L][key] passes x with lead[L][as_good]: "from length L
    on" when it holds at L and every longer length."""
    past = [L for L, v in lead.items() if v[key] > x and v[as_good]]
    if not past:
        return "at no length measured"
    if past == [L for L in lead if L >= past[0]]:
        return f"from length {past[0]} on"
    return "at length" + "s" * (len(past) > 1) + " " + ", ".join(map(str, past)) + " only"


def length_table(rows, fits, lead):
    """bench.md: a row per (length, decoder), the fitted growth, and ReFusion's lead per length."""
    header = ["length", "decoder", "quality", "tokens", "NFE", "TPF", "tokens/s", "ms/token",
              "vs ARM", "vs MDM"]
    lines = [markdown_table(header, [[r["length"], r["label"], quality_text(r), r["tokens"],
                                     r["nfe"], f"{r['tpf']:.2f}", f"{r['tokens_per_s']:.0f}",
                                     f"{r['ms_per_token']:.2f}", speedup_text(r["speedup_vs_ar"]),
                                     speedup_text(r["speedup_vs_mdm"])] for r in rows])]
    lines += ["", "Growth of ms per token with the answer's length (ms/token ~ length^b):", ""]
    lines += [f"- {label}: b = {'-' if b is None else f'{b:.2f}'}" for label, b in fits.items()]
    lines += ["", "ReFusion against the MDM at each length (the points of the table's rule; then "
              "against the MDM at one token a step):", ""]
    lines += [f"- {L}: {v['refusion']} is {v['ratio']:.1f}x {v['mdm']}, "
              f"{'at equal or better' if v['as_good'] else 'at lower'} quality; "
              f"{v['ratio_one_per_step']:.1f}x the MDM at one token a step, "
              f"{'at equal or better' if v['as_good_one'] else 'at lower'} quality"
              for L, v in lead.items()]
    lines += ["", "ReFusion's lead passes the paper's 18x at equal or better quality over the "
              f"MDM's best point {holds_from(lead, 'ratio', 'as_good')}, over the MDM at one "
              f"token a step {holds_from(lead, 'ratio_one_per_step', 'as_good_one')}."]
    return "\n".join(lines)


def plot_lengths(rows, path):
    """Draw ms per token against the answer's length (log-log, a line per decoder) into path.
    Returns False without matplotlib."""
    try:
        plt = pyplot()
    except ValueError:                                  # no matplotlib
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = {"ARM": "tab:gray", "MDM": "tab:green", "ReFusion": "tab:red"}
    seen = {}                                 # a series' lines told apart by style and marker
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = [r for r in rows if r["label"] == label]
        n = seen[pts[0]["series"]] = seen.get(pts[0]["series"], -1) + 1
        ax.plot([r["length"] for r in pts], [r["ms_per_token"] for r in pts],
                ("-", "--", ":", "-.")[n % 4], marker="os^vDx"[n % 6],
                color=colors[pts[0]["series"]], label=label, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = sorted({r["length"] for r in rows})
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("answer length (tokens)")
    ax.set_ylabel("ms per generated token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, dpi=120, format="png"))
    return True

# -----------------------------------------------------------------------------


def check_length_config(cfg):
    """Check the settings before any work. Raises ValueError with the fix."""
    if cfg["dataset"] not in LENGTHS:
        raise ValueError(f"--dataset={cfg['dataset']!r}: the sweep's tasks are "
                         f"{', '.join(LENGTHS)}")
    known = LENGTHS[cfg["dataset"]]
    if not cfg["lengths"]:
        raise ValueError(f"--lengths=(): name at least one answer length to sweep, from "
                         f"{', '.join(map(str, known))}")
    for L in cfg["lengths"]:
        if L not in known:
            raise ValueError(f"--lengths: {L} is not an answer length of {cfg['dataset']}; "
                             f"choose from {', '.join(map(str, known))}")
    require(cfg, ("num_prompts", "block_size", "n_layer", "n_head", "n_embd", "batch_size",
                  "max_iters", "finetune_iters"), "positive", lambda v: v > 0)
    require(cfg, ("learning_rate", "finetune_lr"), "positive and finite",
            lambda v: 0 < v < math.inf)


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    if cfg["quick"]:
        explicit = explicit_keys(cfg, DEFAULTS, argv)
        cfg.update({k: v for k, v in QUICK.items() if k not in explicit})
    check_length_config(cfg)
    check_writable(cfg["out_dir"])
    t0 = time.perf_counter()
    for L in cfg["lengths"]:
        prompts_of_length(cfg, L)  # prepares the data; raises before any training
    dirs = train_models(cfg)
    t1 = time.perf_counter()
    ckpts = {name: load_checkpoint(d, cfg["device"]) for name, (d, _) in dirs.items()}
    settle_dtype(cfg, ModelConfig(**ckpts["ar"]["model_args"]))
    models = {name: model_from_checkpoint(c, cfg["device"]).to(getattr(torch, cfg["dtype"]))
              for name, c in ckpts.items()}
    ids, enc = decoder_ids(ckpts["ar"]["meta"]), get_tokenizer(ckpts["ar"]["meta"]["tokenizer"])
    rows = [r for L in cfg["lengths"] for r in bench_length(cfg, L, models, ckpts, ids, enc)]
    fits, lead = growth(rows), leads(rows)
    minutes = {"train": (t1 - t0) / 60, "decode": (time.perf_counter() - t1) / 60}
    host = machine()
    table = length_table(rows, fits, lead) + (
        f"\n\nTraining {minutes['train']:.1f} minutes ("
        + ", ".join(f"{NAMES[n]} {m:.1f}" for n, (_, m) in dirs.items())
        + f" as trained), decoding {minutes['decode']:.1f} minutes, on {host['processor']} "
        f"({host['cpu_capability']}, {host['cpu_threads']} threads), {cfg['dtype']}")
    report = {"config": cfg, "machine": host, "minutes": minutes, "rows": rows, "growth": fits,
              "leads": {str(L): v for L, v in lead.items()}}
    write_report(cfg["out_dir"], report, table)
    if plot_lengths(rows, os.path.join(cfg["out_dir"], "bench_length.png")):
        print(f"wrote {cfg['out_dir']}/bench_length.png")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
