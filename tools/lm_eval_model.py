"""
Our checkpoints and decoders as the lm-evaluation-harness model `refusion` (docs/evaluation.md):

    python -m tools.lm_eval_model --model refusion \\
        --model_args out_dir=out-quotes,method=refusion,slot_size=8 --tasks gsm8k
    python -m tools.lm_eval_model --model refusion \\
        --model_args init_from=smollm2,method=next_token --tasks arc_challenge

The command is lm_eval's own (lm_eval run --help) with the model registered; from Python,
`RefusionLM(out_dir=...)` is an lm_eval LM for lm_eval.simple_evaluate. The model args are
sampler.py's settings plus batch_size (else lm_eval's --batch_size); NOT_MODEL_ARGS are refused.
Generation requests run the project's decoders, their gen_kwargs read as lm_eval's own models read
them, their tokens, NFE, TPF and tokens/s printed to stderr; log-likelihoods are exact for a causal
model and refused for an MDM. Needs lm-eval==0.4.13 (requirements-test.txt).
"""

import json
import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

try:
    import yaml  # lm_eval reads its task files with PyYAML, so it is there wherever lm_eval is
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as missing:
    raise ImportError(f"tools.lm_eval_model needs lm-evaluation-harness ({missing}); install it "
                      "with: pip install lm-eval==0.4.13 (or pip install -r "
                      "requirements-test.txt)") from None

from configurator import check_attention, parse_args, run_cli
from support.batching import prompt_generator
from support.chat import chat_prompt
from support.checkpoint import decoder_ids, load_checkpoint
from support.files import write_atomic
from sampler import DEFAULTS, METHOD_OF, decoder_settings, make_decoder
from support.sampling import check_sample_config, fit_mdm_layout, load_model, validation_split
from support.tokenizer import decode, encode, encode_prompt, get_tokenizer


# sampler.py's settings the lm_eval model does not read (RefusionLM refuses them)
NOT_MODEL_ARGS = {"max_new_tokens", "prompt", "prompt_file", "num_samples", "compare_next_token",
                  "json", "show", "plot", "compile"}
# a request's gen_kwargs the model reads, as lm_eval's normalize_gen_kwargs reads them: until, the
# new tokens (max_gen_toks or an alias of it), do_sample and temperature; any other is refused
GEN_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens",
              "do_sample", "temperature")
# the new tokens of a request that names none (lm_eval's own models' default)
DEFAULT_MAX_GEN_TOKS = 256


def read_batch_size(batch_size):
    """The log-likelihood requests of one length in a forward pass: a whole number >= 1, given as
    an int or its digits (lm_eval's --batch_size is a string). Raises ValueError for anything
    else, and for lm_eval's "auto" (a search for the largest batch that fits): not implemented."""
    text = str(batch_size).strip()
    if text.startswith("auto"):
        raise ValueError(f"batch_size={text}: lm_eval's automatic batch size (the largest batch "
                         "that fits in memory) is not implemented by the model refusion, whose "
                         "batches are log-likelihood requests of one length; give a whole number, "
                         "e.g. --batch_size 16")
    if isinstance(batch_size, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"batch_size={text}: give a whole number >= 1 of log-likelihood "
                         "requests in one forward pass (lm_eval's --batch_size, or the model arg "
                         "batch_size), e.g. 16")
    return int(text)


def request_name(i, request):
    """'request i' and, where lm_eval's Instance names them, its task and document."""
    task = getattr(request, "task_name", None)
    if task is None:
        return f"request {i}"
    return f"request {i} ({task}, doc {request.doc_id})"


@register_model("refusion")
class RefusionLM(LM):
    """lm_eval's LM over a checkpoint (out_dir) or a Hugging Face folder (init_from), decoded by
    sampler.py's decoders. settings: sampler.py's settings as keywords; batch_size: the most
    log-likelihood requests of one length in a forward pass (read_batch_size). Raises ValueError
    or FileNotFoundError as sampler.py does."""

    def __init__(self, batch_size=1, **settings):
        super().__init__()
        self.batch_size = read_batch_size(batch_size)
        # sampler.py's settings that lm_eval's requests set, or that print a decode: refused, so
        # that none is taken and silently ignored
        ignored = sorted(set(settings) & NOT_MODEL_ARGS)
        if ignored:
            raise ValueError(f"model args {', '.join(ignored)}: not read by the lm_eval model "
                             "(a request's max_gen_toks sets max_new_tokens; the others print "
                             "or plot sampler.py's decodes, or compile them); leave them out")
        # the settings as sampler.py reads them: --key=value, checked the same way
        flags = [f"--{key}={value}" for key, value in settings.items()]
        self.cfg = parse_args(DEFAULTS, flags)
        check_sample_config(self.cfg)
        self.model, self.enc, self.ids, objective, ckpt = load_model(self.cfg)
        self.cfg["method"] = self.cfg["method"] or METHOD_OF[objective]
        check_attention(self.model, self.cfg["method"])
        # an MDM decodes in the layout it was trained on (its shift, its canvas), as sampler.py;
        # max_new_tokens is never a model arg (refused above), so the canvas is the trained one
        self.canvas = None
        if self.cfg["method"] == "mdm":
            fit_mdm_layout(self.cfg, ckpt, explicit=False)
            trained = (ckpt or {}).get("config", {})
            self.canvas = trained.get("gen_length") or None
        # the decoder's own settings, checked before any request: an MDM's schedule on its canvas;
        # an MDM trained without one fills max_gen_toks, so each request's checks its schedule
        schedule = {}
        if self.cfg["method"] == "mdm" and not self.canvas:
            schedule = {"steps": 0, "block_length": 0}
        decoder_settings(dict(self.cfg, **schedule))
        self.model_device = next(self.model.parameters()).device
        # the statistics of the generation requests so far (speed())
        self.generated = {"requests": 0, "tokens": 0, "nfe": 0, "seconds": 0.0}

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """lm_eval's --model_args as a dict, each read as sampler.py reads its flags; lm_eval's
        --batch_size is taken where the model args give none, its --device is not (the model arg
        device=... is), nor its --max_batch_size (a bound for "auto", refused)."""
        settings = dict(arg_dict)
        batch_size = (additional_config or {}).get("batch_size")
        if batch_size is not None and "batch_size" not in settings:
            settings["batch_size"] = batch_size
        return cls(**settings)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        """--model_args as one string, key=value pairs separated by commas."""
        settings = dict(part.split("=", 1) for part in arg_string.split(",") if part)
        return cls.create_from_arg_obj(settings, additional_config)

    # -------------------------------------------------------------------------------------------
    # generation

    def generate_until(self, requests, disable_tqdm=False):
        """[text] for each request's args (context, gen_kwargs): the context as sampler.py's prompt
        (an empty one: the first EOS id), decoded with at most max_gen_toks new tokens (none: "")
        and cut at the first `until` string (read_gen_kwargs). Raises ValueError naming the
        request and the field where a request cannot be decoded."""
        texts = []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            name = request_name(i, request)
            until, max_gen_toks, temperature = self.read_gen_kwargs(gen_kwargs, name)
            self.generated["requests"] += 1
            # no new token asked for: the empty text, without a forward pass
            if max_gen_toks == 0:
                texts.append("")
                continue
            # an MDM trained on canvases of G tokens fills one of G, whatever max_gen_toks
            knobs = dict(self.cfg, max_new_tokens=self.canvas or max_gen_toks,
                         temperature=temperature)
            try:
                decode_one, settings = make_decoder(knobs, self.ids, None)
            except ValueError as e:
                raise ValueError(f"{name} (max_gen_toks={max_gen_toks}): {e}") from None
            room = self.model.config.block_size - settings.gen_length
            if room < 1:
                raise ValueError(f"{name}: max_gen_toks={max_gen_toks} takes {settings.gen_length} "
                                 "positions (ReFusion: whole slots, or max_gen_toks itself with "
                                 "verify=exact; an MDM: its canvas), which leaves no "
                                 "room for a prompt in the model's context of "
                                 f"{self.model.config.block_size}; lower max_gen_toks in the "
                                 "task's generation_kwargs (or --gen_kwargs max_gen_toks=N)")
            prompt = self.prompt_ids(context)[-room:]
            generator = prompt_generator(self.cfg["device"], self.cfg["seed"], i)
            out = decode_one(self.model, prompt, generator=generator)
            kept = out.tokens[:max_gen_toks]
            tokens = [t for t in kept if t not in self.ids["eos_ids"]]
            # the first stop string ends the text, as lm_eval's own models cut it
            text = postprocess_generated_text(decode(self.enc, tokens), until, None)
            self.generated["tokens"] += len(kept)
            self.generated["nfe"] += out.nfe
            self.generated["seconds"] += out.seconds
            texts.append(text)
        print(self.speed_line(), file=sys.stderr)
        return texts

    def read_gen_kwargs(self, gen_kwargs, name):
        """(until: [str], max_gen_toks: int >= 0, temperature: float) of a request's gen_kwargs,
        read as lm_eval's own models read them (normalize_gen_kwargs: `until` a string or a list of
        them, max_gen_toks or an alias, do_sample=False greedy); a request that sets neither
        temperature nor do_sample decodes at the model arg temperature. Raises ValueError naming
        the request and the field for a field not in GEN_KWARGS or a value that cannot work."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"{name}: gen_kwargs={gen_kwargs!r}: expected a dict")
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"{name}: gen_kwargs {', '.join(unknown)}: not supported by the "
                             f"model refusion, which reads {', '.join(GEN_KWARGS)}; remove them "
                             "from the task's generation_kwargs (or --gen_kwargs)")
        do_sample = gen_kwargs.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"{name}: do_sample={do_sample!r}: give true or false")
        try:
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: gen_kwargs {gen_kwargs}: {e} (max_gen_toks is a whole "
                             "number, temperature a number)") from None
        until = kwargs["until"]
        if not all(isinstance(stop, str) for stop in until):
            raise ValueError(f"{name}: until={gen_kwargs['until']!r}: give a stop string or a "
                             "list of stop strings")
        if kwargs["max_gen_toks"] < 0:
            raise ValueError(f"{name}: max_gen_toks={kwargs['max_gen_toks']}: ask for 0 or more "
                             "new tokens")
        temperature = float(kwargs.get("temperature", self.cfg["temperature"]))
        if do_sample and temperature == 0:
            raise ValueError(f"{name}: do_sample=True at temperature 0: give a temperature above "
                             "0 to sample (in the request or the model arg temperature), or "
                             "do_sample=False for greedy decoding")
        return until, kwargs["max_gen_toks"], temperature

    def prompt_ids(self, context):
        """The context's token ids as sampler.py makes a prompt (chat: the chat template); an empty
        one is the first EOS id, as lm_eval's models condition a log-likelihood's empty context."""
        wrap = chat_prompt if self.cfg["chat"] else encode_prompt
        prompt = wrap(self.enc, context)
        if not prompt:
            return [self.ids["eos_ids"][0]]
        return prompt

    def speed(self):
        """The generation requests' requests, tokens, nfe, tpf, seconds and tokens_per_s so far."""
        g = self.generated
        return dict(g, tpf=g["tokens"] / max(g["nfe"], 1),
                    tokens_per_s=g["tokens"] / max(g["seconds"], 1e-9))

    def speed_line(self):
        s = self.speed()
        return (f"refusion ({self.cfg['method']}): {s['requests']} generation requests, "
                f"{s['tokens']} tokens in {s['nfe']} forward passes (NFE), TPF {s['tpf']:.2f}, "
                f"{s['tokens_per_s']:.1f} tokens/s")

    # -------------------------------------------------------------------------------------------
    # log-likelihood (a causal model's next-token pathway)

    def loglikelihood(self, requests, disable_tqdm=False):
        """[(log p(continuation | context), whether every token is the argmax)] for each request's
        args (context, continuation), exact, in float32; an empty continuation (0.0, True), as
        lm_eval's models score it. Raises ValueError for an MDM, or naming the request for a
        continuation longer than the model's context."""
        pairs = []
        limit = self.model.config.block_size
        for i, request in enumerate(requests):
            context_ids, continuation_ids = self.pair_ids(*request.args)
            # a pass over block_size tokens predicts block_size of them, the first one from context
            if len(continuation_ids) > limit:
                raise ValueError(f"{request_name(i, request)}: the continuation is "
                                 f"{len(continuation_ids)} tokens, more than one pass of the "
                                 f"model's context of {limit} positions scores; evaluate this "
                                 "task with a model of a longer context, or leave it out")
            pairs.append((context_ids, continuation_ids))
        return self.score_pairs(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """[log-likelihood of the whole text] for each request's args (text,), over windows of the
        model's context."""
        results = []
        for request in requests:
            tokens = encode(self.enc, request.args[0])
            windows = get_rolling_token_windows(token_list=tokens,
                                                prefix_token=self.ids["eos_ids"][0],
                                                max_seq_len=self.model.config.block_size,
                                                context_len=1)
            pairs = [make_disjoint_window(window) for window in windows]
            results.append(sum(score for score, _ in self.score_pairs(pairs)))
        return results

    def pair_ids(self, context, continuation):
        """(context ids, continuation ids) split as lm_eval's causal models split them; an empty
        context becomes the first EOS id."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        if not context:
            return [self.ids["eos_ids"][0]], encode(self.enc, continuation)
        whole = encode(self.enc, context + continuation)
        context_ids = encode(self.enc, context)
        return whole[:len(context_ids)], whole[len(context_ids):]

    @torch.inference_mode()
    def score_pairs(self, pairs):
        """[(log-likelihood, greedy)] of [(context ids, continuation ids)], batch_size of one length
        a forward pass, a sequence past the context cut to its last block_size + 1 tokens (a
        continuation of at most block_size tokens). Raises ValueError for an MDM."""
        if self.cfg["method"] == "mdm" or not self.model.config.causal:
            raise ValueError("loglikelihood: this model has bidirectional attention (an MDM), so "
                             "it has no exact log-likelihood, and LLaDA's Monte Carlo estimate is "
                             "not implemented here; evaluate an MDM with generation tasks "
                             "(output_type: generate_until)")
        results = [None] * len(pairs)
        limit = self.model.config.block_size + 1
        sequences = [(context + continuation)[-limit:] for context, continuation in pairs]
        by_length = {}
        for i, sequence in enumerate(sequences):
            # an empty continuation: log p = 0, and no token of it misses the argmax
            if not pairs[i][1]:
                results[i] = (0.0, True)
                continue
            by_length.setdefault(len(sequence), []).append(i)
        for length, members in by_length.items():
            for start in range(0, len(members), self.batch_size):
                group = members[start:start + self.batch_size]
                rows = torch.tensor([sequences[i] for i in group], device=self.model_device)
                # the input is every token but the last; each position predicts the next token
                idx = rows[:, :-1]
                positions = torch.arange(length - 1, device=self.model_device).expand_as(idx)
                logprobs = F.log_softmax(self.model(idx, positions).float(), dim=-1)
                for row, i in enumerate(group):
                    n = len(pairs[i][1])
                    targets = rows[row, -n:]
                    predicted = logprobs[row, -n:]
                    score = predicted.gather(-1, targets[:, None]).sum().item()
                    greedy = bool((predicted.argmax(dim=-1) == targets).all())
                    results[i] = (score, greedy)
        return results

    # -------------------------------------------------------------------------------------------
    # chat templates

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        """lm_eval's --apply_chat_template: refused (ValueError) for the model arg chat=True."""
        raise ValueError("lm_eval's --apply_chat_template is not supported by the model "
                         "refusion: it renders a chat history of several turns as text, which "
                         "support/chat.py does not; leave it (and --fewshot_as_multiturn) out and "
                         "give the model arg chat=True, which puts each request's context, "
                         "few-shot examples included, in one user turn of the model's chat "
                         "template")

    @property
    def tokenizer_name(self):
        """What lm_eval asks for before it renders a chat template (apply_chat_template)."""
        return self.cfg["tokenizer"] or "refusion"


# the counts write_local_task takes, and what each counts
LOCAL_TASK_COUNTS = {"num_samples": "validation lines in the task",
                     "max_gen_toks": "new tokens a request asks for",
                     "room": "new tokens a line leaves room for in the context"}


def write_local_task(folder, out_dir, num_samples=50, max_gen_toks=128, room=None):
    """Write an lm_eval task of checkpoint out_dir's first num_samples validation lines that leave
    room for `room` new tokens (default max_gen_toks) into folder: local_<data set>.jsonl and .yaml
    (generate_until, exact match; docs/evaluation.md). Returns the task's name. Raises ValueError
    for a count below 1, a room below max_gen_toks or past the model's context, or no line that
    leaves it."""
    room = max_gen_toks if room is None else room
    counts = {"num_samples": num_samples, "max_gen_toks": max_gen_toks, "room": room}
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: give a whole number >= 1 "
                             f"({LOCAL_TASK_COUNTS[key]})")
    if room < max_gen_toks:
        raise ValueError(f"room={room} < max_gen_toks={max_gen_toks}: a line leaves room for the "
                         "new tokens its request asks for; give room >= max_gen_toks (the "
                         "decoder's gen_length: max_gen_toks in whole slots)")
    ckpt = load_checkpoint(out_dir, settings_only=True)
    block_size = ckpt["model_args"]["block_size"]
    if room >= block_size:
        raise ValueError(f"room={room}: the model's context of {block_size} positions leaves no "
                         f"place for a prompt beside {room} new tokens; give room and "
                         f"max_gen_toks below {block_size}")
    enc = get_tokenizer(ckpt["meta"]["tokenizer"])
    eos_ids = decoder_ids(ckpt["meta"])["eos_ids"]
    fits = validation_split(ckpt).first_fitting(num_samples, room, block_size)
    if not fits:
        raise ValueError(f"no validation line of {out_dir} leaves room for {room} new tokens in "
                         f"the model's context of {block_size} positions; lower room and "
                         "max_gen_toks")
    name = "local_" + os.path.basename(str(ckpt["config"]["dataset"])).split(".")[0]
    data = os.path.abspath(os.path.join(folder, f"{name}.jsonl"))
    lines = [json.dumps({"query": decode(enc, prompt),
                         "target": decode(enc, [t for t in response if t not in eos_ids])})
             for prompt, response in fits]
    os.makedirs(folder, exist_ok=True)
    write_atomic(data, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    # the JSON-lines file's query is fed, its target compared by exact match; PyYAML quotes the
    # values (a path with ": " or " #" in it stays one string)
    task = {"task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": data}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{query}}",
            "doc_to_target": "{{target}}",
            "generation_kwargs": {"until": [], "max_gen_toks": max_gen_toks},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True}]}
    text = yaml.safe_dump(task, sort_keys=False, allow_unicode=True)
    write_atomic(os.path.join(folder, f"{name}.yaml"), lambda f: f.write(text.encode()))
    return name


def main(argv):
    """lm_eval's command line with the model `refusion` registered."""
    from lm_eval.__main__ import cli_evaluate
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
