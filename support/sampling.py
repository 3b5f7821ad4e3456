"""
sampler.py's command line besides the decoders.

    check_sample_config(cfg)   refuse settings that cannot work, before any weights are read
    load_model(cfg)            a checkpoint (out_dir) or a Hugging Face folder (--init_from)
    fit_mdm_layout, note_mismatch, compares_next_token, warm_up, check_plot_path   main's steps
    load_prompts(cfg, ...)     --prompt, --prompt_file (--chat: chat template) or validation prompts
    decode_prompts(cfg, ...)   decode them (--batch_size at a time) and print each, then a summary
    LiveTrace                  --show: the response redrawn after every decoding step
    Report                     each sample's response, verdict and speed, then the summary line
"""


import os
import sys
import time
from dataclasses import fields
from functools import partial
from itertools import groupby
from json import dumps

import torch

from configurator import check_context, check_device, check_seed
from model import ModelConfig
from support.batching import generate_batch, prompt_generator
from support.chat import chat_prompt
from support.compiled import CompiledModel, check_compile
from support.checkpoint import checkpoint_path, decoder_ids, load_checkpoint, model_from_checkpoint
from support.corpora import score
from support.data_files import read_utf8
from support.drawing import animate_decode, cell_text, plot_decode, picture_path, pyplot
from support.hardware import settle_dtype
from support.hf_folder import from_pretrained, hf_model_config
from support.hf_tokenizer import hf_special_ids, undecodable_ids
from support.prepare import TokenDataset, prepare
from support import tokenizer
from support.tokenizer import encode_prompt, get_tokenizer


# -----------------------------------------------------------------------------
# the checks, the model and the prompts

def check_sample_config(cfg):
    """Refuse sampler.py settings that cannot work, before any weights are read: device, seed,
    num_samples, batch_size, --show, --compile. Raises ConfigError or ValueError naming the flag."""
    check_device(cfg["device"])
    check_seed(cfg)
    if cfg["num_samples"] <= 0:
        raise ValueError(f"--num_samples={cfg['num_samples']}: ask for at least one validation "
                         "prompt")
    if cfg["batch_size"] < 1:
        raise ValueError(f"--batch_size={cfg['batch_size']}: decode at least one prompt at a time")
    if cfg["batch_size"] > 1 and cfg["show"]:
        raise ValueError("--show redraws one decode at a time; use it with --batch_size=1")
    if cfg["batch_size"] > 1 and cfg["compile"]:
        raise ValueError("--compile decodes one prompt at a time; use it with --batch_size=1")
    check_compile(cfg)


def warm_up(cfg, model, decode, prompts, settings):
    """Pay decoding's one-time costs before the timed decodes: decode prompts[0][:8], or with
    --compile decode every prompt once through a CompiledModel (its graphs and seconds on stderr).
    settings: the DecodeSettings whose generation every prompt must leave room for. Returns the
    model to decode with: model, or its CompiledModel. Raises ContextTooLong naming the length of a
    prompt that leaves too little."""
    # every prompt's own length first: a cut of one fits wherever the whole prompt does
    for prompt in prompts:
        check_context(model, len(prompt), settings)
    if not cfg["compile"]:
        decode(model, prompts[0][:8])
        return model
    model = model if isinstance(model, CompiledModel) else CompiledModel(model)
    graphs, seconds = model.compile_for(decode, prompts)
    print(f"--compile: {graphs} graphs compiled in {seconds:.1f} s (a first decode of the "
          f"{len(prompts)} prompts, not timed)", file=sys.stderr)
    return model


def load_model(cfg):
    """The model to decode with: --init_from=FOLDER (a Hugging Face folder) or a checkpoint
    (out_dir's, or a ckpt.pt or out_dir that --init_from names). Settles cfg["dtype"] (auto).

    Returns (model in eval mode on cfg["device"], tokenizer, ids, objective, ckpt dict or None for a
    folder). ids: {"eos_ids": tuple, "mask_id", "pad_id", "undecodable_ids": the model's rows its
    tokenizer has no token for, never generated}. A folder's objective is "refusion" when it has a
    mask token, else "ar". Raises FileNotFoundError / ValueError naming the problem."""
    folder = cfg["init_from"]
    # what stands at config.json or ckpt.pt, of whatever kind (load_checkpoint names a FIFO)
    if folder and not os.path.lexists(os.path.join(folder, "config.json")) and (
            os.path.isfile(folder) or os.path.lexists(checkpoint_path(folder))):
        cfg["out_dir"], cfg["init_from"] = folder, ""  # a checkpoint, as train.py's --init_from
    if cfg["init_from"]:
        folder = source = cfg["init_from"]
        settle_dtype(cfg, hf_model_config(folder))  # auto: bf16 where it pays
        model = from_pretrained(folder, dtype=getattr(torch, cfg["dtype"])).to(cfg["device"])
        eos_ids, mask_id, pad_id = hf_special_ids(folder)
        ids = {"eos_ids": eos_ids, "mask_id": mask_id, "pad_id": pad_id}
        objective = "ar" if mask_id is None else "refusion"
        enc, ckpt = get_tokenizer(f"hf:{folder}"), None
    else:
        ckpt = load_checkpoint(cfg["out_dir"], cfg["device"])
        meta = ckpt["meta"]
        ids = decoder_ids(meta)
        settle_dtype(cfg, ModelConfig(**ckpt["model_args"]))  # auto: bf16 where it pays
        model = model_from_checkpoint(ckpt, cfg["device"]).to(getattr(torch, cfg["dtype"]))
        name = cfg.get("tokenizer") or meta["tokenizer"]
        if name.startswith("hf:") and not os.path.isdir(os.path.expanduser(name[3:])):
            raise FileNotFoundError(
                f"the checkpoint in {cfg['out_dir']} records its tokenizer as {name}, a folder "
                "that is no longer there (moved or deleted): give the folder it was fine-tuned "
                "from where it is now, --tokenizer=hf:FOLDER")
        enc, objective, source = get_tokenizer(name), ckpt["config"]["objective"], cfg["out_dir"]
    ids["undecodable_ids"] = undecodable_ids(enc, model.config.vocab_size, f"the model in {source}",
                                             (*ids["eos_ids"], ids["mask_id"], ids["pad_id"]))
    return model, enc, ids, objective, ckpt


def fit_mdm_layout(cfg, ckpt, explicit):
    """Set cfg["mdm_shift"] and, for an MDM trained with --gen_length=G, cfg["max_new_tokens"] = G
    (with a note) from the checkpoint's training (SPEC section 3). explicit: max_new_tokens was
    given; another value than G is then refused with ValueError."""
    trained = (ckpt or {}).get("config", {})
    is_mdm = trained.get("objective") == "mdm"
    cfg["mdm_shift"] = bool(trained.get("mdm_shift", False)) and is_mdm
    G = trained.get("gen_length", 0) if is_mdm else 0
    if not G or cfg["max_new_tokens"] == G:
        return
    if explicit:
        raise ValueError(f"--max_new_tokens={cfg['max_new_tokens']}: this MDM was trained to fill "
                         f"canvases of {G} tokens (answers padded with EOS to {G}, train.py "
                         "--gen_length), and a canvas of another length is a layout it never saw; "
                         f"use --max_new_tokens={G}")
    print(f"note: decoding on the canvas of {G} tokens this MDM was trained for "
          f"(--max_new_tokens={G})", file=sys.stderr)
    cfg["max_new_tokens"] = G


MISMATCH_NOTES = {
    ("next_token", "refusion"): "a refusion model trained with the paper's objective never learns "
                        "a slot's first token as a next token (SPEC section 4, known limit (a); "
                        "slot_end_labels and ar_fraction train it), so plain next-token decoding "
                        "does poorly; for left-to-right decoding use --method=refusion "
                        "--serial_num_blocks=<number of slots>",
    ("refusion", "ar"): "an ar model was never trained to predict mask tokens, so its plan "
                        "drafts are poor and ReFusion decoding falls back to about two forward "
                        "passes per token; use --method=next_token",
    ("exact", "refusion"): "verify=exact writes this model's own next-token decoding, and a "
                           "refusion model trained with the paper's objective never learns a "
                           "slot's first token as a next token (SPEC section 4, known limit (a); "
                           "slot_end_labels and ar_fraction train it): expect poor answers",
    ("exact", "ar"): "an ar model was never trained to predict mask tokens, so verify=exact's "
                     "drafts are rejected and it writes about one token a pass, as next-token "
                     "decoding does, in wider passes; use --method=next_token",
}


def note_mismatch(method, objective, ckpt=None, verify="paper"):
    """Note on stderr a method (with verify="exact": "exact") the model's training did not prepare
    it for (MISMATCH_NOTES). ckpt: the checkpoint dict, or None."""
    trained = (ckpt or {}).get("config", {})
    kept_next_tokens = trained.get("slot_end_labels") or trained.get("ar_fraction", 0) > 0
    method = "exact" if method == "refusion" and verify == "exact" else method
    if (method, objective) in MISMATCH_NOTES and not (method in ("next_token", "exact")
                                                      and kept_next_tokens):
        print("note: " + MISMATCH_NOTES[method, objective], file=sys.stderr)


def compares_next_token(cfg, n_prompts, asked):
    """Whether the summary line also gives next-token decoding of the same prompts
    (--compare_next_token). asked: the flag was given explicitly: a note says why it cannot."""
    if not cfg["compare_next_token"]:
        return False
    missing = [why for why, fails in [("--method=refusion", cfg["method"] != "refusion"),
                                      ("more than one prompt", n_prompts < 2),
                                      ("text output (not --json)", cfg["json"]),
                                      ("no --show (its drawing is timed with the decode)",
                                       cfg["show"])] if fails]
    if missing and asked:
        print(f"note: --compare_next_token compares a summary line, which needs "
              f"{' and '.join(missing)}; decoding without it", file=sys.stderr)
    return not missing


MAX_TOKEN_BYTES = 256  # more than any token of the tokenizers read here spells (GPT-2's: 128)


def load_prompts(cfg, enc, ckpt, gen_length, block_size):
    """Prompts (lists of token ids) from --prompt, --prompt_file (in the chat template with --chat)
    or the first num_samples validation prompts that leave room for gen_length new tokens in
    block_size (TokenDataset.first_fitting). Raises ValueError / FileNotFoundError naming the
    problem."""
    if cfg["prompt"] and cfg["prompt_file"]:
        raise ValueError("give either --prompt or --prompt_file, not both")
    wrap = partial(chat_prompt, enc) if cfg["chat"] else partial(encode_prompt, enc)
    if cfg["prompt_file"]:
        # a token is at most MAX_TOKEN_BYTES bytes, so no longer text fits the context
        limit = block_size * MAX_TOKEN_BYTES
        return [wrap(read_utf8(cfg["prompt_file"], f"--prompt_file={cfg['prompt_file']}", limit))]
    if cfg["prompt"]:
        return [wrap(with_the_datas_line_end(cfg, enc, ckpt))]
    if ckpt is None:
        raise ValueError("--init_from=FOLDER has no validation split: give --prompt or "
                         "--prompt_file")
    val_data = validation_split(ckpt)
    fits = val_data.first_fitting(cfg["num_samples"], gen_length, block_size)
    if not fits:
        raise ValueError(f"no validation prompt leaves room for {gen_length} new tokens in the "
                         f"context of {block_size}; lower --max_new_tokens")
    if len(fits) < cfg["num_samples"]:
        print(f"note: {len(fits)} of the {len(val_data)} validation prompts leave room for "
              f"{gen_length} new tokens; decoding those {len(fits)}, not "
              f"--num_samples={cfg['num_samples']}", file=sys.stderr)
    return [prompt for prompt, _ in fits]


def with_the_datas_line_end(cfg, enc, ckpt):
    """--prompt's text, with a newline added (and a note) when the first 20 validation prompts all
    end with one: a model shown a prompt cut before its newline writes the rest of the line. The
    text as given where the data cannot be read."""
    text = cfg["prompt"]
    if ckpt is None or cfg["chat"] or text.endswith("\n"):
        return text
    try:
        val_data = validation_split(ckpt)
    except (FileNotFoundError, ValueError):
        return text
    seen = [tokenizer.decode(enc, val_data.sample(i)[0]) for i in range(min(len(val_data), 20))]
    if seen and all(p.endswith("\n") for p in seen):
        print("note: the model was trained on prompts that end with a newline, so one was added "
              "to --prompt", file=sys.stderr)
        return text + "\n"
    return text


def validation_split(ckpt):
    """The checkpoint's validation TokenDataset, prepared anew when it was moved or damaged."""
    # absolute: the sampler runs from anywhere
    data_dir, tcfg = ckpt.get("data_dir", ""), ckpt["config"]
    try:
        return TokenDataset(data_dir, "val")
    except (FileNotFoundError, ValueError):
        data_root = os.path.dirname(data_dir) if os.path.isdir(data_dir) else tcfg["data_root"]
        return TokenDataset(prepare(tcfg["dataset"], tcfg["tokenizer"], tcfg["block_size"],
                                    data_root, tcfg.get("too_long", "skip")), "val")

EOS_MARK = "<EOS>"  # how --show draws the EOS that ends a response


class LiveTrace:
    """--show: after every decoding step, redraw the response on stderr, masked tokens as '░'.

    Called with each step's committed (position, token) pairs, positions in the sequence. Runs of
    committed neighbours are decoded together; the response ends at EOS (EOS_MARK) or
    max_new_tokens, as the decoder cuts it. Off a terminal each step is one line: what it committed.
    """

    def __init__(self, enc, prompt, max_new_tokens, eos_ids):
        self.enc, self.prompt = enc, prompt
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.tty = sys.stderr.isatty()
        self.filled, self.step = {}, 0

    def cut(self):
        """(end, eos): the response ends at position `end`, its first committed EOS when eos is
        True, else max_new_tokens after the prompt."""
        limit = len(self.prompt) + self.max_new_tokens
        eos = min((p for p, t in self.filled.items() if t in self.eos_ids), default=limit)
        return min(eos, limit), eos < limit

    def response(self):
        """The response as drawn now (str): committed runs decoded, '░' a masked token, EOS_MARK."""
        (end, eos), parts = self.cut(), []
        for committed, run in groupby(range(len(self.prompt), end), key=self.filled.__contains__):
            run = list(run)
            parts.append(tokenizer.decode(self.enc, [self.filled[p] for p in run]) if committed
                         else "░" * len(run))
        return "".join(parts) + (EOS_MARK if eos else "")

    def __call__(self, step):
        self.step += 1
        self.filled.update(step)
        P = len(self.prompt)
        end, _ = self.cut()
        spans = sorted(p - P for p, _ in step)
        line = (f"step {self.step}: {len(step)} token(s) committed at response offsets "
                f"{spans[0]}..{spans[-1]} ({sum(p in self.filled for p in range(P, end))}/{end - P}"
                " filled)")
        if not self.tty:  # one line a step: its committed runs of neighbours, decoded
            runs = groupby(enumerate(sorted(step)), key=lambda k_pt: k_pt[1][0] - k_pt[0])
            texts = [tokenizer.decode(self.enc, [t for _, (_, t) in run]) for _, run in runs]
            print(f"{line}: {' | '.join(map(repr, texts))}", file=sys.stderr, flush=True)
            return
        print(f"\033[H\033[J{tokenizer.decode(self.enc, self.prompt)}{self.response()}\n{line}\n",
              file=sys.stderr, flush=True)
        time.sleep(0.25)  # a quarter second a frame


def check_plot_path(cfg):
    """Check --plot before any weights are read: matplotlib and a writable .png or .gif path
    (support.drawing.picture_path), which cfg["plot"] becomes. Raises ValueError."""
    pyplot()
    cfg["plot"] = picture_path(cfg["plot"], "--plot", (".png", ".gif"))


def decode_prompts(cfg, model, enc, ids, ckpt, prompts, settings, decode, next_token=None):
    """Decode the prompts (lists of ids) with decode (sampler.make_decoder's), batch_size at a time,
    each with its own prompt_generator; print every sample (Report), then the summary. next_token:
    a decoder to run on each batch right after, for the summary's comparison, or None."""
    report, n = Report(cfg, enc, ids, ckpt), cfg["batch_size"]

    def run(decoder, batch, b, live=None):
        generators = [prompt_generator(cfg["device"], cfg["seed"], b + i)
                      for i in range(len(batch))]
        if n == 1:  # a prompt at a time, as the decoders run
            return [decoder(model, batch[0], generator=generators[0], on_step=live)]
        return generate_batch(model, decoder, batch, n, generators)

    for b in range(0, len(prompts), n):
        batch = prompts[b:b + n]
        live = (LiveTrace(enc, batch[0], settings.max_new_tokens, ids["eos_ids"])
                if cfg["show"] else None)
        outs = report.timed(lambda: run(decode, batch, b, live))
        if cfg["plot"] and b == 0:
            plot_first_decode(cfg, enc, ids, settings, prompts[0], outs[0])
        for prompt, out in zip(batch, outs):
            report.sample(prompt, out)
        if next_token:
            outs = report.timed(lambda: run(next_token, batch, b), next_token=True)
            for prompt, out in zip(batch, outs):
                report.next_token(prompt, out)
    report.summary()


def plot_first_decode(cfg, enc, ids, settings, prompt, out):
    """--plot: draw the first prompt's Generation `out` into cfg["plot"] (a PNG or a GIF)."""
    knobs = ", ".join(f"{f.name}={getattr(settings, f.name)}" for f in fields(settings))
    title = (f"--method={cfg['method']} ({knobs})\n{len(out.tokens)} tokens in {out.nfe} forward "
             f"passes, TPF {out.tpf:.2f}; prompt: {tokenizer.decode(enc, prompt)[-60:]!r}")
    texts = {p: cell_text(enc, t, ids["eos_ids"]) for step in out.trace for p, t in step}
    if cfg["plot"].lower().endswith(".gif"):
        animate_decode(out, len(prompt), cfg["plot"], title, texts, settings.gen_length)
    else:
        pyplot().close(plot_decode(out, len(prompt), cfg["plot"], title, texts,
                                   settings.gen_length))
    print(f"note: drew the decode of the first prompt into {cfg['plot']}", file=sys.stderr)


VERDICT = {True: "right", False: "wrong"}


def stats(out):
    """A Generation's tokens, nfe, tpf, seconds, tokens_per_s and cache_bytes (dict), as --json
    prints them."""
    return {"tokens": len(out.tokens), "nfe": out.nfe, "tpf": round(out.tpf, 3),
            "seconds": round(out.seconds, 4), "tokens_per_s": round(out.tokens_per_s, 2),
            "cache_bytes": out.cache_bytes}


class Report:
    """What sampler.py prints on stdout: per sample its prompt, response, verdict
    (support.corpora.score) and statistics, or with --json a JSON object; then the summary line."""

    def __init__(self, cfg, enc, ids, ckpt):
        self.enc, self.eos_ids, self.json = enc, ids["eos_ids"], cfg["json"]
        self.check = partial(score, ckpt["config"]["dataset"]) if ckpt else lambda *_: None
        self.decoded, self.next_tokens = [], []   # (Generation, verdict) of every sample
        self.seconds = {False: 0.0, True: 0.0}     # wall time of the decodes, next_token or not
        self.batched = cfg["batch_size"] > 1       # tokens/s over the wall time of the batches

    def timed(self, decode, next_token=False):
        """Run decode() (-> a list of Generations), adding its wall time to the summary's."""
        t0 = time.perf_counter()
        outs = decode()
        self.seconds[next_token] += time.perf_counter() - t0
        return outs

    def judge(self, prompt, out):
        """(the response's text without EOS, verdict: (metric, 1.0 or 0.0), or None without a
        check or where the check cannot judge the prompt: a note on stderr says why)."""
        text = tokenizer.decode(self.enc, [t for t in out.tokens if t not in self.eos_ids])
        try:
            scores = self.check(tokenizer.decode(self.enc, prompt), text)
        except Exception as e:  # a prompt of the user's own, not in the data set's form
            print(f"note: no verdict: the data set's check cannot judge this prompt ({e})",
                  file=sys.stderr)
            return text, None
        return text, None if scores is None else next(iter(scores.items()))

    def sample(self, prompt, out):
        """Print one decoded sample (prompt: ids; out: its Generation)."""
        text, verdict = self.judge(prompt, out)
        self.decoded.append((out, verdict))
        if self.json:
            print(dumps({"prompt": tokenizer.decode(self.enc, prompt), "text": text, **stats(out),
                         **({} if verdict is None else {verdict[0]: bool(verdict[1])})}))
            return
        print("=" * 80)
        print(tokenizer.decode(self.enc, prompt) + text)
        print("-" * 80)
        s = stats(out)
        print(("" if verdict is None else f"{VERDICT[verdict[1] == 1.0]} ({verdict[0]}): ") +
              f"{s['tokens']} tokens in {s['nfe']} forward passes (NFE), {s['tpf']:.2f} tokens per "
              f"forward (TPF), {s['seconds']:.3f} s, {s['tokens_per_s']:.1f} tokens/s")

    def next_token(self, prompt, out):
        """Record next-token decoding's Generation of the same prompt, for the summary line."""
        self.next_tokens.append((out, self.judge(prompt, out)[1]))

    def summary(self):
        """Print the summary line (more than one sample, no --json)."""
        if self.json or len(self.decoded) < 2:
            return
        print("=" * 80)
        print(summary(self.decoded, self.next_tokens, self.seconds if self.batched else None))


def totals(decoded, seconds=None):
    """(right-answers text, tokens, forward passes, tokens/s) over (Generation, verdict) pairs;
    tokens/s over `seconds` of wall time, or None: the decodes' own seconds."""
    tokens = sum(len(o.tokens) for o, _ in decoded)
    nfe = sum(o.nfe for o, _ in decoded)
    seconds = seconds or sum(o.seconds for o, _ in decoded)
    checked = [v for _, v in decoded if v is not None]
    right = (f"{sum(v[1] == 1.0 for v in checked)} of {len(checked)} right ({checked[0][0]}); "
             if checked else "")
    return right, tokens, nfe, tokens / max(seconds, 1e-9)


def summary(decoded, next_tokens=(), seconds=None):
    """The summary line (str): right answers, tokens, NFE, TPF and tokens/s over all samples, then
    those of next-token decoding, the speed-up and on how many samples the two decoders gave the
    same tokens. decoded, next_tokens: lists of (Generation, verdict). seconds: {False: the
    decodes' wall time, True: next-token decoding's}, or None: the sum of each decode's seconds."""
    seconds = seconds or {}
    right, tokens, nfe, speed = totals(decoded, seconds.get(False))
    line = (f"{len(decoded)} samples: {right}{tokens} tokens in {nfe} forward passes, "
            f"{tokens / max(nfe, 1):.2f} tokens per forward, {speed:.1f} tokens/s")
    if next_tokens:
        ar_right, ar_tokens, ar_nfe, ar_speed = totals(next_tokens, seconds.get(True))
        same = sum(a.tokens == b.tokens for (a, _), (b, _) in zip(decoded, next_tokens))
        line += (f"; next-token decoding (--method=next_token) of the same prompts: "
                 f"{ar_right}{ar_tokens} "
                 f"tokens in {ar_nfe} forward passes, {ar_speed:.1f} tokens/s; speed-up "
                 f"{speed / ar_speed:.2f}x; the same tokens on {same} of {len(decoded)}")
    return line
