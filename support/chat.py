"""
Chat templates: a user's text in a model's chat template (the folder's Jinja template, rendered in
a sandbox as transformers' apply_chat_template does, else Qwen's ChatML).

    chat_parts(enc, text)     the user turn and the assistant's header: text pieces and special ids
    chat_prompt(enc, text)    the same as token ids (sampler.py --chat, HumanEval's chat prompts)
"""

import datetime
import re

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from support.tokenizer import encode


# ChatML as Qwen writes it, without a system turn
CHATML = (r"{% for m in messages %}"
          r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a stand-in for the user's text while the template renders (private-use)
USER_TEXT = "\uE000user text\uE000"


def chat_parts(enc, text):
    """A user turn holding `text`, then the assistant's header, in the tokenizer's chat template
    (else CHATML): a list of strings (plain text) and ints (special ids, the template's markers).
    The template's own text (found by rendering it with USER_TEXT) is split at the special tokens;
    the user's part stays text, so a special token's string in it is never a special id. Raises
    ValueError for a tokenizer with neither a template nor ChatML's markers, or a template that
    shows the user's text other than once or renders its own text differently around it."""
    template = getattr(enc, "chat_template", None)
    if template is None and not {"<|im_start|>", "<|im_end|>"} <= enc.special_tokens_set:
        raise ValueError("--chat needs a chat model's tokenizer "
                         "(a chat template, or <|im_start|> and <|im_end|>), "
                         "e.g. --init_from=FOLDER of SmolLM2, Qwen3 or the ReFusion release")
    rendered, marked = (render(enc, template or CHATML, content) for content in (text, USER_TEXT))
    if marked.count(USER_TEXT) != 1:
        raise ValueError(f"the chat template of {enc.name} does not show the user's text once; "
                         "such templates are not supported")
    before, after = marked.split(USER_TEXT)
    if not (rendered.startswith(before) and rendered.endswith(after)
            and len(rendered) >= len(before) + len(after)):
        raise ValueError(f"the chat template of {enc.name} renders its own text differently around "
                         "this user text; such templates are not supported")
    users = rendered[len(before):len(rendered) - len(after)]   # what the template made of text
    before = split_at(before, enc.special_tokens_set)
    after = split_at(after, enc.special_tokens_set)
    # text at even places, tokens at odd
    parts = before[:-1] + [before[-1] + users + after[0]] + after[1:]
    return [enc.encode_single_token(p) if k % 2 else p for k, p in enumerate(parts) if k % 2 or p]


def split_at(text, tokens):
    """[text, token, text, ..., text]: `text` split around each of the strings `tokens`, the longest
    first at a place, as the `tokenizers` library finds added tokens."""
    if not tokens:
        return [text]
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.split("(" + "|".join(map(re.escape, longest_first)) + ")", text)


def render(enc, template, content):
    """`template` rendered for one user message holding content and the generation prompt, in a
    sandbox with what apply_chat_template gives a template (bos_token, eos_token, raise_exception,
    strftime_now, {% generation %}). Raises ValueError when it cannot be rendered or raises."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationBlock])

    def raise_exception(message):
        raise ValueError(f"the chat template refused the prompt: {message}")
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=True,
            **getattr(enc, "template_tokens", {}))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template of {enc.name} cannot be rendered ({e})") from None


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %} ... {% endgeneration %}, as transformers defines it: its body as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def chat_prompt(enc, text):
    """chat_parts(enc, text) as token ids, as apply_chat_template(add_generation_prompt=True) gives
    them. Raises what chat_parts raises."""
    return [i for part in chat_parts(enc, text)
            for i in ([part] if isinstance(part, int) else encode(enc, part))]
