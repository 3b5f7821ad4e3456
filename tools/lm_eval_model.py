"""
Our checkpoints and decoders as the lm-evaluation-harness model `refusion` (docs/evaluation.md):

    python -m tools.lm_eval_model --model refusion \\
        --model_args out_dir=out-quotes,method=refusion,slot_size=8 --tasks gsm8k
    python -m tools.lm_eval_model --model refusion \\
        --model_args init_from=smollm2,method=next_token --tasks arc_challenge

The command is lm_eval's own (lm_eval run --help) with the model registered; from Python,
`RefusionLM(out_dir=...)` is an lm_eval LM for lm_eval.simple_evaluate. The model args are
sampler.py's settings plus batch_size; NOT_MODEL_ARGS are refused. Generation requests run the
project's decoders, their tokens, NFE, TPF and tokens/s printed to stderr; log-likelihoods are exact
for a causal model and refused for an MDM. Needs lm-eval==0.4.13 (requirements-test.txt).
"""

import json
import os
import sys

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
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


@register_model("refusion")
class RefusionLM(LM):
    """lm_eval's LM over a checkpoint (out_dir) or a Hugging Face folder (init_from), decoded by
    sampler.py's decoders. settings: sampler.py's settings as keywords; batch_size: the most
    log-likelihood requests of one length in a forward pass. Raises ValueError or FileNotFoundError
    as sampler.py does."""

    def __init__(self, batch_size=16, **settings):
        super().__init__()
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
        self.batch_size = int(batch_size)
        self.model, self.enc, self.ids, objective, ckpt = load_model(self.cfg)
        self.cfg["method"] = self.cfg["method"] or METHOD_OF[objective]
        check_attention(self.model, self.cfg["method"])
        # the decoder's own settings, checked before any request
        decoder_settings(self.cfg)
        # an MDM decodes in the layout it was trained on (its shift, its canvas), as sampler.py
        self.canvas = None
        if self.cfg["method"] == "mdm":
            # max_new_tokens is never a model arg (refused above): the canvas is the trained one
            fit_mdm_layout(self.cfg, ckpt, explicit=False)
            trained = (ckpt or {}).get("config", {})
            self.canvas = trained.get("gen_length") or None
        self.model_device = next(self.model.parameters()).device
        # the statistics of the generation requests so far (speed())
        self.generated = {"requests": 0, "tokens": 0, "nfe": 0, "seconds": 0.0}

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        """lm_eval's --model_args as a dict, each read as sampler.py reads its flags; lm_eval's
        --batch_size is taken, its --device is not (the model arg device=... is)."""
        settings = dict(arg_dict)
        batch_size = (additional_config or {}).get("batch_size")
        if isinstance(batch_size, int) and "batch_size" not in settings:
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
        """[text] for each request's args (context, gen_kwargs): the context as sampler.py's prompt,
        decoded with at most max_gen_toks new tokens (at gen_kwargs' temperature, if given), cut at
        the first `until` string."""
        texts = []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            max_new_tokens = int(gen_kwargs.get("max_gen_toks", 256))
            # an MDM trained on canvases of G tokens fills one of G, whatever max_gen_toks
            knobs = dict(self.cfg, max_new_tokens=self.canvas or max_new_tokens)
            if "temperature" in gen_kwargs:
                knobs["temperature"] = float(gen_kwargs["temperature"])
            decode_one, settings = make_decoder(knobs, self.ids, None)
            prompt = self.prompt_ids(context, settings.gen_length)
            generator = prompt_generator(self.cfg["device"], self.cfg["seed"], i)
            out = decode_one(self.model, prompt, generator=generator)
            kept = out.tokens[:max_new_tokens]
            tokens = [t for t in kept if t not in self.ids["eos_ids"]]
            text = decode(self.enc, tokens)
            # the first stop string ends the text, as lm_eval's own models cut it
            for stop in gen_kwargs.get("until") or []:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.generated["requests"] += 1
            self.generated["tokens"] += len(kept)
            self.generated["nfe"] += out.nfe
            self.generated["seconds"] += out.seconds
            texts.append(text)
        print(self.speed_line(), file=sys.stderr)
        return texts

    def prompt_ids(self, context, gen_length):
        """The context's token ids as sampler.py makes a prompt (chat: the chat template), its
        oldest tokens dropped where it and gen_length new tokens would pass the model's context."""
        wrap = chat_prompt if self.cfg["chat"] else encode_prompt
        prompt = wrap(self.enc, context)
        room = self.model.config.block_size - gen_length
        if room < 1:
            raise ValueError(f"max_gen_toks leaves no room for a prompt in the model's context of "
                             f"{self.model.config.block_size} positions")
        return prompt[-room:]

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
        args (context, continuation), exact, in float32. Raises ValueError for an MDM."""
        pairs = [self.pair_ids(*request.args) for request in requests]
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
        a forward pass, a sequence past the context cut to its last block_size + 1 tokens. Raises
        ValueError for an MDM."""
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

    # lm_eval asks a model for these where its tasks render chat templates or cut contexts
    @property
    def tokenizer_name(self):
        return self.cfg["tokenizer"] or "refusion"


# a local task: the JSON-lines file's query is fed, its target compared by exact match
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {max_gen_toks}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_local_task(folder, out_dir, num_samples=50, max_gen_toks=128, room=None):
    """Write an lm_eval task of checkpoint out_dir's first num_samples validation lines that leave
    room for `room` new tokens (default max_gen_toks) into folder: local_<data set>.jsonl and .yaml
    (generate_until, exact match; docs/evaluation.md). Returns the task's name."""
    ckpt = load_checkpoint(out_dir, settings_only=True)
    enc = get_tokenizer(ckpt["meta"]["tokenizer"])
    eos_ids = decoder_ids(ckpt["meta"])["eos_ids"]
    fits = validation_split(ckpt).first_fitting(num_samples, room or max_gen_toks,
                                                ckpt["model_args"]["block_size"])
    name = "local_" + os.path.basename(str(ckpt["config"]["dataset"])).split(".")[0]
    data = os.path.abspath(os.path.join(folder, f"{name}.jsonl"))
    lines = [json.dumps({"query": decode(enc, prompt),
                         "target": decode(enc, [t for t in response if t not in eos_ids])})
             for prompt, response in fits]
    os.makedirs(folder, exist_ok=True)
    write_atomic(data, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    task = TASK_YAML.format(name=name, data=data, max_gen_toks=max_gen_toks)
    write_atomic(os.path.join(folder, f"{name}.yaml"), lambda f: f.write(task.encode()))
    return name


def main(argv):
    """lm_eval's command line with the model `refusion` registered."""
    from lm_eval.__main__ import cli_evaluate
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
