"""The sampling command line (sampler.py, support/sampling.py)."""

import io
import json
import os
import re
import shutil
import sys
import threading

import pytest
import torch

import sampler
from support import corpora, sampling
import train
from helpers import qa_rows, tiny_model, tiny_run_flags, write
from configurator import ContextTooLong
from support.checkpoint import decoder_ids, load_checkpoint, model_from_checkpoint
from support.prepare import TokenDataset
from sampler import DECODERS, DEFAULTS, make_decoder
from support.sampling import EOS_MARK, LiveTrace
from support.tokenizer import decode, encode, get_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """out_dir of a tiny ReFusion model trained for 2 steps on qa_rows(), shared by this file's
    tests."""
    tmp = tmp_path_factory.mktemp("sampler")
    path = write(tmp, "sums.json", json.dumps(qa_rows()))
    train.main(tiny_run_flags(tmp, (path,), "run") + ["--max_iters=2"])
    return str(tmp / "run")


def test_cli_builds_each_decoder_and_refuses_an_unknown_method():
    ids = {"eos_ids": (39,), "mask_id": 38, "pad_id": 37}
    for method, causal, gen_length in [("refusion", True, 16), ("next_token", True, 10),
                                       ("mdm", False, 10)]:
        # refusion: 10 -> 2 slots of 8
        cfg = dict(DEFAULTS, method=method, max_new_tokens=10, serial_num_blocks=1)
        run, settings = make_decoder(cfg, ids, torch.Generator())
        out = run(tiny_model(causal=causal), [1, 2, 3])
        assert settings.gen_length == gen_length and 0 < len(out.tokens) <= 10 and out.nfe > 0
    with pytest.raises(ValueError,
                       match="--method='beam': choose one of refusion, next_token, mdm"):
        make_decoder(dict(DEFAULTS, method="beam"), ids, torch.Generator())


@pytest.mark.parametrize("flag, message", [
    ("--method=beam", "choose one of refusion, next_token, mdm"),
    ("--slot_threshold=nan", "thresholds are finite probabilities"),
    ("--method=mdm --steps=7 --max_new_tokens=64 --block_length=32", "steps"),
    ("--method=mdm --confidence=top", "confidence='top': choose one of prob, margin, entropy"),
    ("--method=refusion --confidence=bogus", "--confidence='bogus': choose one of prob, margin, "
                                             "entropy"),
    ("--confidence=bogus", "--confidence='bogus': choose one of prob, margin, entropy")])
def test_bad_decoder_settings_fail_before_any_weights_are_read(tmp_path, flag, message):
    # out_dir holds no checkpoint: reading weights first would fail with a different error
    with pytest.raises(ValueError, match=message):
        sampler.main([f"--out_dir={tmp_path / 'no-model-here'}", "--method=refusion",
                      *flag.split()])


def test_sampler_cli_prints_one_json_object_per_sample(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    capsys.readouterr()
    out_dir = f"--out_dir={tmp_path / 'run'}"
    sampler.main([out_dir, "--json", "--num_samples=2", "--max_new_tokens=8", "--slot_size=4",
                  "--serial_num_blocks=1"])
    sampler.main([out_dir, "--json", "--prompt=What is 7 + 7?", "--max_new_tokens=6",
                  "--slot_size=4", "--serial_num_blocks=2", "--method=refusion"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and lines[2]["prompt"] == "What is 7 + 7?"
    for row, limit in zip(lines, (8, 8, 6)):
        assert {"text", "tokens", "nfe", "tpf", "seconds", "tokens_per_s"} <= set(row)
        assert 0 < row["tokens"] <= limit and row["tpf"] == round(row["tokens"] / row["nfe"], 3)
    sampler.main([out_dir, "--json", "--num_samples=1000", "--max_new_tokens=8", "--slot_size=4",
                  "--serial_num_blocks=1"])
    # every fitting prompt, and a note saying so
    printed = capsys.readouterr()
    assert len(printed.out.splitlines()) < 1000 and \
        "validation prompts leave room for 8 new tokens" in printed.err
    for bad, message in [(["--num_samples=0"], "--num_samples=0"),
                         (["--prompt_file=nope.txt"], "no such file"),
                         (["--method=mdm"], "trained with a causal objective")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            sampler.main([out_dir] + bad)


def test_sampler_prepares_damaged_validation_data_anew(tmp_path, qa_file, capsys):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"])
    val_bin = next((tmp_path / "data").glob("*/val.bin"))
    whole = val_bin.read_bytes()
    val_bin.write_bytes(whole[:-4])                                   # cut short
    sampler.main([f"--out_dir={tmp_path / 'run'}", "--num_samples=1", "--max_new_tokens=8",
                  "--serial_num_blocks=1", "--json"])
    assert val_bin.read_bytes() == whole
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] >= 1


@pytest.mark.parametrize("method", ["refusion", "next_token"])
def test_seed_samples_a_prompt_as_the_api_does_with_that_seed(trained, capsys, method):
    """--seed=7 --temperature=1 draws exactly what the decoder draws from
    torch.Generator().manual_seed(7): the warm-up decode has a generator of its own, so it consumes
    none of the sample's random numbers."""
    knobs = ["--temperature=1", "--prompt=What is 7 + 7?", "--max_new_tokens=16", "--slot_size=4",
             "--serial_num_blocks=1"]
    sampler.main([f"--out_dir={trained}", "--json", "--seed=7", f"--method={method}"] + knobs)
    row = json.loads(capsys.readouterr().out)
    ckpt = load_checkpoint(trained)
    meta, model, enc = ckpt["meta"], model_from_checkpoint(ckpt), get_tokenizer("bytes")
    generate, Settings = DECODERS[method]
    settings = Settings(16, temperature=1.0,
                        **({} if method == "next_token" else
                           dict(slot_size=4, serial_num_blocks=1)))
    ids = dict(eos_ids=(meta["eos_id"],), banned_ids=(meta["mask_id"], meta["pad_id"]))
    ids |= {} if method == "next_token" else dict(mask_id=meta["mask_id"])
    texts = []
    for seed in (7, 8):
        out = generate(model, encode(enc, "What is 7 + 7?"), settings,
                       generator=torch.Generator().manual_seed(seed), **ids)
        texts.append(decode(enc, [t for t in out.tokens if t != meta["eos_id"]]))
    # the seed decides, and only the seed
    assert row["text"] == texts[0] != texts[1]


def test_plot_draws_the_first_decode_and_refuses_a_missing_directory_before_reading_weights(
        trained, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "decode.png"
    sampler.main([f"--out_dir={trained}", "--num_samples=2", "--max_new_tokens=8", "--slot_size=4",
                  "--serial_num_blocks=1", f"--plot={path}"])
    assert path.read_bytes().startswith(b"\x89PNG") and \
        "drew the decode of the first prompt" in capsys.readouterr().err
    # a GIF: one frame per step; next-token decoding takes a step, and a forward pass, per token
    from PIL import Image
    sampler.main([f"--out_dir={trained}", "--num_samples=1", "--max_new_tokens=8", "--json",
                  "--method=next_token", f"--plot={tmp_path / 'decode.gif'}"])
    row = json.loads(capsys.readouterr().out)
    assert Image.open(tmp_path / "decode.gif").n_frames == row["nfe"] == row["tokens"]
    with pytest.raises(FileNotFoundError, match=r"--plot=.*: the directory .*nope does not exist; "
                                                r"create it"):
        sampler.main([f"--out_dir={tmp_path / 'no-model-here'}",
                      f"--plot={tmp_path / 'nope' / 'decode.png'}"])


def test_live_trace_draws_characters_whole_eos_as_a_marker_and_ends_on_the_returned_response(
        trained, capsys):
    """--show decodes each run of committed neighbours together (the two bytes of "é" committed in
    two steps are one character once both are there), draws EOS as EOS_MARK and nothing after it or
    past max_new_tokens, so its last frame is the response a decoder returns."""
    enc, eos = get_tokenizer("bytes"), 256
    prompt = encode(enc, "s = '")
    P = len(prompt)
    e_acute = list("é".encode())
    live = LiveTrace(enc, prompt, max_new_tokens=6, eos_ids=(eos,))
    # the second byte first, out of order
    live([(P + 1, e_acute[1])])
    # six positions, none past max_new_tokens
    assert live.response() == "░\ufffd░░░░"
    live([(P, e_acute[0]), (P + 3, eos)])
    assert live.response() == "é░" + EOS_MARK                        # nothing after EOS
    # an MDM fills positions after EOS too
    live([(P + 2, ord("!")), (P + 4, ord("x"))])
    assert live.response() == "é!" + EOS_MARK
    # off a terminal, one line a step: what it committed, each run of neighbours decoded (the
    # first byte of é alone, in step 2, is no character)
    assert capsys.readouterr().err.splitlines() == [
        "step 1: 1 token(s) committed at response offsets 1..1 (1/6 filled): '\ufffd'",
        "step 2: 2 token(s) committed at response offsets 0..3 (2/3 filled): '\ufffd' | "
        "'<|endoftext|>'",
        "step 3: 2 token(s) committed at response offsets 2..4 (3/3 filled): '!' | 'x'"]
    long = LiveTrace(enc, prompt, max_new_tokens=4000, eos_ids=(eos,))
    for p in range(4000):                             # a long decode: its log grows linearly
        long([(P + p, ord("a"))])
    assert len(capsys.readouterr().err) < 100 * 4000
    ckpt = load_checkpoint(trained)
    model, meta = model_from_checkpoint(ckpt), ckpt["meta"]
    # real decodes: the last frame is the response
    for method in ("refusion", "next_token"):
        cfg = dict(DEFAULTS, method=method, max_new_tokens=6, slot_size=4, serial_num_blocks=1,
                   temperature=1.0)
        run, _ = make_decoder(cfg, decoder_ids(meta), torch.Generator().manual_seed(0))
        live = LiveTrace(enc, prompt, 6, (meta["eos_id"],))
        out = run(model, prompt, on_step=live)
        ended = out.tokens[-1] == meta["eos_id"]
        assert live.response() == \
            decode(enc, out.tokens[:len(out.tokens) - ended]) + EOS_MARK * ended


def test_prompt_file_is_read_as_written_and_bad_utf8_names_the_byte(trained, tmp_path, capsys):
    """A prompt file keeps its CRLF line ends byte for byte, loses a UTF-8 byte order mark (with a
    note), and a byte that is not UTF-8 is named by its offset, with the file."""
    out_dir = f"--out_dir={trained}"
    path = write(tmp_path, "p.txt", b"\xef\xbb\xbfdef f(x):\r\n    return")
    sampler.main([out_dir, "--json", f"--prompt_file={path}", "--max_new_tokens=4",
                  "--slot_size=4", "--serial_num_blocks=1"])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["prompt"] == "def f(x):\r\n    return"
    assert f"--prompt_file={path}: removed the UTF-8 byte order mark" in captured.err
    bad = write(tmp_path, "bad.txt", b"def caf\xe9():\n")
    with pytest.raises(ValueError, match=rf"--prompt_file={re.escape(bad)}: not valid UTF-8 at "
                                         r"byte offset 7"):
        sampler.main([out_dir, f"--prompt_file={bad}"])


def test_an_mdm_is_decoded_on_the_canvas_it_was_trained_for(tmp_path, capsys):
    path = write(tmp_path, "sums.json", json.dumps(qa_rows()))
    train.main(tiny_run_flags(tmp_path, (path,), "mdm", objective="mdm") + ["--max_iters=2"])
    out_dir = str(tmp_path / "mdm")
    # trained with --gen_length=16
    sampler.main([f"--out_dir={out_dir}", "--num_samples=1", "--json"])
    assert "canvas of 16 tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trained to fill canvases of 16 tokens.*"
                                         "use --max_new_tokens=16"):
        sampler.main([f"--out_dir={out_dir}", "--num_samples=1", "--max_new_tokens=10"])
    sampler.main([f"--out_dir={out_dir}", "--num_samples=1", "--max_new_tokens=16", "--json"])
    assert "canvas" not in capsys.readouterr().err


def test_an_mdm_is_decoded_with_the_shift_it_was_trained_with(tmp_path, monkeypatch):
    """train.py --mdm_shift (Dream's shifted prediction) is the checkpoint's: the sampler decodes a
    shifted MDM shifted and an unshifted one not, and takes no --mdm_shift of its own."""
    path = write(tmp_path, "sums.json", json.dumps(qa_rows()))
    seen, decode = [], DECODERS["mdm"][0]

    def spy(model, prompt, settings, **kwargs):
        seen.append(settings.mdm_shift)
        return decode(model, prompt, settings, **kwargs)

    monkeypatch.setitem(DECODERS, "mdm", (spy, DECODERS["mdm"][1]))
    for shift in (True, False):
        out = f"mdm-{shift}"
        train.main(tiny_run_flags(tmp_path, (path,), out, objective="mdm") +
                   ["--max_iters=2", f"--mdm_shift={shift}"])
        sampler.main([f"--out_dir={tmp_path / out}", "--num_samples=2", "--json"])
        assert len(seen) >= 2 and set(seen) == {shift}
        seen.clear()
    with pytest.raises(ValueError, match="mdm_shift"):
        sampler.main([f"--out_dir={tmp_path / out}", "--mdm_shift=True"])


def test_each_sample_of_a_checkable_task_says_whether_it_is_right_and_a_summary_counts_them(
        tmp_path, capsys):
    """On a built-in corpus whose answers code checks (here transform), every sample ends with its
    verdict and its speed, and one summary line adds them up (TPF = all tokens / all forward
    passes), then gives next-token decoding of the same prompts (compare_next_token): what
    --method=next_token makes of them."""
    flags = tiny_run_flags(tmp_path, ("transform",), "run") + ["--block_size=160", "--max_iters=2"]
    train.main(flags)
    sample = [f"--out_dir={tmp_path / 'run'}", "--num_samples=3", "--max_new_tokens=16",
              "--serial_num_blocks=1"]
    sampler.main(sample)
    out = capsys.readouterr().out.strip().split("\n")
    lines = [line for line in out if re.match(r"(right|wrong) \(exact\): ", line)]
    assert len(lines) == 3
    figures = [tuple(map(int, re.search(r"(\d+) tokens in (\d+) forward", line).groups()))
               for line in lines]
    tokens, nfe = sum(t for t, _ in figures), sum(n for _, n in figures)
    right = sum(line.startswith("right") for line in lines)
    assert out[-1].startswith(f"3 samples: {right} of 3 right (exact); {tokens} tokens in {nfe} "
                              f"forward passes, {tokens / nfe:.2f} tokens per forward, ")
    # next-token decoding, one sample a line
    sampler.main(sample + ["--method=next_token", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ar_right, ar_tokens = sum(r["exact"] for r in rows), sum(r["tokens"] for r in rows)
    assert re.search(rf"; next-token decoding \(--method=next_token\) of the same prompts: "
                     rf"{ar_right} of 3 "
                     rf"right \(exact\); {ar_tokens} tokens in {ar_tokens} forward passes, "
                     r"[\d.]+ tokens/s; speed-up [\d.]+x; the same tokens on \d of 3$", out[-1])
    sampler.main(sample + ["--compare_next_token=False"])
    assert "next-token" not in capsys.readouterr().out.strip().split("\n")[-1]
    # verify="exact" (SPEC 4.5): next-token decoding's own tokens, on every sample
    sampler.main(sample + ["--verify=exact"])
    assert re.search(rf"; next-token decoding \(--method=next_token\) of the same prompts: "
                     rf"{ar_right} of 3 right \(exact\); {ar_tokens} tokens in {ar_tokens} forward "
                     r"passes, [\d.]+ tokens/s; speed-up [\d.]+x; the same tokens on 3 of 3$",
                     capsys.readouterr().out.strip().split("\n")[-1])


def test_an_unconsolidated_sharded_run_names_shard_py_and_a_stale_copy_warns(trained, tmp_path,
                                                                             capsys):
    """A run trained with --fsdp=True has only ckpt_sharded.pt until `python -m tools.consolidate`
    writes ckpt.pt; a ckpt.pt older than the sharded checkpoint beside it is decoded with a warning
    saying so."""
    out = tmp_path / "fsdp-run"
    out.mkdir()
    # only its presence matters here
    (out / "ckpt_sharded.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError,
                       match=rf"no checkpoint at \S+ckpt.pt: {re.escape(str(out))} holds a sharded "
                             r"checkpoint .*`python -m tools.consolidate "
                             rf"--out_dir={re.escape(str(out))}`"):
        sampler.main([f"--out_dir={out}", "--prompt=x"])
    shutil.copy(os.path.join(trained, "ckpt.pt"), out)
    # consolidated long before the last save
    os.utime(out / "ckpt.pt", (0, 0))
    capsys.readouterr()
    load_checkpoint(str(out))
    assert capsys.readouterr().err == (f"warning: {out / 'ckpt.pt'} is older than the sharded "
                                       f"checkpoint {out / 'ckpt_sharded.pt'}; run "
                                       f"`python -m tools.consolidate --out_dir={out}` to use the "
                                       "latest weights\n")
    # consolidated after it: no warning
    os.utime(out / "ckpt.pt")
    load_checkpoint(str(out))
    assert capsys.readouterr().err == ""


def test_prompt_file_from_a_pipe_or_standard_input_is_read(trained, tmp_path, monkeypatch, capsys):
    """--prompt_file=<(command), /dev/stdin or - reads the pipe (once), as it reads a file."""
    knobs = [f"--out_dir={trained}", "--json", "--max_new_tokens=4", "--slot_size=4",
             "--serial_num_blocks=1"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("What is 7 + 7?\n".encode())))
    sampler.main(knobs + ["--prompt_file=-"])
    assert json.loads(capsys.readouterr().out)["prompt"] == "What is 7 + 7?\n"
    # what <(echo ...) hands the script
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("What is 8 + 8?"), daemon=True)
    writer.start()
    sampler.main(knobs + [f"--prompt_file={fifo}"])
    writer.join(timeout=60)
    assert json.loads(capsys.readouterr().out)["prompt"] == "What is 8 + 8?"
    with pytest.raises(ValueError, match=rf"--prompt_file={re.escape(str(tmp_path))}: "
                                         r"is a directory"):
        sampler.main(knobs + [f"--prompt_file={tmp_path}"])


def test_a_causal_checkpoint_asked_for_mdm_decoding_is_told_its_attention_not_a_canvas(trained):
    """--method=mdm on a ReFusion checkpoint (whose config holds a gen_length, as every run's does)
    is refused for its causal attention, not for a canvas length it was never trained on."""
    with pytest.raises(ValueError, match="trained with a causal objective"):
        sampler.main([f"--out_dir={trained}", "--num_samples=1", "--method=mdm",
                      "--max_new_tokens=8"])


def test_the_next_token_note_speaks_only_of_models_trained_without_next_token_labels(
        tmp_path, qa_file, capsys):
    """Next-token decoding of a refusion model (--method=next_token, or compare_next_token's half
    of the summary) says it does poorly only when training left the slots' first tokens without
    next-token labels (the paper's objective); with slot_end_labels it says nothing."""
    for name, options in [("paper", []), ("labels", ["--slot_end_labels=True"])]:
        train.main(tiny_run_flags(tmp_path, qa_file, name) + ["--max_iters=2"] + options)
        for method in ("next_token", "refusion"):
            capsys.readouterr()
            sampler.main([f"--out_dir={tmp_path / name}", "--num_samples=2", "--max_new_tokens=8",
                          "--slot_size=4", f"--method={method}"])
            noted = "never learns a slot's first token" in capsys.readouterr().err
            assert noted == (name == "paper"), (name, method)


@pytest.mark.parametrize("flags, missing", [(["--num_samples=1"], "more than one prompt"),
                                            (["--json"], "text output"),
                                            (["--method=next_token"], "--method=refusion"),
                                            (["--show"], "no --show")])
def test_an_explicit_compare_next_token_that_cannot_apply_says_why(trained, capsys, flags,
                                                                   missing):
    sampler.main([f"--out_dir={trained}", "--max_new_tokens=8", "--slot_size=4",
                  "--compare_next_token=True", *flags])
    captured = capsys.readouterr()
    assert f"note: --compare_next_token compares a summary line, which needs {missing}" in \
        captured.err
    assert "next-token decoding (--method=next_token) of the same prompts" not in captured.out


def test_init_from_takes_a_checkpoint_as_train_py_does(trained, capsys):
    """sampler.py --init_from=PATH decodes a checkpoint (a ckpt.pt or its out_dir) as --out_dir
    does, so the flag means in both scripts where the weights come from."""
    runs = [[f"--out_dir={trained}"], [f"--init_from={trained}"],
            [f"--init_from={os.path.join(trained, 'ckpt.pt')}"]]
    outputs = []
    for flags in runs:
        sampler.main(flags + ["--prompt=What is 2 + 2?", "--max_new_tokens=8", "--slot_size=4",
                             "--json"])
        outputs.append({k: v for k, v in json.loads(capsys.readouterr().out).items()
                        if k not in ("seconds", "tokens_per_s")})
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_endless_prompt_stream_is_read_only_as_far_as_a_prompt_can_go(trained):
    """--prompt_file=/dev/zero (or a pipe that never closes) was read until memory ran out; it is
    read no further than the longest text the context could hold, and refused saying so."""
    with pytest.raises(ValueError, match=r"--prompt_file=/dev/zero: longer than 16,384 bytes"):
        sampler.main([f"--out_dir={trained}", "--prompt_file=/dev/zero"])


@pytest.mark.parametrize("method", ["refusion", "next_token"])
def test_a_prompt_without_room_for_the_generation_is_refused_naming_its_own_length(trained,
                                                                                  method):
    """A prompt that leaves no room for the generation is refused before the warm-up, which
    decodes a cut of the first prompt, naming the prompt's own length, not the cut's."""
    text = "What is 12 + 12? What is 34 + 34?"
    enc = get_tokenizer(load_checkpoint(trained)["meta"]["tokenizer"])
    length = len(encode(enc, text))
    with pytest.raises(ContextTooLong, match=rf"^prompt \({length} tokens\) \+ generation"):
        sampler.main([f"--out_dir={trained}", f"--prompt={text}", "--max_new_tokens=60",
                      "--slot_size=4", f"--method={method}"])


def test_a_prompt_the_data_sets_check_cannot_judge_prints_its_answer_without_a_verdict(
        trained, monkeypatch, capsys):
    """A --prompt of the user's own gets a verdict where the data set's check can judge it (the
    quotes check: a whole line of Python); else its answer is printed all the same, without a
    verdict, and a note says why."""
    monkeypatch.setattr(sampling, "score",
                        lambda dataset, query, text: corpora.score("quotes", query, text))
    flags = [f"--out_dir={trained}", "--max_new_tokens=8", "--slot_size=4"]
    sampler.main(flags + ["--prompt=x = 'a'\n"])
    assert re.search(r"^(right|wrong) \(exact\): \d+ tokens in", capsys.readouterr().out, re.M)
    for prompt in ("print('hi'", "\"\"\"a docstring"):   # a cut line, a string left open
        sampler.main(flags + [f"--prompt={prompt}"])
        captured = capsys.readouterr()
        assert captured.out.startswith("=" * 80 + "\n" + prompt)
        assert re.match(r"\d+ tokens in \d+ forward", captured.out.splitlines()[-1])
        note = "note: no verdict: the data set's check cannot judge this prompt (not a line of"
        assert note in captured.err
        sampler.main(flags + [f"--prompt={prompt}", "--json"])
        row = json.loads(capsys.readouterr().out)
        assert row["prompt"] == prompt and "exact" not in row and row["tokens"] > 0


def test_batch_size_decodes_prompts_together_and_each_sample_stays_its_own(trained, capsys):
    """--batch_size=N: the same samples as one at a time (text, tokens, NFE: a model of clear
    margins, tests/test_batch.py), for ReFusion and for the summary's next-token half; the summary's
    tokens/s is over the batches' wall time. --show draws one decode, so it refuses a batch."""
    flags = [f"--out_dir={trained}", "--num_samples=5", "--max_new_tokens=8", "--slot_size=4"]
    for method in ("refusion", "next_token"):
        rows = {}
        for B in (1, 3):
            sampler.main(flags + ["--json", f"--method={method}", f"--batch_size={B}"])
            rows[B] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(rows[1]) == 5
        assert [(r["prompt"], r["text"], r["tokens"], r["nfe"]) for r in rows[3]] == \
            [(r["prompt"], r["text"], r["tokens"], r["nfe"]) for r in rows[1]]
    sampler.main(flags + ["--batch_size=2"])
    summary = capsys.readouterr().out.strip().split("\n")[-1]
    assert re.match(r"5 samples: .*tokens/s; next-token decoding .* speed-up [\d.]+x; the same "
                    r"tokens on \d of 5$", summary)
    for bad, message in [(["--batch_size=0"], "--batch_size=0: decode at least one prompt"),
                         (["--batch_size=2", "--show"], "--show redraws one decode at a time")]:
        with pytest.raises(ValueError, match=message):
            sampler.main(flags + bad)


def test_validation_prompts_are_the_first_that_fit_as_the_benchmarks_take_them(trained, capsys):
    """--num_samples=N decodes the first N validation prompts that leave room for the generation,
    in split order (TokenDataset.first_fitting, which the benchmarks use too): the first 2 are
    the first 2 of 5."""
    ckpt = load_checkpoint(trained)
    val = TokenDataset(ckpt["data_dir"], "val")
    enc = get_tokenizer(ckpt["meta"]["tokenizer"])
    prompts = {}
    for n in (2, 5):
        sampler.main([f"--out_dir={trained}", "--json", f"--num_samples={n}",
                      "--max_new_tokens=8", "--slot_size=4"])
        prompts[n] = [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()]
    block = ckpt["model_args"]["block_size"]
    expected = [decode(enc, val.sample(i)[0]) for i in range(len(val))
                if len(val.sample(i)[0]) + 8 <= block][:5]
    assert prompts[5] == expected and prompts[2] == expected[:2]


def test_a_prompt_gets_the_newline_its_training_prompts_end_with(tmp_path, capsys):
    """A model trained on prompts that all end with a newline (as the quotes corpus's lines do)
    gets one after a --prompt that lacks it, with a note; a model trained on prompts without one
    gets the prompt as written."""
    rows = [{"query": f"x = '{i}'\n", "response": f'x = "{i}"\n'} for i in range(60)]
    path = write(tmp_path, "lines.json", json.dumps(rows))
    train.main(tiny_run_flags(tmp_path, (path,), "lines") + ["--max_iters=1"])
    capsys.readouterr()
    flags = ["--json", "--max_new_tokens=4", "--slot_size=4"]
    sampler.main([f"--out_dir={tmp_path / 'lines'}", "--prompt=x = 'a'"] + flags)
    captured = capsys.readouterr()
    assert json.loads(captured.out)["prompt"] == "x = 'a'\n"
    assert "note: the model was trained on prompts that end with a newline" in captured.err
    sampler.main([f"--out_dir={tmp_path / 'lines'}", "--prompt=x = 'b'\n"] + flags)
    assert json.loads(capsys.readouterr().out)["prompt"] == "x = 'b'\n"
    sums = write(tmp_path, "sums.json", json.dumps(qa_rows()))
    train.main(tiny_run_flags(tmp_path, (sums,), "sums") + ["--max_iters=1"])
    capsys.readouterr()
    sampler.main([f"--out_dir={tmp_path / 'sums'}", "--prompt=What is 2 + 2?"] + flags)
    captured = capsys.readouterr()
    assert json.loads(captured.out)["prompt"] == "What is 2 + 2?" and "newline" not in captured.err


def test_next_token_decoding_picks_the_prompts_refusion_would(trained, capsys, monkeypatch):
    """The validation prompts leave room for ReFusion's rounded generation whichever the method,
    so that --method=next_token decodes the prompts the summary's next-token half decoded (6 new
    tokens in slots of 4: room for 8, for both methods)."""
    rooms, load = [], sampling.load_prompts
    monkeypatch.setattr(sampling, "load_prompts",
                        lambda cfg, enc, ckpt, room, block: rooms.append(room) or load(
                            cfg, enc, ckpt, room, block))
    for method in ("refusion", "next_token"):
        sampler.main([f"--out_dir={trained}", "--num_samples=2", "--max_new_tokens=6",
                      "--slot_size=4", f"--method={method}"])
    assert rooms == [8, 8]
