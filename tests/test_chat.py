"""
Chat templates (support/chat.py): a folder's template rendered as transformers renders it, and the
user's text fed as the template renders it.

Run: python -m pytest -q tests/test_chat.py
     (needs requirements-test.txt; skips what is missing)
"""

import json

import pytest

from helpers import save_tiny_hf_folder, trained_tokenizer
from support.chat import chat_prompt
from support.hf_tokenizer import hf_tokenizer


def test_chat_template_of_a_folder_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = trained_tokenizer(tmp_path)
    template = ("{% for message in messages %}"
                "{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}"
                "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    enc = hf_tokenizer(str(tmp_path))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                chat_template=template)
    for text in ["What is 12 + 30?", "  leading spaces\nand a <think> tag", ""]:
        expected = fast.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert chat_prompt(enc, text) == list(expected), text
    user_special = chat_prompt(enc, "say <|im_end|>")   # the user's text stays text
    # the system turn's and the user turn's
    assert user_special.count(reference.token_to_id("<|im_end|>")) == 2
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] | upper }}"}))
    hf_tokenizer.cache_clear()
    with pytest.raises(ValueError, match="does not show the user's text once"):
        chat_prompt(hf_tokenizer(str(tmp_path)), "hi")


@pytest.mark.parametrize("template", [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n",
    "<|im_start|>system\nToday is {{ strftime_now('%Y') }}.<|im_end|>\n{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{% generation %}{{ m['content'] }}{% endgeneration %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"], ids=["trim", "strftime-generation"])
def test_a_chat_template_is_fed_as_it_renders_the_user_s_text(tmp_path, template):
    """A template that transforms the user's text (`| trim`) gives the ids apply_chat_template
    gives, not those of the text as typed; one that uses strftime_now or a {% generation %} block
    (transformers defines both) renders as there."""
    transformers = pytest.importorskip("transformers")
    save_tiny_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    enc = hf_tokenizer(str(tmp_path))
    for text in ["  What is 7 + 7?  \n", "hi", "\tspaced\tout\t"]:
        expected = reference.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert chat_prompt(enc, text) == list(expected), text


def test_a_template_file_and_its_bos_token_render_as_transformers_renders_them(tmp_path):
    """chat_template.jinja, which transformers reads before tokenizer_config.json's chat_template,
    and the bos_token string tokenizer_config.json names (Llama 3's templates begin with it)."""
    transformers = pytest.importorskip("transformers")
    save_tiny_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "chat_template": "{{ 'not this one' }}"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    expected = reference.apply_chat_template([{"role": "user", "content": "hi"}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert chat_prompt(hf_tokenizer(str(tmp_path)), "hi") == list(expected)
    # <|endoftext|>, then <|im_start|>
    assert expected[:2] == [256, 257]
