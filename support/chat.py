"""
Chat templates: a user's text wrapped in a model's chat template (the folder's Jinja template,
rendered in a sandbox as transformers' apply_chat_template does, or Qwen's ChatML), as token ids.

    chat_parts(enc, text)     the user turn and the assistant's header, as text pieces
                              and special ids
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
    """A user turn holding `text`, then the assistant's header, in the tokenizer's chat template: a
    list of strings (to encode as plain text) and ints (special ids, the template's markers).

    The template is the folder's (HFTokenizer's .chat_template, rendered with jinja2 in a sandbox
    as transformers' apply_chat_template(add_generation_prompt=True) does; SmolLM2's adds its
    default system turn), else ChatML without a system turn, as the ReFusion release's Qwen3 renders
    it. The template is rendered twice: with a stand-in for the text (USER_TEXT), which marks the
    template's own text around it, and with the text itself, of which the part between the two is
    what the template made of the user's text (a `| trim` strips its whitespace, as
    apply_chat_template feeds it). The template's own text is split at the tokenizer's special
    tokens, as the reference tokenizer splits a rendered prompt; the user's part stays text, so a
    special-token string in it is never a special id. Raises ValueError for a tokenizer without a
    template whose ChatML markers it lacks, or a template that does not show the stand-in once or
    renders its own text differently around the real text.
    """
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
    """[text, token, text, ..., text]: `text` split around every occurrence of the strings
    `tokens`, leftmost first and the longest at a place first, as the `tokenizers` library finds
    added tokens in a text."""
    if not tokens:
        return [text]
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.split("(" + "|".join(map(re.escape, longest_first)) + ")", text)


def render(enc, template, content):
    """The chat template rendered for one user message holding content, then the assistant's
    header (jinja2 in a sandbox, with what transformers' apply_chat_template gives a template: the
    bos and eos token strings, raise_exception, strftime_now, the {% generation %} block).
    Raises ValueError when it cannot be rendered or raises."""
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
    """{% generation %} ... {% endgeneration %}, as transformers defines it for templates that mark
    the assistant's part (for its training masks): its body rendered as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def chat_prompt(enc, text):
    """Token ids of a user turn holding `text`, then the assistant's header, in the model's chat
    template (chat_parts: the folder's template, or Qwen's ChatML), as the ReFusion release's
    evaluation builds its prompts (apply_chat_template with add_generation_prompt). The template's
    markers are special ids; `text` stays plain text. Raises ValueError for a tokenizer with no
    chat template."""
    return [i for part in chat_parts(enc, text)
            for i in ([part] if isinstance(part, int) else encode(enc, part))]
