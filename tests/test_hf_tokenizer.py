"""
tokenizer.json -> tiktoken (support/hf_tokenizer.py): checked against a reference tokenizer built by
the `tokenizers` library from Qwen's real vocabulary and against byte-level BPEs trained here; a
folder's special ids, stop ids and BOS as transformers reads them; files tiktoken would read
otherwise refused.

Run: python -m pytest -q tests/test_hf_tokenizer.py
     (needs requirements-test.txt; skips what is missing)
"""

import importlib.util
import json
import os
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sampler
from helpers import (TEXTS, edit_json, loadable_by_tokenizers, save_tiny_hf_folder,
                     trained_tokenizer)
from support import tokenizer
from support.chat import CHATML, chat_prompt
from support.hf_tokenizer import (PRE_TOKENIZERS, QWEN2_PAT, byte_of_char, hf_special_ids,
                                  hf_tokenizer, undecodable_ids)
from support.sampling import load_model


# ----------------------------------------------------------------------------------------------
# hf_tokenizer against Qwen's real vocabulary

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


@pytest.fixture(scope="module")
def qwen_tokenizers(tmp_path_factory):
    """(reference tokenizers.Tokenizer, folder with ReFusion's tokenizer.json, folder with Qwen3's).

    Source of the vocabulary: the `dashscope` package (Alibaba's DashScope SDK) ships Qwen's 151,643
    BPE ranks as dashscope/resources/qwen.tiktoken (shared by Qwen1, 2 and 3) and Qwen's regex as
    dashscope.tokenizers.qwen_tokenizer.PAT_STR. From them transformers' TikTokenConverter builds a
    `tokenizers` byte-level BPE (its own byte alphabet, vocab and merges); NFC normalization and the
    added tokens are set as in Qwen's tokenizer.json. That tokenizer, saved, is what hf_tokenizer
    reads, and the same object, a Rust BPE that applies merges, is the reference it must agree with.
    """
    spec = importlib.util.find_spec("dashscope")
    if spec is None:
        pytest.skip("dashscope is not installed (it ships Qwen's vocabulary): "
                    "pip install -r requirements-test.txt")
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from dashscope.tokenizers.qwen_tokenizer import PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
    reference = TikTokenConverter(vocab_file=ranks_file, pattern=PAT_STR).converted()
    reference.normalizer = tokenizers.normalizers.NFC()
    # every token built by merges, no whole-word lookup: unlike tiktoken
    reference.model.ignore_merges = False
    # in id order; Qwen3's tool, FIM and thinking markers are not special
    for t in QWEN3_ADDED + REFUSION_ADDED:
        (reference.add_tokens if t in QWEN3_TEXT_TOKENS else reference.add_special_tokens)(
            [tokenizers.AddedToken(t, special=t not in QWEN3_TEXT_TOKENS, normalized=False)])
    assert reference.get_vocab_size() == 151671 and reference.token_to_id("<|mask|>") == 151670
    refusion, qwen3 = tmp_path_factory.mktemp("refusion"), tmp_path_factory.mktemp("qwen3")
    reference.save(str(refusion / "tokenizer.json"))
    spec_json = json.loads((refusion / "tokenizer.json").read_text(encoding="utf-8"))
    spec_json["added_tokens"] = [t for t in spec_json["added_tokens"]
                                 if t["content"] not in REFUSION_ADDED]
    (qwen3 / "tokenizer.json").write_text(json.dumps(spec_json), encoding="utf-8")
    return reference, refusion, qwen3


def test_hf_tokenizer_matches_reference_on_qwen_vocabulary(qwen_tokenizers):
    reference, folder, _ = qwen_tokenizers
    enc = tokenizer.get_tokenizer(f"hf:{folder}")
    assert enc.n_vocab == 151671
    for text in TEXTS:
        assert tokenizer.encode(enc, text) == \
            reference.encode(text, add_special_tokens=False).ids, text


def test_qwen_ids_of_known_text(qwen_tokenizers):
    enc = hf_tokenizer(str(qwen_tokenizers[1]))
    assert tokenizer.encode(enc, "Hello world") == [9707, 1879]
    # Qwen splits numbers into single digits
    assert tokenizer.encode(enc, "12345") == [16, 17, 18, 19, 20]
    # NFC first, as tokenizer.json says
    assert tokenizer.encode(enc, "cafe\u0301") == tokenizer.encode(enc, "café")


def test_decode_inverts_encode_and_writes_special_tokens(qwen_tokenizers):
    enc = hf_tokenizer(str(qwen_tokenizers[1]))
    for text in TEXTS:
        assert tokenizer.decode(enc, tokenizer.encode(enc, text)) == \
            unicodedata.normalize("NFC", text)
    assert tokenizer.decode(enc, [151645, 151669, 151670]) == "<|im_end|><|beginoftext|><|mask|>"


def test_special_token_text_in_input_stays_plain_text(qwen_tokenizers):
    reference, folder, _ = qwen_tokenizers
    enc = hf_tokenizer(str(folder))
    as_text = type(reference).from_str(reference.to_str())
    # the reference's switch for "special-token strings are plain text"
    as_text.encode_special_tokens = True
    for text in ["<|im_end|>", "user: <|mask|><|endoftext|> done", "<think>\nok\n</think>",
                 "<tool_call>x<|im_start|>"]:
        ids = tokenizer.encode(enc, text)
        assert ids == as_text.encode(text, add_special_tokens=False).ids
        # no special id, markers that are not special
        assert all(i < 151643 or 151657 <= i <= 151668 for i in ids)
    # found in text, as the reference does
    assert tokenizer.encode(enc, "<think>\nok\n</think>")[::4] == [151667, 151668]
    # what was avoided
    assert reference.encode("<|im_end|>", add_special_tokens=False).ids == [151645]


def test_hf_special_ids(qwen_tokenizers, tmp_path):
    _, refusion, qwen3 = qwen_tokenizers
    assert hf_special_ids(str(refusion)) == ((151645, 151643), 151670, 151643)
    assert hf_special_ids(str(qwen3)) == ((151645, 151643), None, 151643)
    shutil.copy(qwen3 / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"mask_token_id": 151660,
                                                      "pad_token_id": 151662}))
    assert hf_special_ids(str(tmp_path)) == ((151645, 151643), 151660, 151662)


# ----------------------------------------------------------------------------------------------
# hf_tokenizer's errors (hand-written files, no package needed)


def write_tokenizer_json(folder, **changes):
    """A Qwen-style tokenizer.json with five tokens ("Ġ" is the byte-level spelling of a space)."""
    qwen_pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PAT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
    spec = {"normalizer": {"type": "NFC"}, "pre_tokenizer": qwen_pre,
            "added_tokens": [{"id": 5, "content": "<|endoftext|>", "special": True}],
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġa": 4},
                      "merges": [["a", "b"], ["Ġ", "a"]]}}
    Path(folder, "tokenizer.json").write_text(json.dumps(spec | changes), encoding="utf-8")


def test_hf_tokenizer_reads_a_qwen_style_file(tmp_path):
    write_tokenizer_json(tmp_path)
    enc = hf_tokenizer(str(tmp_path))
    # "ab" ranks before " a"
    assert tokenizer.encode(enc, " abba") == [2, 3, 1, 0] and tokenizer.encode(enc, " a") == [4]
    assert tokenizer.decode(enc, [4, 5]) == " a<|endoftext|>"
    # our own tokenizers unchanged
    assert tokenizer.special_ids(tokenizer.get_tokenizer("bytes")) == (256, 257, 258)
    # EOS <|endoftext|>, a mask id after the tokenizer's, pad = EOS
    assert tokenizer.special_ids(enc) == (5, 6, 5)


@pytest.mark.parametrize("changes, error, message", [
    (None, FileNotFoundError, "no tokenizer.json"),
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
     ValueError, "pre_tokenizer .*'add_prefix_space': True.* not supported"),
    ({"normalizer": {"type": "NFKC"}}, ValueError, "normalizer {'type': 'NFKC'} not supported"),
    ({"model": {"type": "Unigram", "vocab": []}}, ValueError, "model 'Unigram' not supported"),
    ({"model": {"type": "BPE", "vocab": {"a": 0, "\x00": 1}}}, ValueError,
     "outside the byte-level alphabet"),
    ({"added_tokens": [{"id": 1, "content": "<|endoftext|>"}]}, ValueError,
     "clashes with the vocabulary's 'b'"),
    ({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġa": 4},
                "merges": [["Ġ", "a"], ["a", "b"]]}}, ValueError,
     r"not in merge order \(merge 1 makes id 3"),
    ({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġa": 4, "ba": 6},
                "merges": [["a", "b"], ["Ġ", "a"]]}}, ValueError,
     "tokens 6 are longer than a byte but no merge makes"),
    ({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "byte_fallback": True}},
     ValueError, "BPE options"),
    ({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [], "unk_token": "a"}},
     ValueError, "have no token and model.unk_token is set"),
    ({"decoder": {"type": "WordPiece"}}, ValueError, "decoder 'WordPiece' not supported"),
    ({"added_tokens": [{"id": 5, "content": "<x>", "special": False, "lstrip": True,
                        "normalized": False}]}, ValueError,
     "'<x>' is not special and has lstrip set"),
    ({"added_tokens": [{"id": 5, "content": "<x>", "special": False, "normalized": True}]},
     ValueError, "'<x>' is not special and has normalized set"),
], ids=["no-file", "prefix-space", "nfkc", "unigram", "not-byte-level", "id-clash",
        "not-merge-order", "unmade-token", "byte-fallback", "unk-token", "decoder", "lstrip",
        "normalized"])
def test_hf_tokenizer_errors(tmp_path, changes, error, message):
    if changes is not None:
        write_tokenizer_json(tmp_path, **changes)
    with pytest.raises(error, match=message):
        hf_tokenizer(str(tmp_path))


def test_hf_special_ids_needs_an_eos_token(tmp_path):
    write_tokenizer_json(tmp_path, added_tokens=[{"id": 5, "content": "<|mask|>", "special": True}])
    with pytest.raises(ValueError, match=re.escape("neither <|im_end|> nor <|endoftext|>")):
        hf_special_ids(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# the byte-level BPE families, each against a `tokenizers` BPE trained here with its pre-tokenizer


FAMILY_TEXTS = TEXTS + ["<|im_end|> stays text, <think>\nthought\n</think> is found",
                        "x<think>y <think>  <think>"]


@pytest.mark.parametrize("family", list(PRE_TOKENIZERS))
def test_byte_level_families_match_the_reference(tmp_path, family):
    reference = trained_tokenizer(tmp_path, family)
    enc = hf_tokenizer(str(tmp_path))
    assert enc.n_vocab == reference.get_vocab_size() and not enc.missing
    for text in FAMILY_TEXTS + ["".join(map(chr, range(256)))]:
        ids = tokenizer.encode(enc, text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert tokenizer.decode(enc, ids) == reference.decode(ids, skip_special_tokens=False)
    think = reference.token_to_id("<think>")
    assert tokenizer.encode(enc, "<think>") == [think] and \
        think not in tokenizer.encode(enc, "<thin k>")


def test_bytes_without_a_token_are_dropped_as_the_reference_drops_them(tmp_path):
    reference = trained_tokenizer(tmp_path, "SmolLM2", all_bytes=False)
    enc = hf_tokenizer(str(tmp_path))
    assert b"\x04" in enc.missing and b"\xf1" in enc.missing and b"a" not in enc.missing
    for text in ["a\x04b", "\x04", "!\x04!", "x" + chr(0x40000) + "y", "1\x042 \x04 3",
                 "<think>\x04<think>"]:
        assert tokenizer.encode(enc, text) == \
            reference.encode(text, add_special_tokens=False).ids, text


# ----------------------------------------------------------------------------------------------
# files from elsewhere that do not fit: padded rows, ids beyond the rows, merges tiktoken applies
# otherwise, malformed files


def test_padded_vocabulary_rows_are_never_generated(tmp_path, capsys):
    """Qwen3 and ReFusion have more embedding rows (151,936) than tokenizer ids (151,671): the rows
    past them, and any gap between ids, have no text, and a decoder that chose one crashed in
    decode(). Here every id the tokenizer knows has a zero row in lm_head and the others random
    ones, so the padded rows get all the probability; banned, the choice falls on the lowest id
    among the equal logits of the others, 0 (the byte 0x00), which no EOS ever interrupts."""
    folder = tmp_path / "padded"
    save_tiny_hf_folder(folder)
    # <|mask|>: 259-261 a gap
    edit_json(folder / "tokenizer.json", lambda spec: spec["added_tokens"][3].update(id=262))
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
                              lambda spec: spec["added_tokens"][2].update(id=300)), "300"),
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


def write_byte_level_bpe(folder, merges, ignore_merges=False, vocab_changes=None, added=()):
    """A GPT-2-style tokenizer.json: the 256 bytes (ids 0..255), then the token each merge makes (a
    pair "left right" of tokens spelled in the byte-level alphabet), in merge order."""
    char_of = {b: c for c, b in byte_of_char().items()}
    vocab = {char_of[b]: b for b in range(256)}
    for merge in merges:
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    spec = {"added_tokens": list(added), "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                      "vocab": vocab | (vocab_changes or {}),
                      "merges": [m.split(" ") for m in merges]}}
    Path(folder, "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")


# "abc" is made by the merge (a, bc), but the reference, which joins a and b first, never has that
# pair: it leaves "ab" "c", while tiktoken joins any adjacent pair that makes a token
# ("ab" + "c" = "abc").
JOINED_OTHERWISE = ["a b", "b c", "a bc"]


ABC = (r"merges join the bytes of token 258 \('abc'\) into \['ab', 'c'\], "
       r"where tiktoken makes \['abc'\]")


@pytest.mark.parametrize("merges, ignore_merges, changes, added, differs, message", [
    (JOINED_OTHERWISE, False, None, (), "abc", ABC),
    # a whole token is taken whole by both, but not inside a piece
    (JOINED_OTHERWISE, True, None, (), "abcd", ABC),
    (["a b"], False, {"ba": 256}, (), None, "model.vocab gives id 256 to both 'ab' and 'ba'"),
    (["a b"], False, None, [{"id": 257, "content": "<x>", "special": True},
                            {"id": 257, "content": "<y>", "special": True}], None,
     "added_tokens lists 257 more than once"),
], ids=["merged-otherwise", "merged-otherwise-ignore-merges", "id-twice", "added-id-twice"])
def test_a_tokenizer_tiktoken_would_encode_otherwise_is_refused(tmp_path, merges, ignore_merges,
                                                                changes, added, differs, message):
    """hf_tokenizer encodes exactly as the reference `tokenizers` or refuses the file at load.
    tiktoken joins any adjacent pair that makes a token, the lowest id first; the reference only the
    pairs its merges list: a vocabulary whose merges make a token of its own bytes otherwise is
    refused (shown to encode differently by the reference itself), as is an id given to two tokens,
    which tiktoken cannot decode (it panicked). The same merges in their reference order load and
    encode alike."""
    write_byte_level_bpe(tmp_path, merges, ignore_merges, changes, added)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tokenizer.json")) + ": .*" +
                       message):
        hf_tokenizer(str(tmp_path))
    if differs:
        tokenizers = pytest.importorskip("tokenizers")
        reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        # "ab" "c", where tiktoken made "abc"
        assert reference.encode(differs).ids[:2] == [256, ord("c")]
        folder = tmp_path / "in-order"
        folder.mkdir()
        # "abc" from the pair the reference has
        write_byte_level_bpe(folder, ["a b", "b c", "ab c"], ignore_merges)
        reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        enc = hf_tokenizer(str(folder))
        for text in ["abc", "abcd", "xabc", "bcab", "abcabc", "cab c"]:
            assert tokenizer.encode(enc, text) == reference.encode(text).ids, text


# ----------------------------------------------------------------------------------------------
# a folder's tokenizer and generation config as transformers reads them (bad input, fourth round)


def with_bos_post_processor(folder, bos="<|begin_of_text|>", bos_id=260):
    """Give a save_tiny_hf_folder folder Llama 3's post-processor: the BOS token before every
    sequence (TemplateProcessing), as an added special token."""
    def add(spec):
        spec["added_tokens"].append({"id": bos_id, "content": bos, "special": True})
        loadable_by_tokenizers(spec)
        spec["post_processor"] = {
            "type": "Sequence", "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                 "use_regex": True},
                {"type": "TemplateProcessing",
                 "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                          {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]}
    edit_json(folder / "tokenizer.json", add)


def test_a_post_processor_s_bos_begins_every_prompt_as_transformers_encodes_it(tmp_path, qa_file,
                                                                              capsys):
    """Llama 3's tokenizer.json adds BOS before every sequence (its post_processor): prompts and
    training samples begin with it as AutoTokenizer's encoding does (transformers#30947: ignored,
    every prompt silently lacked it); a chat prompt takes its markers from the template alone, as
    apply_chat_template does; a post-processor this does not implement is refused by name."""
    transformers = pytest.importorskip("transformers")
    save_tiny_hf_folder(tmp_path / "llama3", family="llama")
    with_bos_post_processor(tmp_path / "llama3")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "llama3"))
    enc = hf_tokenizer(str(tmp_path / "llama3"))
    for text in ("hi", "What is 7 + 7?", TEXTS[2]):
        assert tokenizer.encode_prompt(enc, text) == reference(text).input_ids
        assert tokenizer.encode_prompt(enc, text)[0] == 260
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
    edit_json(tmp_path / "llama3" / "tokenizer.json",
              lambda spec: spec.update(post_processor={"type": "RobertaProcessing"}))
    hf_tokenizer.cache_clear()
    with pytest.raises(ValueError, match="post_processor 'RobertaProcessing' is not supported"):
        hf_tokenizer(str(tmp_path / "llama3"))


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
