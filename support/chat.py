"""
Chat templates: a user's text wrapped in a model's chat template (the folder's Jinja template,
rendered in a sandbox as transformers' apply_chat_template does, or Qwen's ChatML), as token ids.

    chat_parts(enc, text)     the user turn and the assistant's header, as text pieces
                              and special ids
    chat_prompt(enc, text)    the same as token ids (sampler.py --chat, HumanEval's chat prompts)
"""

import jinja2
import jinja2.ext
import jinja2.sandbox

from support.hf_tokenizer import alternation
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

    The template is the folder's (hf_tokenizer's .chat_template, rendered with jinja2 in a sandbox
    as transformers' apply_chat_template(add_generation_prompt=True) does; SmolLM2's adds its
    default system turn), else ChatML without a system turn, as the ReFusion release's Qwen3 renders
    it. The template's text is split at the tokenizer's added tokens, as the reference tokenizer
    splits a rendered prompt; `text` stays text, joined to the template text around it, so encoding
    each string gives the reference's ids. Raises ValueError for a tokenizer without a template
    whose ChatML markers it lacks, or a template that does not show the user's text once, unchanged.
    """
    template = getattr(enc, "chat_template", None)
    if template is None and not {"<|im_start|>", "<|im_end|>"} <= enc.special_tokens_set:
        raise ValueError("--chat needs a chat model's tokenizer "
                         "(a chat template, or <|im_start|> and <|im_end|>), "
                         "e.g. --init_from=FOLDER of SmolLM2, Qwen3 or the ReFusion release")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise ValueError(f"the chat template refused the prompt: {message}")
    env.globals["raise_exception"] = raise_exception
    try:
        rendered = env.from_string(template or CHATML).render(
            messages=[{"role": "user", "content": USER_TEXT}], add_generation_prompt=True,
            **getattr(enc, "template_tokens", {}))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template of {enc.name} cannot be rendered ({e})") from None
    if rendered.count(USER_TEXT) != 1:
        raise ValueError(f"the chat template of {enc.name} does not show the user's text once, "
                         "unchanged; such templates are not supported")
    split = alternation(enc.special_tokens_set)
    before, after = (split(part) for part in rendered.split(USER_TEXT))
    # text at even places, tokens at odd
    parts = before[:-1] + [before[-1] + text + after[0]] + after[1:]
    return [enc.encode_single_token(p) if k % 2 else p for k, p in enumerate(parts) if k % 2 or p]


def chat_prompt(enc, text):
    """Token ids of a user turn holding `text`, then the assistant's header, in the model's chat
    template (chat_parts: the folder's template, or Qwen's ChatML), as the ReFusion release's
    evaluation builds its prompts (apply_chat_template with add_generation_prompt). The template's
    markers are special ids; `text` stays plain text. Raises ValueError for a tokenizer with no
    chat template."""
    return [i for part in chat_parts(enc, text)
            for i in ([part] if isinstance(part, int) else encode(enc, part))]
