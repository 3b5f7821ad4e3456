"""
Decode prompts with a trained checkpoint, and print each response with its speed.

    python sampler.py --num_samples=3                    # prompts from the validation split
    python sampler.py --prompt_file=my_prompt.txt --json
    python sampler.py --show --num_samples=1             # watch the slots fill in, step by step
    python sampler.py --plot=decode.png --num_samples=1  # draw which step committed each token
    python sampler.py --init_from=ReFusion --chat --prompt="Write a function that ..."  # the released model
    python sampler.py --init_from=smollm2 --chat --prompt="What is a hash table?"       # convert_gguf.py's SmolLM2

The decoders themselves are in generate.py; this file only loads, chooses and prints.
"""

import os
import sys
import time
from dataclasses import fields
from functools import partial
from itertools import groupby
from json import dumps

import torch

from checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint
from configurator import check_device, check_seed, explicit_keys, parse_args, run_cli, settings_in
from corpora import read_utf8, score
from data import TokenDataset, decode, encode, get_tokenizer
from generate import DECODERS, ContextTooLong, RefusionSettings, check_attention
from prepare import prepare
from pretrained import chat_parts, from_pretrained, hf_special_ids, undecodable_ids

# -----------------------------------------------------------------------------
# default config
out_dir = "out"            # directory holding ckpt.pt (written by train.py) ...
init_from = ""             # ... or a Hugging Face model folder (Qwen3, SmolLM2, the ReFusion release) to decode with
dtype = "float32"          # the weights in float32 or bfloat16 (half the memory)
chat = False               # wrap the prompt in the model's chat template (user turn, then the assistant header)
prompt = ""                # decode this text ...
prompt_file = ""           # ... or the text of this file (a pipe too; - for standard input) ...
num_samples = 3            # ... or this many prompts from the validation split
method = ""                # refusion, ar or mdm; empty: the one the checkpoint was trained for
max_new_tokens = 128       # at most this many tokens are returned (refusion decodes whole blocks of slots)
slot_size = 8              # refusion: tokens per slot (S)
serial_num_blocks = 4             # refusion: serial blocks, each of the same whole number of slots
slot_threshold = 0.9       # refusion: a slot is planned when its first draft's probability exceeds this
token_threshold = 0.3      # refusion: a draft token is accepted when its probability exceeds this
infill = "paper"           # refusion: 'paper' (each infill round forces its masked draft) or 'ar' (the next-token prediction, SPEC 4.1)
steps = 0                  # mdm: denoising steps; 0 = one token per step
block_length = 0           # mdm: semi-autoregressive block length; 0 = the whole generation
temperature = 0.0          # 0: greedy; above 0: sample (Gumbel-max)
seed = 1337                # prompt i is sampled from a torch.Generator seeded with seed + i
device = "cpu"             # cpu, cuda, cuda:N or mps
json = False               # one JSON object per sample instead of text
show = False               # redraw the response after every decoding step (masked tokens as ░)
plot = ""                  # draw the first prompt's decode into this PNG (matplotlib): the step of each token
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())


def load_model(cfg):
    """The model to decode with: --init_from=FOLDER (pretrained.from_pretrained) or out_dir's checkpoint.

    Returns (model in eval mode on cfg["device"], tokenizer, ids {"eos_ids", "mask_id", "pad_id",
    "undecodable_ids"}, the objective it was trained with, the checkpoint dict or None for a folder).
    eos_ids is a tuple: a checkpoint's EOS, or a folder's (<|im_end|>, <|endoftext|>), whose objective
    is "refusion" when it has a
    mask token, else "ar" (a plain Qwen3 or SmolLM2). undecodable_ids: the model's rows its tokenizer
    has no token for (pretrained.undecodable_ids), never generated. Raises FileNotFoundError / ValueError
    naming the problem (a tokenizer id the model has no row for among them).
    """
    if cfg["dtype"] not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype={cfg['dtype']!r}: choose float32 or bfloat16")
    dtype = getattr(torch, cfg["dtype"])
    if cfg["init_from"]:
        folder = source = cfg["init_from"]
        model = from_pretrained(folder, dtype=dtype).to(cfg["device"])
        eos_ids, mask_id, pad_id = hf_special_ids(folder)
        ids = {"eos_ids": eos_ids, "mask_id": mask_id, "pad_id": pad_id}
        enc, objective, ckpt = get_tokenizer(f"hf:{folder}"), "ar" if mask_id is None else "refusion", None
    else:
        ckpt = load_checkpoint(cfg["out_dir"], cfg["device"])
        meta = ckpt["meta"]
        ids = decoder_ids(meta)
        model = model_from_checkpoint(ckpt, cfg["device"]).to(dtype)
        enc, objective, source = get_tokenizer(meta["tokenizer"]), ckpt["config"]["objective"], cfg["out_dir"]
    ids["undecodable_ids"] = undecodable_ids(enc, model.config.vocab_size, f"the model in {source}",
                                             (*ids["eos_ids"], ids["mask_id"], ids["pad_id"]))
    return model, enc, ids, objective, ckpt


def decoder_settings(cfg):
    """The settings object of cfg["method"] built from cfg's knobs, which checks every knob (no
    model needed, so the command line checks them before loading any weights): a RefusionSettings,
    DecodeSettings or MDMSettings (generate.py; SPEC section 4 and its baseline decoders).
    Raises ValueError for an unknown method or invalid settings."""
    if cfg["method"] not in DECODERS:
        raise ValueError(f"--method={cfg['method']!r}: choose one of {', '.join(DECODERS)}")
    Settings = DECODERS[cfg["method"]][1]
    knobs = {f.name: cfg[f.name] for f in fields(Settings)}
    if cfg["method"] == "mdm":  # 0: one token per step, one block
        knobs.update(steps=cfg["steps"] or None, block_length=cfg["block_length"] or None)
    return Settings(**knobs)


def fit_mdm_canvas(cfg, ckpt, explicit):
    """An MDM checkpoint trained on canvases of G tokens (train.py --gen_length: answers padded with EOS
    to G, LLaDA's layout) is decoded on a canvas of G: cfg["max_new_tokens"] becomes G, with a note,
    unless it was given explicitly as another value, which is refused (the model never saw that
    layout). Raises ValueError."""
    G = (ckpt or {}).get("config", {}).get("gen_length", 0)
    if not G or cfg["max_new_tokens"] == G:
        return
    if explicit:
        raise ValueError(f"--max_new_tokens={cfg['max_new_tokens']}: this MDM was trained to fill canvases of "
                         f"{G} tokens (answers padded with EOS to {G}, train.py --gen_length), and a canvas of "
                         f"another length is a layout it never saw; use --max_new_tokens={G}")
    print(f"note: decoding on the canvas of {G} tokens this MDM was trained for (--max_new_tokens={G})",
          file=sys.stderr)
    cfg["max_new_tokens"] = G


def make_decoder(cfg, model, ids, generator):
    """(decode: prompt ids -> Generation, its settings) for cfg["method"] and cfg's knobs; decode
    raises a prompt too long for the context as a ValueError in the knobs' words (context_words).

    ids: {"eos_ids": a tuple of ids, "mask_id", "pad_id", optionally "undecodable_ids"}. The
    settings object checks every knob when it is built, before any data is prepared. The mask and pad
    ids, and the ids the tokenizer cannot decode (a model's padded rows), are never generated (unless
    one is an EOS, as Qwen's <|endoftext|>, its pad id, is).
    Raises ValueError for an unknown method, a method the model's attention does not support, a
    ReFusion decode without a mask token, or invalid settings.
    """
    settings = decoder_settings(cfg)
    check_attention(model, cfg["method"])
    if cfg["method"] != "ar" and ids["mask_id"] is None:
        raise ValueError(f"--method={cfg['method']}: this model has no mask token (a plain Qwen3 was never "
                         "trained to fill masks); use --method=ar, or fine-tune it with train.py first")
    generate = DECODERS[cfg["method"]][0]
    banned = tuple(i for i in (ids["mask_id"], ids["pad_id"], *ids.get("undecodable_ids", ()))
                   if i is not None and i not in ids["eos_ids"])
    kwargs = dict(eos_ids=ids["eos_ids"], banned_ids=banned)
    if cfg["method"] != "ar":
        kwargs["mask_id"] = ids["mask_id"]
    decode_fn = partial(generate, model, settings=settings, generator=generator, **kwargs)

    def run(prompt, **overrides):
        try:
            return decode_fn(prompt, **overrides)
        except ContextTooLong as error:
            raise ValueError(context_words(error)) from None
    return run, settings


def context_words(error):
    """A ContextTooLong from a decoder (prompt + generation longer than the context), in the words of
    the knobs the user sets: how max_new_tokens became the generation length, and what to lower."""
    s, how, fix = error.settings, "", "lower max_new_tokens"
    if isinstance(s, RefusionSettings):
        how = (f", max_new_tokens={s.max_new_tokens} rounded up to {s.serial_num_blocks} serial block(s) of whole "
               f"{s.slot_size}-token slots")
        fix = "lower max_new_tokens, slot_size or serial_num_blocks"
    return (f"prompt ({error.prompt_len} tokens) + generation ({s.gen_len} tokens{how}) exceeds the model's "
            f"context of {error.limit} positions; shorten the prompt or {fix}")


def chat_prompt(enc, text):
    """Token ids of a user turn holding `text`, then the assistant's header, in the model's chat template
    (pretrained.chat_parts: the folder's template, or Qwen's ChatML), as the ReFusion release's evaluation
    builds its prompts (apply_chat_template with add_generation_prompt). The template's markers are
    special ids; `text` stays plain text. Raises ValueError for a tokenizer with no chat template."""
    return [i for part in chat_parts(enc, text) for i in ([part] if isinstance(part, int) else encode(enc, part))]


def load_prompts(cfg, enc, val_data, gen_len, block_size):
    """Prompts (lists of token ids) from --prompt, --prompt_file (in the chat template with --chat)
    or evenly spread over the val split. Raises ValueError / FileNotFoundError naming the problem."""
    if cfg["prompt"] and cfg["prompt_file"]:
        raise ValueError("give either --prompt or --prompt_file, not both")
    wrap = partial(chat_prompt, enc) if cfg["chat"] else partial(encode, enc)
    if cfg["prompt_file"]:
        return [wrap(read_utf8(cfg["prompt_file"], f"--prompt_file={cfg['prompt_file']}"))]
    if cfg["prompt"]:
        return [wrap(cfg["prompt"])]
    if val_data is None:
        raise ValueError("--init_from=FOLDER has no validation split: give --prompt or --prompt_file")
    fits = [i for i in range(len(val_data)) if len(val_data.sample(i)[0]) + gen_len <= block_size]
    if not fits:
        raise ValueError(f"no validation prompt leaves room for {gen_len} new tokens in the context of "
                         f"{block_size}; lower --max_new_tokens")
    if cfg["num_samples"] > len(fits):
        print(f"note: {len(fits)} of the {len(val_data)} validation prompts leave room for {gen_len} new tokens; "
              f"decoding those {len(fits)}, not --num_samples={cfg['num_samples']}", file=sys.stderr)
    picks = [fits[int(j)] for j in torch.linspace(0, len(fits) - 1, min(cfg["num_samples"], len(fits)))]
    return [val_data.sample(i)[0] for i in picks]


def validation_split(ckpt):
    """The validation split the checkpoint was trained with, prepared anew (as training did) when
    it was moved or damaged."""
    data_dir, tcfg = ckpt.get("data_dir", ""), ckpt["config"]  # absolute: the sampler runs from any directory
    try:
        return TokenDataset(data_dir, "val")
    except (FileNotFoundError, ValueError):
        data_root = os.path.dirname(data_dir) if os.path.isdir(data_dir) else tcfg["data_root"]
        return TokenDataset(prepare(tcfg["dataset"], tcfg["tokenizer"], tcfg["block_size"], data_root,
                                    tcfg.get("too_long", "skip")), "val")


EOS_MARK = "<EOS>"  # how --show draws the EOS that ends a response


def prompt_generator(device, seed, i):
    """The random stream that prompt i is decoded with (temperature > 0): a torch.Generator of its
    own, seeded with seed + i, so a sample depends neither on a warm-up decode nor on the prompts
    decoded before it, and seed s decodes the first prompt as the API does with
    generator=torch.Generator().manual_seed(s)."""
    return torch.Generator(device).manual_seed(seed + i)


class LiveTrace:
    """--show: after every decoding step, redraw the response with still-masked tokens as '░'.

    Called with each step's committed (position, token) pairs; positions are true positions, so a
    ReFusion step fills its slots in place, out of order. Each run of committed neighbours is
    decoded together, so a character of several tokens (UTF-8 bytes, BPE pieces) is drawn whole;
    EOS is drawn as EOS_MARK, and nothing after it or past max_new_tokens (where the decoder cuts
    the response it returns), so the last frame shows the returned response. Frames go to stderr
    (stdout keeps the results, e.g. --json); on a terminal each frame replaces the last.
    """

    def __init__(self, enc, prompt, max_new_tokens, eos_ids, delay=0.25):
        self.enc, self.prompt, self.delay = enc, prompt, delay
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.tty = sys.stderr.isatty()
        self.filled, self.step = {}, 0

    def cut(self):
        """(end, eos): the response is drawn up to position `end`, max_new_tokens after the prompt or,
        when eos is True, its first committed EOS, as the decoder cuts the response it returns."""
        limit = len(self.prompt) + self.max_new_tokens
        eos = min((p for p, t in self.filled.items() if t in self.eos_ids), default=limit)
        return min(eos, limit), eos < limit

    def response(self):
        """The response as drawn now (str): committed runs decoded, '░' per masked token, then EOS_MARK."""
        (end, eos), parts = self.cut(), []
        for committed, run in groupby(range(len(self.prompt), end), key=self.filled.__contains__):
            run = list(run)
            parts.append(decode(self.enc, [self.filled[p] for p in run]) if committed else "░" * len(run))
        return "".join(parts) + (EOS_MARK if eos else "")

    def __call__(self, step):
        self.step += 1
        self.filled.update(step)
        P = len(self.prompt)
        end, _ = self.cut()
        spans = sorted(p - P for p, _ in step)
        clear = "\033[H\033[J" if self.tty else ""
        print(f"{clear}{decode(self.enc, self.prompt)}{self.response()}\n"
              f"step {self.step}: {len(step)} token(s) committed at response offsets {spans[0]}..{spans[-1]}"
              f" ({sum(p in self.filled for p in range(P, end))}/{end - P} filled)\n", file=sys.stderr, flush=True)
        if self.tty:
            time.sleep(self.delay)


def check_plot_path(path):
    """Refuse a --plot path whose directory does not exist, before any decoding (FileNotFoundError)."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--plot={path}: the directory {folder} does not exist; create it or pick another path")


MISMATCH_NOTES = {
    ("ar", "refusion"): "a refusion model never learns a slot's first token as a next token (SPEC section 4, "
                        "known limit (a)), so plain next-token decoding does poorly; for left-to-right decoding "
                        "use --method=refusion --serial_num_blocks=<number of slots>",
    ("refusion", "ar"): "an ar model was never trained to predict mask tokens, so its plan drafts are poor and "
                        "ReFusion decoding falls back to about two forward passes per token; use --method=ar",
}


def check_config(cfg):
    """Refuse settings that cannot work before any weights are read: the device, the seed, the number
    of samples and, when --method is given, the decoder's settings (SPEC section 4). Raises
    ConfigError or ValueError naming the flag. config/sample_*.py pass it (tests/test_config.py)."""
    check_device(cfg["device"])
    check_seed(cfg)
    if cfg["num_samples"] <= 0:
        raise ValueError(f"--num_samples={cfg['num_samples']}: ask for at least one validation prompt")
    if cfg["method"]:
        decoder_settings(cfg)  # bad decoder settings fail before the weights are read


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    check_config(cfg)
    if cfg["plot"]:
        from figures import cell_text, plot_decode, pyplot  # matplotlib only when asked for
        pyplot()
        check_plot_path(cfg["plot"])
    model, enc, ids, objective, ckpt = load_model(cfg)
    cfg["method"] = cfg["method"] or objective
    if cfg["method"] == "mdm":
        fit_mdm_canvas(cfg, ckpt, "max_new_tokens" in explicit_keys(cfg, DEFAULTS, argv))
    run, settings = make_decoder(cfg, model, ids, torch.Generator(cfg["device"]))  # the warm-up's generator
    if (cfg["method"], objective) in MISMATCH_NOTES:
        print("note: " + MISMATCH_NOTES[cfg["method"], objective], file=sys.stderr)
    val_data = None if cfg["prompt"] or cfg["prompt_file"] or ckpt is None else validation_split(ckpt)
    prompts = load_prompts(cfg, enc, val_data, settings.gen_len, model.config.block_size)
    run(prompts[0][:8])  # warm-up: the first forward passes pay one-time costs
    check = partial(score, ckpt["config"]["dataset"]) if ckpt else lambda *_: None
    outs, verdicts = [], []
    for i, prompt in enumerate(prompts):
        live = LiveTrace(enc, prompt, settings.max_new_tokens, ids["eos_ids"]) if cfg["show"] else None
        out = run(prompt, generator=prompt_generator(cfg["device"], cfg["seed"], i), on_step=live)
        text = decode(enc, [t for t in out.tokens if t not in ids["eos_ids"]])
        if cfg["plot"] and i == 0:
            knobs = ", ".join(f"{f.name}={getattr(settings, f.name)}" for f in fields(settings))
            title = (f"--method={cfg['method']} ({knobs})\n{len(out.tokens)} tokens in {out.nfe} forward passes, "
                     f"TPF {out.tpf:.2f}; prompt: {decode(enc, prompt)[-60:]!r}")
            texts = {p: cell_text(enc, t, ids["eos_ids"]) for step in out.trace for p, t in step}
            pyplot().close(plot_decode(out, len(prompt), cfg["plot"], title, texts, settings.gen_len))
            print(f"note: drew the decode of the first prompt into {cfg['plot']}", file=sys.stderr)
        scores = check(decode(enc, prompt), text)
        verdict = None if scores is None else next(iter(scores.items()))     # (metric, 1.0 or 0.0)
        outs.append(out)
        verdicts.append(verdict)
        if cfg["json"]:
            print(dumps({"prompt": decode(enc, prompt), "text": text, **out.stats(),
                         **({} if verdict is None else {verdict[0]: bool(verdict[1])})}))
            continue
        print("=" * 80)
        print(decode(enc, prompt) + text)
        print("-" * 80)
        s = out.stats()
        print(("" if verdict is None else f"{VERDICT[verdict[1] == 1.0]} ({verdict[0]}): ") +
              f"{s['tokens']} tokens in {s['nfe']} forward passes (NFE), {s['tpf']:.2f} tokens per forward "
              f"(TPF), {s['seconds']:.3f} s, {s['tokens_per_s']:.1f} tokens/s")
    if not cfg["json"] and len(prompts) > 1:
        print("=" * 80)
        print(summary(outs, verdicts))


VERDICT = {True: "right", False: "wrong"}


def summary(outs, verdicts):
    """One line over all samples: how many were right (where the data set has a check), and tokens,
    forward passes, TPF and tokens/s over all of them (TPF as everywhere: tokens / NFE)."""
    tokens, nfe, seconds = sum(len(o.tokens) for o in outs), sum(o.nfe for o in outs), sum(o.seconds for o in outs)
    checked = [v for v in verdicts if v is not None]
    right = f"{sum(v[1] == 1.0 for v in checked)} of {len(checked)} right ({checked[0][0]}); " if checked else ""
    return (f"{len(outs)} samples: {right}{tokens} tokens in {nfe} forward passes, {tokens / max(nfe, 1):.2f} tokens "
            f"per forward (next-token decoding: 1.00), {tokens / max(seconds, 1e-9):.1f} tokens/s")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
