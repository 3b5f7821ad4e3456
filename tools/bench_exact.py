"""
verify="exact" (SPEC 4.5) beside next-token decoding and the paper's decoder, on one checkpoint's
validation prompts (docs/benchmark.md, "Exact verification").

    python -m tools.bench_exact                         # the quick start's model, 50 lines
    python -m tools.bench_exact --sample_config=config/sample_smollm2_quotes.py --first=100 \
        --num_prompts=100

The sampler config file (sample_config) gives the checkpoint and the paper's decoder; every prompt
is decoded by next-token decoding, by that decoder and by verify="exact" at each of slot_sizes,
the points taking turns prompt by prompt. It prints a table: the texts identical to next-token
decoding's, the right answers, tokens, NFE, TPF, milliseconds a pass, tokens/s and the speed-ups,
and with --out_json writes the rows.
"""

import json
import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sampler
from configurator import check_device, parse_args, require, run_cli, settings_in
from support.benchmark import Point
from support.corpora import score
from support.files import write_atomic
from support.hardware import machine
from support.report import markdown_table
from support.sampling import load_model, validation_split
from support.tokenizer import decode

# -----------------------------------------------------------------------------
sample_config = "config/sample_quotes.py"  # sampler.py's config: the checkpoint, the paper decoder
out_dir = ""               # the checkpoint's out_dir instead of sample_config's
max_new_tokens = 0         # every point's instead of sample_config's (0: its own)
slot_size = 0              # the paper decoder's instead of sample_config's (0: its own)
first = 0                  # the first validation prompt decoded (of those that fit) ...
num_prompts = 50           # ... and how many from it
slot_sizes = (4, 8, 16, 32)  # verify="exact" at each of these slot sizes
dtype = "auto"             # the weights: auto (bf16 where native), float32, bfloat16
device = "cpu"             # cpu, cuda, cuda:N or mps
out_json = ""              # also write the rows here (JSON)
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def points(cfg):
    """[(label, sampler config)]: next-token decoding, cfg's paper decoder, then verify="exact" at
    each of cfg["slot_sizes"], all of cfg's max_new_tokens."""
    paper = dict(cfg, method="refusion", verify="paper")
    return ([("next token", dict(cfg, method="next_token", verify="paper")),
             (f"paper S={cfg['slot_size']} serial={cfg['serial_num_blocks']} "
              f"slot>{cfg['slot_threshold']} token>{cfg['token_threshold']} "
              f"infill={cfg['infill']}", paper)] +
            [(f"exact S={S}", dict(cfg, method="refusion", verify="exact", slot_size=S))
             for S in dict.fromkeys(cfg["slot_sizes"])])


def main(argv):
    """Decode the prompts at every point, interleaved; print the table (and write --out_json)."""
    opts = parse_args(DEFAULTS, argv)
    require(opts, ["first"], "a prompt index >= 0", lambda v: v >= 0)
    require(opts, ["num_prompts"], "at least 1", lambda v: v >= 1)
    require(opts, ["slot_sizes"], "slot sizes >= 1, e.g. 4,8,16",
            lambda v: v and all(isinstance(s, int) and s >= 1 for s in v))
    check_device(opts["device"])
    # sampler.py's settings: the config file (relative to the repository, or absolute), then the
    # overrides given here; then this tool's own
    config = os.path.join(ROOT, opts["sample_config"])
    overrides = [f"--{k}={opts[k]}" for k in ("dtype", "device", "out_dir", "max_new_tokens",
                                              "slot_size") if opts[k]]
    cfg = parse_args(sampler.DEFAULTS, [config, *overrides])
    cfg.update({k: opts[k] for k in ("first", "num_prompts", "slot_sizes", "out_json")})
    model, enc, ids, objective, ckpt = load_model(cfg)
    if objective != "refusion" or ckpt is None:
        raise ValueError(f"{cfg['out_dir']}: a ReFusion checkpoint is needed (this one's objective "
                         f"is {objective})")
    decoders = [(label, *sampler.make_decoder(c, ids, None)) for label, c in points(cfg)]
    room = max(settings.gen_length for _, _, settings in decoders)
    block = model.config.block_size
    val = validation_split(ckpt)
    fits = val.first_fitting(cfg["first"] + cfg["num_prompts"], room, block)[cfg["first"]:]
    if not fits:
        raise ValueError(f"--first={cfg['first']}: of the {len(val)} validation prompts, fewer "
                         f"than {cfg['first'] + 1} leave room for {room} new tokens (the longest "
                         f"generation of the points: the paper decoder's max_new_tokens="
                         f"{cfg['max_new_tokens']} in whole slots of {cfg['slot_size']}) in the "
                         f"context of {block}")
    runs = [Point(model, ids, settings.max_new_tokens, decode) for _, decode, settings in decoders]
    for run in runs:
        run.warm_up(fits[0][0])
    # the points take turns, each starting a prompt's round in its turn
    for i, (prompt, _) in enumerate(fits):
        for k in range(len(runs)):
            runs[(i + k) % len(runs)](prompt, i)
    rows = []
    dataset = ckpt["config"]["dataset"]
    for (label, _, settings), run in zip(decoders, runs):
        texts = [decode(enc, [t for t in o if t not in ids["eos_ids"]]) for o in run.outs]
        scores = [score(dataset, decode(enc, p), t, decode(enc, r[:-1]))
                  for (p, r), t in zip(fits, texts)]
        right = None if scores[0] is None else sum(next(iter(s.values())) == 1.0 for s in scores)
        rows.append(dict(label=label, **run.figures(), right=right, outs=run.outs,
                         identical=sum(a == b for a, b in zip(run.outs, runs[0].outs))))
    print(report(cfg, rows, len(fits)))
    if cfg["out_json"]:
        write_atomic(cfg["out_json"], lambda f: f.write(json.dumps(
            {"machine": machine(), "prompts": len(fits), "first": cfg["first"],
             "out_dir": cfg["out_dir"], "rows": rows}, indent=1).encode()))
        print(f"wrote {cfg['out_json']}")


def report(cfg, rows, n):
    """The table of rows (main's), under a line naming the machine and the prompts."""
    ar, paper = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    table = markdown_table(
        ["point", "identical texts", "right", "tokens", "NFE", "TPF", "ms a pass", "tokens/s",
         "vs next token", "vs paper"],
        [[r["label"], f"{r['identical']} of {n}", "-" if r["right"] is None else r["right"],
          r["tokens"], r["nfe"], f"{r['tpf']:.2f}", f"{r['ms_per_forward']:.2f}",
          f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / ar:.2f}x",
          f"{r['tokens_per_s'] / paper:.2f}x"] for r in rows], right=range(1, 10))
    m = machine()
    return (f"{m['processor']} ({m['cpu_kind']}, {m['cpu_threads']} threads), torch {m['torch']}; "
            f"{cfg['out_dir']}, the validation prompts with room for the answer, {cfg['first']} to "
            f"{cfg['first'] + n - 1}, max_new_tokens={cfg['max_new_tokens']}, --dtype="
            f"{cfg['dtype']}\n\n{table}")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
