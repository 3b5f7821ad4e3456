"""
A Hugging Face folder's tokenizer (support/hf_tokenizer.py): its ids and texts against transformers'
AutoTokenizer on Qwen's real vocabulary, special-token strings kept as text, a missing or damaged
tokenizer.json named; a folder's special ids, stop ids and BOS as transformers reads them; the
model rows its tokenizer has no token for never generated.

Run: python -m pytest -q tests/test_hf_tokenizer.py
     (needs requirements-test.txt; skips what is missing)
"""

import importlib.util
import json
import os
import re
import shutil
import unicodedata

import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

import sampler
from helpers import NOT_FILES, TEXTS, edit_json, give_ids, never_blocks, save_tiny_hf_folder
from support import tokenizer
from support.chat import CHATML, chat_prompt
from support.hf_tokenizer import hf_special_ids, hf_tokenizer, undecodable_ids
from support.sampling import load_model


# ----------------------------------------------------------------------------------------------
# Qwen's real vocabulary, against transformers

# Qwen3's added tokens, ids 151643.. in order (as its tokenizer.json lists them), then
# ReFusion's two
QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
               "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
               "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
               "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
               "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
               "<tool_response>", "</tool_response>", "<think>", "</think>"]


REFUSION_ADDED = ["<|beginoftext|>", "<|mask|>"]


# the added tokens Qwen3's tokenizer.json marks "special": false (151657 to 151668): found in text
QWEN3_TEXT_TOKENS = QWEN3_ADDED[14:]


# texts with special tokens' strings, which stay text, and markers that are not special
MARKED_TEXTS = ["<|im_end|>", "user: <|mask|><|endoftext|> done", "<think>\nok\n</think>",
                "<tool_call>x<|im_start|>"]


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    """(transformers' AutoTokenizer of the ReFusion folder, folder with ReFusion's tokenizer.json,
    folder with Qwen3's).

    Source of the vocabulary: the `dashscope` package (Alibaba's DashScope SDK) ships Qwen's 151,643
    BPE ranks as dashscope/resources/qwen.tiktoken (shared by Qwen1, 2 and 3) and Qwen's regex as
    dashscope.tokenizers.qwen_tokenizer.PAT_STR. From them transformers' TikTokenConverter builds a
    `tokenizers` byte-level BPE; NFC normalization and the added tokens are set as in Qwen's
    tokenizer.json. The reference keeps special-token strings as text (split_special_tokens), as
    our encode does.
    """
    spec = importlib.util.find_spec("dashscope")
    if spec is None:
        pytest.skip("dashscope is not installed (it ships Qwen's vocabulary): "
                    "pip install -r requirements-test.txt")
    transformers = pytest.importorskip("transformers")
    from dashscope.tokenizers.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
    built = TikTokenConverter(vocab_file=ranks_file, pattern=PAT_STR).converted()
    built.normalizer = tokenizers.normalizers.NFC()
    # in id order; Qwen3's tool, FIM and thinking markers are not special
    for t in QWEN3_ADDED + REFUSION_ADDED:
        (built.add_tokens if t in QWEN3_TEXT_TOKENS else built.add_special_tokens)(
            [tokenizers.AddedToken(t, special=t not in QWEN3_TEXT_TOKENS, normalized=False)])
    assert built.get_vocab_size() == 151671 and built.token_to_id("<|mask|>") == 151670
    refusion, qwen3 = tmp_path_factory.mktemp("refusion"), tmp_path_factory.mktemp("qwen3")
    built.save(str(refusion / "tokenizer.json"))
    spec_json = json.loads((refusion / "tokenizer.json").read_text(encoding="utf-8"))
    spec_json["added_tokens"] = [t for t in spec_json["added_tokens"]
                                 if t["content"] not in REFUSION_ADDED]
    (qwen3 / "tokenizer.json").write_text(json.dumps(spec_json), encoding="utf-8")
    reference = transformers.AutoTokenizer.from_pretrained(str(refusion), split_special_tokens=True)
    return reference, refusion, qwen3


def test_ids_and_texts_equal_transformers_on_qwen_vocabulary(qwen_folders):
    """Special tokens' strings stay text, never special ids; Qwen3's markers that are not special
    (<think>) are found in text, as transformers finds them; decode writes special tokens."""
    reference, folder, _ = qwen_folders
    enc = tokenizer.get_tokenizer(f"hf:{folder}")
    assert enc.n_vocab == 151671
    # a whitespace run longer than tiktoken takes whole (support.tokenizer.MAX_SPACE_RUN)
    for text in TEXTS + MARKED_TEXTS + ["x" + " " * 20_001 + "y" + "\n" * 10_001]:
        ids = tokenizer.encode(enc, text)
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert tokenizer.decode(enc, ids) == reference.decode(ids) == \
            unicodedata.normalize("NFC", text)
        assert all(i < 151643 or 151657 <= i <= 151668 for i in ids)
    assert tokenizer.encode(enc, "<think>\nok\n</think>")[::4] == [151667, 151668]
    special = [151645, 151669, 151670]
    assert tokenizer.decode(enc, special) == reference.decode(special) == \
        "<|im_end|><|beginoftext|><|mask|>"
    # Qwen's own ids: numbers split into single digits
    assert tokenizer.encode(enc, "Hello world") == [9707, 1879]
    assert tokenizer.encode(enc, "12345") == [16, 17, 18, 19, 20]


def test_hf_special_ids(qwen_folders, tmp_path):
    _, refusion, qwen3 = qwen_folders
    assert hf_special_ids(str(refusion)) == ((151645, 151643), 151670, 151643)
    assert hf_special_ids(str(qwen3)) == ((151645, 151643), None, 151643)
    # a plain Qwen3 fine-tuned into ReFusion: a mask id after the tokenizer's own
    assert tokenizer.special_ids(hf_tokenizer(str(qwen3))) == (151645, 151669, 151643)
    shutil.copy(qwen3 / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"mask_token_id": 151660,
                                                      "pad_token_id": 151662}))
    assert hf_special_ids(str(tmp_path)) == ((151645, 151643), 151660, 151662)


# ----------------------------------------------------------------------------------------------
# files that do not load, and folders whose ids do not fit their model


def test_a_folder_without_tokenizer_json_is_named_with_the_fix(tmp_path):
    """A damaged tokenizer.json: tests/test_hf_folder.py's MALFORMED, through the command lines."""
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in '.*': hf:FOLDER must name "
                                                 "a Hugging Face model folder holding one"):
        hf_tokenizer(str(tmp_path))


def test_a_folder_or_tokenizer_json_of_another_kind_is_named_and_never_waited_on(tmp_path):
    """hf:FOLDER naming a FIFO, or a folder whose tokenizer.json is a directory, a FIFO or a link
    to /dev/zero: each named for what it is (they were "no tokenizer.json"), never waited on. A
    tokenizer.json larger than any real one is refused unread: tests/test_hf_folder.py's MALFORMED,
    through the command lines."""
    os.mkfifo(tmp_path / "pipe")
    with never_blocks(), pytest.raises(ValueError, match=r"pipe is a FIFO \(named pipe\), not a "
                                                         "directory; hf:FOLDER must name a "
                                                         "Hugging Face model folder"):
        hf_tokenizer(str(tmp_path / "pipe"))
    for kind, (make, said) in NOT_FILES.items():
        folder = tmp_path / kind
        folder.mkdir()
        make(folder / "tokenizer.json")
        with never_blocks(), pytest.raises(ValueError, match=f"tokenizer.json {said}, not a "
                                                             "regular file; a model folder holds"):
            hf_tokenizer(str(folder))


def test_hf_special_ids_needs_an_eos_token(tmp_path):
    save_tiny_hf_folder(tmp_path)
    # <|im_start|> alone
    edit_json(tmp_path / "tokenizer.json",
              lambda spec: spec.update(added_tokens=spec["added_tokens"][1:2]))
    with pytest.raises(ValueError, match=re.escape("neither <|im_end|> nor <|endoftext|>")):
        hf_special_ids(str(tmp_path))


def test_padded_vocabulary_rows_are_never_generated(tmp_path, capsys):
    """Qwen3 and ReFusion have more embedding rows (151,936) than tokenizer ids (151,671): the rows
    past them, and any gap between ids, have no text, and a decoder that chose one crashed in
    decode(). Here every id the tokenizer knows has a zero row in lm_head and the others random
    ones, so the padded rows get all the probability; banned, the choice falls on the lowest id
    among the equal logits of the others, 0 (the byte 0x00), which no EOS ever interrupts."""
    folder = tmp_path / "padded"
    save_tiny_hf_folder(folder)
    # <|mask|>: 259-261 a gap
    edit_json(folder / "tokenizer.json", lambda spec: give_ids(spec, [256, 257, 258, 262]))
    edit_json(folder / "config.json", lambda config: config.update(tie_word_embeddings=False))
    tensors = load_file(folder / "model.safetensors")
    lm_head = torch.randn(300, 32)
    lm_head[:259] = lm_head[262] = 0
    save_file(tensors | {"lm_head.weight": lm_head}, folder / "model.safetensors")
    flags = [f"--init_from={folder}", "--prompt=hi", "--json"]
    sampler.main(flags + ["--method=next_token", "--max_new_tokens=5"])
    sampler.main(flags + ["--method=refusion", "--max_new_tokens=8", "--slot_size=4",
                         "--serial_num_blocks=1"])
    greedy_ar, greedy_refusion = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (greedy_ar["text"], greedy_ar["tokens"]) == ("\0" * 5, 5)
    assert (greedy_refusion["text"], greedy_refusion["tokens"]) == ("\0" * 8, 8)
    cfg = dict(sampler.DEFAULTS, init_from=str(folder), method="next_token", max_new_tokens=32,
               temperature=1.0)
    model, enc, ids, _, _ = load_model(cfg)
    run, _ = sampler.make_decoder(cfg, ids, torch.Generator().manual_seed(0))
    # Gumbel-max: the padded rows would win nearly always
    sampled = run(model, tokenizer.encode(enc, "hi")).tokens
    assert sampled and not set(sampled) & {*range(259, 300)}
    assert ids["undecodable_ids"] == undecodable_ids(enc, 300, "") == \
        (259, 260, 261, *range(263, 300))


@pytest.mark.parametrize("edit, ids", [
    (lambda folder: edit_json(folder / "tokenizer.json",
                              lambda spec: give_ids(spec, [256, 257, 300, 259])), "300"),
    (lambda folder: edit_json(folder / "config.json",
                              lambda config: config.update(pad_token_id=301)), "301"),
], ids=["tokenizer-id", "config-pad-id"])
def test_token_ids_beyond_the_models_rows_are_refused_at_load(tmp_path, qa_file, edit, ids):
    """An id the model has no embedding row for (a tokenizer or config.json of another model) is
    refused when the folder is loaded, by the sampler and by a fine-tune, not met as an IndexError
    mid-decode."""
    import train
    folder = tmp_path / "model"
    save_tiny_hf_folder(folder)
    edit(folder)
    message = (rf"token ids {ids} \(of the tokenizer hf:{re.escape(str(folder))} and its special "
               r"tokens\) are at or beyond the 300 embedding rows of the model in "
               rf"{re.escape(str(folder / 'config.json'))}")
    with pytest.raises(ValueError, match=message):
        sampler.main([f"--init_from={folder}", "--chat", "--prompt=hi", "--method=next_token"])
    with pytest.raises(ValueError, match=message):
        train.main([f"--init_from={folder}", f"--dataset={qa_file[0]}",
                    f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'ft'}",
                    "--block_size=64", "--max_iters=1"])
    assert not (tmp_path / "ft" / "ckpt.pt").exists()


# ----------------------------------------------------------------------------------------------
# a folder's post-processor and generation config as transformers reads them


def with_bos_post_processor(folder):
    """Give a save_tiny_hf_folder folder (ids up to 259) Llama 3's post-processor: its BOS, a
    special token of id 260, before every sequence; and a truncation to 3 tokens and a padding to
    40, which transformers does not apply unless asked."""
    bpe = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tokenizers.AddedToken("<|begin_of_text|>", special=True, normalized=False)
    bpe.add_special_tokens([bos])
    bpe.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 260)])
    bpe.enable_truncation(3)
    bpe.enable_padding(length=40)
    bpe.save(str(folder / "tokenizer.json"))


def test_a_post_processor_s_bos_begins_every_prompt_as_transformers_encodes_it(tmp_path, qa_file,
                                                                              capsys):
    """Llama 3's tokenizer.json adds BOS before every sequence (its post_processor): prompts and
    training samples begin with it as AutoTokenizer's encoding does (transformers#30947: ignored,
    every prompt silently lacked it); a chat prompt takes its markers from the template alone, as
    apply_chat_template does."""
    transformers = pytest.importorskip("transformers")
    save_tiny_hf_folder(tmp_path / "llama3", family="llama")
    with_bos_post_processor(tmp_path / "llama3")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "llama3"))
    enc = hf_tokenizer(str(tmp_path / "llama3"))
    for text in ("hi", "What is 7 + 7?", TEXTS[2]):
        assert tokenizer.encode_prompt(enc, text) == reference(text).input_ids
        assert tokenizer.encode_prompt(enc, text)[0] == 260
        assert tokenizer.encode(enc, text) == list(text.encode())
    assert chat_prompt(enc, "hi") == reference.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
        return_dict=False, chat_template=CHATML)
    from support.prepare import TokenDataset, prepare
    data_dir = prepare(qa_file[0], f"hf:{tmp_path / 'llama3'}", 64, str(tmp_path / "data"))
    prompt, response = TokenDataset(data_dir, "train").sample(0)
    assert prompt[0] == 260 and 260 not in response
    capsys.readouterr()
    sampler.main([f"--init_from={tmp_path / 'llama3'}", "--prompt=hi", "--method=next_token",
                  "--max_new_tokens=2", "--json"])
    assert json.loads(capsys.readouterr().out)["prompt"] == "<|begin_of_text|>hi"


def test_stop_ids_are_read_as_transformers_reads_them_and_a_negative_pad_id_is_none(tmp_path):
    """An end-of-turn id named only in generation_config.json (Llama 3: config.json's eos 257, its
    generation config [257, 260]) stops generation, as generate stops there (vllm#4180: it was
    written eight times); without a generation config, config.json's; a pad_token_id of -1, which
    transformers loads, means no pad id."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama3"
    save_tiny_hf_folder(folder, family="llama")
    edit_json(folder / "config.json", lambda c: c.update(eos_token_id=257, pad_token_id=-1))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 260]}))
    reference = transformers.GenerationConfig.from_pretrained(str(folder)).eos_token_id
    assert hf_special_ids(str(folder)) == ((257, 260), 259, 260) and reference == [257, 260]
    (folder / "generation_config.json").unlink()
    hf_tokenizer.cache_clear()
    assert hf_special_ids(str(folder)) == ((257,), 259, 257)
