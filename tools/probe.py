"""
What a forward pass costs on this machine, and what that allows ReFusion here (docs/benchmark.md,
"What a forward pass costs").

    python -m tools.probe                                 # the quick start's model (out-quotes)
    python -m tools.probe --init_from=smollm2 --plot=probe.png
    python -m tools.probe --init_from=smollm2 --tpf=5.0 --pass_mix=8,32
    python -m tools.probe --compile=True      # each dtype's passes also compiled

For each dtype it times one cached forward pass of k tokens after prompt_len cached ones, for every
k in fed (the median of repeats, interleaved), and prints the machine, the ms of each pass, the
"free" tokens (the most a pass takes for at most 1.25x the cost of one), the speed-up ReFusion can
reach at --tpf with passes of --pass_mix tokens against the fastest next-token decoding, and the
dtype --dtype=auto takes here beside the faster one by these costs. --plot draws the curve
(matplotlib), --json prints the figures as one JSON object.
"""

import copy
import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from json import dumps

from configurator import check_device, parse_args, require, run_cli, settings_in
from support.benchmark import free_tokens, pass_costs, refusion_speedups
from support.checkpoint import load_checkpoint, model_from_checkpoint
from support.compiled import CompiledModel, check_compile
from support.drawing import picture_path, pyplot
from support.files import write_atomic
from support.hardware import machine, pick_dtype
from support.hf_folder import from_pretrained
from support.report import markdown_table

# -----------------------------------------------------------------------------
out_dir = "out-quotes"     # a run's out_dir (its ckpt.pt; the quick start's by default) ...
init_from = ""             # ... or a Hugging Face model folder (SmolLM2, Qwen3)
device = "cpu"             # cpu, cuda, cuda:N or mps
dtypes = ("float32", "bfloat16")  # the dtypes timed
prompt_len = 64            # tokens cached before each timed pass
fed = (1, 2, 4, 8, 16, 32, 64, 128)  # tokens fed to the timed passes (k), within the context
repeats = 12               # timed rounds (the median is kept), after one that warms up
tpf = 5.0                  # ReFusion's tokens per forward pass, for the speed-up it can reach
pass_mix = (32,)           # tokens fed to ReFusion's passes, each as often (each among fed)
compile = False            # also time each dtype's passes compiled (support/compiled.py)
plot = ""                  # draw ms against tokens fed into this PNG (matplotlib)
json = False               # print the figures as one JSON object instead of tables
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def check_probe_config(cfg):
    """Refuse settings that cannot work, before the model is read. Raises ValueError."""
    check_device(cfg["device"])
    if not cfg["dtypes"] or any(d not in ("float32", "bfloat16") for d in cfg["dtypes"]):
        raise ValueError(f"--dtypes={','.join(cfg['dtypes'])}: name float32, bfloat16 or both")
    require(cfg, ("prompt_len", "repeats"), "positive", lambda v: v > 0)
    require(cfg, ("tpf",), "positive and finite", lambda v: 0 < v < float("inf"))
    if any(not isinstance(k, int) or k <= 0 for k in cfg["fed"]) or 1 not in cfg["fed"]:
        raise ValueError(f"--fed={','.join(map(str, cfg['fed']))}: give positive numbers of "
                         "tokens, 1 among them (the next-token pass every speed-up is against)")
    if missing := [m for m in cfg["pass_mix"] if m not in cfg["fed"]]:
        raise ValueError(f"--pass_mix={','.join(map(str, cfg['pass_mix']))}: "
                         f"{', '.join(map(str, missing))} not among --fed; add them to --fed, or "
                         "give --pass_mix the passes ReFusion feeds among them")
    mean_pass = sum(cfg["pass_mix"]) / len(cfg["pass_mix"])
    if cfg["tpf"] > mean_pass:
        raise ValueError(f"--tpf={cfg['tpf']:g}: a pass commits at most the tokens it is fed, so "
                         f"TPF cannot pass the mean of --pass_mix ({mean_pass:g})")
    if cfg["plot"]:
        cfg["plot"] = picture_path(cfg["plot"], "--plot")


def load(cfg):
    """(float32 model in eval mode on cfg["device"], its name) from --init_from (a Hugging Face
    folder, a run's out_dir or ckpt.pt) or --out_dir. Raises ValueError for an MDM's checkpoint (it
    makes no cached pass)."""
    source = cfg["init_from"] or cfg["out_dir"]
    if cfg["init_from"] and os.path.isfile(os.path.join(source, "config.json")):
        return from_pretrained(source).to(cfg["device"]), source
    ckpt = load_checkpoint(source)
    if ckpt["config"]["objective"] == "mdm":
        raise ValueError(f"{source} holds a masked diffusion model (--objective=mdm): it decodes "
                         "by passes over its whole canvas without a KV cache, so it runs neither "
                         "ReFusion nor next-token decoding, whose cached passes the probe times. "
                         "Probe a ReFusion or next-token run's checkpoint; an MDM's decoding "
                         "speed is measured by sampling it (sampler.py) or by tools.bench")
    return model_from_checkpoint(ckpt, cfg["device"]), source


def probe(cfg):
    """The figures of one probe (see the module's docstring) as a dict."""
    model, name = load(cfg)
    room = model.config.block_size - cfg["prompt_len"]
    fed = tuple(sorted(k for k in set(cfg["fed"]) if k <= room))
    if missing := [m for m in cfg["pass_mix"] if m > room]:
        raise ValueError(f"--pass_mix: {', '.join(map(str, missing))} tokens after "
                         f"--prompt_len={cfg['prompt_len']} pass the model's context of "
                         f"{model.config.block_size}; lower them or --prompt_len")
    models = {d: copy.deepcopy(model).to(getattr(torch, d)) for d in cfg["dtypes"]}
    if cfg["compile"]:   # the untimed first round compiles their graphs
        models |= {f"{d} compiled": CompiledModel(m) for d, m in models.items()}
    costs = pass_costs(models, cfg["prompt_len"], fed, cfg["repeats"])
    speedups = refusion_speedups(costs, cfg["tpf"], cfg["pass_mix"])
    auto, why = pick_dtype("auto", cfg["device"], model.config)
    return {"model": name, "params_m": model.num_params() / 1e6, "device": cfg["device"],
            "machine": machine(), "prompt_len": cfg["prompt_len"], "repeats": cfg["repeats"],
            "dropped": sorted(set(cfg["fed"]) - set(fed)), "ms": costs,
            "free_tokens": {d: free_tokens(c) for d, c in costs.items()},
            "tpf": cfg["tpf"], "pass_mix": list(cfg["pass_mix"]), "refusion_speedup": speedups,
            "next_token_dtype": min(costs, key=lambda d: costs[d][1]),
            "refusion_dtype": max(speedups, key=speedups.get), "auto": auto, "auto_why": why}


def report_text(r):
    """The probe's figures as the tables it prints."""
    host = r["machine"]
    where = (host["gpu"] if r["device"].startswith("cuda") else
             f"{host['processor']}, {host['cpu_kind']} "
             f"(torch's capability {host['cpu_capability']})")
    fed = list(next(iter(r["ms"].values())))
    lines = [f"{r['model']} ({r['params_m']:.1f}M parameters) on {r['device']}: {where}, "
             f"{host['cpu_threads']} threads, torch {host['torch']}", "",
             f"One cached forward pass of k tokens after {r['prompt_len']} cached ones (ms, median "
             f"of {r['repeats']}, interleaved):", "",
             markdown_table(["dtype", *(f"k={k}" for k in fed), "free tokens (<= 1.25x k=1)"],
                            [[d, *(f"{c[k]:.2f}" for k in fed), r["free_tokens"][d]]
                             for d, c in r["ms"].items()])]
    if r["dropped"]:
        lines.append(f"(k = {', '.join(map(str, r['dropped']))} not timed: past the context)")
    best = r["ms"][r["next_token_dtype"]][1]
    mix = ", ".join(map(str, r["pass_mix"]))
    lines += ["", f"ReFusion at {r['tpf']:g} tokens per forward pass, its passes fed {mix} tokens, "
              f"against the fastest next-token decoding here ({r['next_token_dtype']}, "
              f"{best:.2f} ms a token):", "",
              markdown_table(["dtype", "ms per token", "speed-up"],
                             [[d, f"{best / speedup:.2f}", f"{speedup:.2f}x"]
                              for d, speedup in r["refusion_speedup"].items()])]
    lines += ["", r["auto_why"].replace("--dtype=auto: ", "--dtype=auto takes ")]
    if len(r["ms"]) > 1:
        # the rule against this measurement: "bfloat16 compiled" is bfloat16's weights
        faster = r["refusion_dtype"].split()[0]
        lines[-1] += f"; by these costs ReFusion decodes faster in {r['refusion_dtype']}"
        if faster != r["auto"]:
            lines[-1] += f": pass --dtype={faster} to take it"
    return "\n".join(lines)


def draw(r, path):
    """ms of a pass against tokens fed (log scale), a line per dtype, the free tokens marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for d, c in r["ms"].items():
        line, = ax.plot(list(c), list(c.values()), marker="o", label=d)
        free = r["free_tokens"][d]
        ax.plot([free], [c[free]], marker="s", markersize=10, fillstyle="none",
                color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    fed = list(next(iter(r["ms"].values())))
    ax.set_xticks(fed, [str(k) for k in fed])
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens fed to one cached forward pass (squares: the most for <= 1.25x one)")
    ax.set_ylabel("ms per pass")
    host = r["machine"]
    kind = host["gpu"] if r["device"].startswith("cuda") else host["cpu_kind"]
    ax.set_title(f"{os.path.basename(os.path.normpath(r['model']))} on {kind}, "
                 f"{host['cpu_threads']} threads", fontsize=10)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    check_probe_config(cfg)
    check_compile(cfg)
    r = probe(cfg)
    print(dumps(r) if cfg["json"] else report_text(r))
    if cfg["plot"]:
        draw(r, cfg["plot"])
        print(f"wrote {cfg['plot']}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
