"""tools/lm_eval_model.py: our checkpoints and decoders as an lm-evaluation-harness model, run
offline through lm_eval on a local task (a JSON-lines file of quotes validation lines), against
sampler.py on the same lines and against a direct computation of the log-likelihoods."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import sampler
import train
from configurator import run_cli
from helpers import ROOT, save_tiny_hf_folder, tiny_run_flags
from support.corpora import double_quoted
from support.tokenizer import encode

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test-only package: pip install -r "
                                                "requirements-test.txt")
import yaml  # noqa: E402  (lm_eval's own dependency)
from lm_eval.api.instance import Instance  # noqa: E402
from tools import lm_eval_model  # noqa: E402  (only where lm_eval is installed)
from tools.lm_eval_model import RefusionLM, write_local_task  # noqa: E402

N_LINES = 6
DECODING = dict(max_new_tokens=16, slot_size=4, serial_num_blocks=1)


@pytest.fixture(scope="module")
def quotes_model(tmp_path_factory):
    """A tiny ReFusion model trained a few steps on the quick start's data (the quotes corpus)."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    out = tmp / "out"
    train.main([str(ROOT / "config" / "train_quotes.py"), f"--out_dir={out}",
                f"--data_root={tmp / 'data'}", "--max_iters=300", "--n_layer=2", "--n_head=2",
                "--n_embd=64", "--batch_size=16", "--eval_interval=300", "--eval_iters=1"])
    return out


def sampler_json(out, method, capsys):
    """sampler.py --json on the first N_LINES validation lines, with DECODING's settings."""
    capsys.readouterr()
    flags = [f"--out_dir={out}", f"--method={method}", f"--num_samples={N_LINES}", "--json"]
    sampler.main(flags + [f"--{k}={v}" for k, v in DECODING.items()])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("method", ["refusion", "next_token"])
def test_a_local_task_through_lm_eval_scores_what_sampler_py_reports(quotes_model, tmp_path,
                                                                     capsys, monkeypatch, method):
    """lm_eval.simple_evaluate on the local task: every response the text sampler.py decodes
    from the same line with the same settings, the exact-match score its verdicts' mean, and
    the generation requests' tokens and NFE theirs."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    lines = sampler_json(quotes_model, method, capsys)
    # a folder whose name YAML would misread unquoted
    tasks = tmp_path / "tasks: a #b"
    task = write_local_task(tasks, str(quotes_model), N_LINES, DECODING["max_new_tokens"])
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # the same decoder settings; the task's max_gen_toks is DECODING's max_new_tokens
    knobs = {k: v for k, v in DECODING.items() if k != "max_new_tokens"}
    lm = RefusionLM(out_dir=str(quotes_model), method=method, **knobs)
    results = simple_evaluate(model=lm, tasks=[task], log_samples=True,
                              task_manager=TaskManager(include_path=str(tasks)))
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc"]["query"] for s in samples] == [line["prompt"] for line in lines]
    assert [s["filtered_resps"][0] for s in samples] == [line["text"] for line in lines]
    # the task's targets are the lines' responses: the quotes corpus's expected rewrites
    assert [s["doc"]["target"] for s in samples] == [
        double_quoted(line["prompt"].rstrip("\n")) + "\n" for line in lines]
    score = results["results"][task]["exact_match,none"]
    assert score == pytest.approx(sum(line["exact"] for line in lines) / len(lines))
    speed = lm.speed()
    assert (speed["requests"], speed["tokens"], speed["nfe"]) == (
        len(lines), sum(line["tokens"] for line in lines), sum(line["nfe"] for line in lines))
    assert "generation requests" in capsys.readouterr().err


@torch.no_grad()
def cached_loglikelihood(model, context, continuation):
    """The reference: the continuation's log-likelihood read token by token through the KV cache
    (the next-token decoder's pathway), in float64 sums of float32 log-softmax values."""
    cache = model.new_kv_cache(len(context) + len(continuation))
    logits = model(torch.tensor([context]), torch.arange(len(context))[None], kv_cache=cache)
    total = 0.0
    greedy = True
    for i, token in enumerate(continuation):
        logprobs = F.log_softmax(logits[0, -1].float(), dim=-1)
        total += float(logprobs[token])
        greedy = greedy and int(logprobs.argmax()) == token
        position = torch.tensor([[len(context) + i]])
        logits = model(torch.tensor([[token]]), position, kv_cache=cache)
    return total, greedy


def requests(*args):
    return [SimpleNamespace(args=a) for a in args]


def test_log_likelihoods_equal_the_cached_pathway_for_a_checkpoint_and_a_llama_folder(
        quotes_model, tmp_path):
    """loglikelihood (requests of one length in one pass, batch_size 2 here) and
    loglikelihood_rolling equal the KV cache's token-by-token log-probabilities to 1e-5, for the
    quick start's kind of checkpoint and a tiny Llama folder."""
    save_tiny_hf_folder(tmp_path / "llama", mask=False, family="llama")
    for lm in (RefusionLM(out_dir=str(quotes_model), batch_size=2),
               RefusionLM(init_from=str(tmp_path / "llama"), batch_size=2)):
        pairs = [("x = 'a'\n", "x = \"a\"\n"), ("print('hi')", " ok"), ("abc", "def"),
                 ("", "first"), ("y = 1  ", "z")]
        got = lm.loglikelihood(requests(*pairs))
        for (context, continuation), (score, greedy) in zip(pairs, got):
            ids = lm.pair_ids(context, continuation)
            want, want_greedy = cached_loglikelihood(lm.model, *ids)
            assert score == pytest.approx(want, abs=1e-5) and greedy == want_greedy
        text = "def f(x):\n    return 'x'\n"
        rolling = lm.loglikelihood_rolling(requests((text,)))
        tokens = encode(lm.enc, text)
        want, _ = cached_loglikelihood(lm.model, [lm.ids["eos_ids"][0]], tokens)
        assert rolling[0] == pytest.approx(want, abs=1e-5)


def test_an_mdm_generates_but_refuses_a_log_likelihood_naming_why(tmp_path, qa_file):
    """An MDM decodes generation requests with its own decoder; a log-likelihood request is
    refused: a bidirectional model has no exact one."""
    train.main(tiny_run_flags(tmp_path, qa_file, "mdm", objective="mdm") + ["--max_iters=2"])
    lm = RefusionLM(out_dir=str(tmp_path / "mdm"))
    # the checkpoint's layout (train.py --gen_length=16) whatever the request asks
    assert (lm.cfg["method"], lm.cfg["mdm_shift"], lm.canvas) == ("mdm", False, 16)
    text, = lm.generate_until(requests(("What is 2 + 2?", {"until": [], "max_gen_toks": 5})))
    assert lm.speed()["nfe"] == 16 and len(text) <= 5  # a byte token: at most one character
    assert lm.speed()["tokens"] <= 5                   # the tokens returned, not the canvas
    with pytest.raises(ValueError, match="bidirectional attention .* no exact log-likelihood"):
        lm.loglikelihood(requests(("What is 2 + 2?", " 4")))
    # the schedule is checked on the trained canvas of 16, not sampler.py's default length of
    # 128: 4 blocks of 4 tokens, a step each, are valid; 32 steps for 16 tokens are not
    lm = RefusionLM(out_dir=str(tmp_path / "mdm"), steps=4, block_length=4)
    lm.generate_until(requests(("What is 2 + 2?", {"until": [], "max_gen_toks": 5})))
    assert lm.speed()["nfe"] == 4
    with pytest.raises(ValueError, match="steps=32 > max_new_tokens=16"):
        RefusionLM(out_dir=str(tmp_path / "mdm"), steps=32)


def test_without_lm_eval_the_adapter_says_how_to_install_it():
    code = "import sys; sys.modules['lm_eval'] = None; import tools.lm_eval_model"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "pip install lm-eval==0.4.13" in run.stderr


def test_bad_model_args_are_refused_before_any_request_and_in_one_line(quotes_model, tmp_path,
                                                                         monkeypatch):
    """A decoder setting that cannot work, or a sampler.py setting the model does not read
    (compile, max_new_tokens, ...), is refused when the model is built; from the command line
    each mistake (lm_eval's --batch_size 0 and --apply_chat_template too) is one error line, as
    sampler.py's, not a traceback (one in a process of its own, the others in this one)."""
    with pytest.raises(ValueError, match="slot_size=0: a slot holds at least one token"):
        RefusionLM(out_dir=str(quotes_model), slot_size=0)
    with pytest.raises(ValueError, match="model args compile, max_new_tokens: not read"):
        RefusionLM(out_dir=str(quotes_model), compile=True, max_new_tokens=5)
    task = write_local_task(tmp_path, str(quotes_model), 2, 8)
    # lm_eval's own --batch_size reaches the model; its --apply_chat_template names chat=True
    mistakes = ((f"out_dir={quotes_model},slot_sze=4", [], "error: unknown config key"),
                (f"out_dir={quotes_model}", ["--batch_size", "0"], "error: batch_size=0: give"))
    argv = [["--model", "refusion", "--model_args", args, "--tasks", task, "--include_path",
             str(tmp_path), *flags] for args, flags, _ in mistakes]
    run = subprocess.run([sys.executable, "-m", "tools.lm_eval_model", *argv[0]], cwd=ROOT,
                         capture_output=True, text=True,
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                              "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(mistakes[0][2]), run.stderr[-500:]
    assert "Traceback" not in run.stderr
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))     # lm_eval's parser reads sys.argv
    with pytest.raises(SystemExit) as stop:
        run_cli(lm_eval_model.main, argv[1])
    assert str(stop.value.code).startswith(mistakes[1][2]) and "\n" not in str(stop.value.code)
    # what lm_eval calls for --apply_chat_template, before any request
    with pytest.raises(ValueError, match="lm_eval's --apply_chat_template is not supported by the "
                                         "model .*chat=True"):
        RefusionLM(out_dir=str(quotes_model)).apply_chat_template([{"role": "user",
                                                                    "content": "hi"}])


def test_gen_kwargs_are_read_as_lm_evals_own_models_read_them(quotes_model):
    """`until` is a stop string or a list of them (never its characters), max_gen_toks has
    lm_eval's aliases, do_sample=False is greedy whatever the temperature; a field the model
    does not read, or a value that cannot work, is refused naming the request and the field."""
    knobs = {k: v for k, v in DECODING.items() if k != "max_new_tokens"}
    lm = RefusionLM(out_dir=str(quotes_model), **knobs)
    context = "x = 'a'\n"

    def answer(**gen_kwargs):
        return lm.generate_until(requests((context, gen_kwargs)))[0]

    whole = answer(until=[], max_gen_toks=16)
    assert len(whole) >= 3
    stop = whole[1:3]
    assert answer(until=stop, max_gen_toks=16) == whole[:whole.index(stop)]
    assert answer(until=[stop], max_gen_toks=16) == whole[:whole.index(stop)]
    # a string of which only the first character occurs: no cut at that character
    assert answer(until=whole[0] + "\x00", max_gen_toks=16) == whole
    assert answer(max_new_tokens=4) == answer(max_gen_toks=4)
    assert answer(until=[], max_gen_toks=16, do_sample=False, temperature=0.8) == whole
    request = Instance("generate_until", {}, (context, {"top_p": 0.9}), 0, ("local_quotes", 7, 1))
    with pytest.raises(ValueError, match=r"request 0 \(local_quotes, doc 7\): gen_kwargs top_p: "
                                         "not supported"):
        lm.generate_until([request])
    with pytest.raises(ValueError, match="request 0: do_sample=True at temperature 0"):
        answer(do_sample=True)
    with pytest.raises(ValueError, match="request 0: until=\\[None\\]: give a stop string"):
        answer(until=[None])
    with pytest.raises(ValueError, match="request 0: do_sample='yes': give true or false"):
        answer(do_sample="yes")


def test_edge_requests_get_lm_evals_answers_or_name_the_request_and_field(quotes_model):
    """max_gen_toks 0 is the empty text with no forward pass; an empty context is conditioned on
    EOS, as lm_eval conditions an empty log-likelihood context; an empty continuation scores
    (0.0, True), as lm_eval's models score it; a negative max_gen_toks, one past the context and a
    continuation longer than the context are refused naming the request and the field."""
    lm = RefusionLM(out_dir=str(quotes_model), slot_size=4)
    texts = lm.generate_until(requests(("x = 'a'\n", {"max_gen_toks": 0}),
                                       ("", {"until": "\n", "max_gen_toks": 4})))
    assert texts[0] == "" and isinstance(texts[1], str)
    assert lm.speed()["requests"] == 2 and lm.speed()["nfe"] >= 1
    with pytest.raises(ValueError, match="request 1: max_gen_toks=-1: ask for 0 or more"):
        lm.generate_until(requests(("a", {"max_gen_toks": 1}), ("a", {"max_gen_toks": -1})))
    with pytest.raises(ValueError, match="request 0: max_gen_toks=1000 takes 1000 positions .* "
                                         "leaves no room for a prompt"):
        lm.generate_until(requests(("a", {"max_gen_toks": 1000})))
    scored = lm.loglikelihood(requests(("abc", ""), ("abc", "def"), ("", "")))
    assert scored[0] == (0.0, True) and scored[2] == (0.0, True)
    assert scored[1] == lm.loglikelihood(requests(("abc", "def")))[0]
    with pytest.raises(ValueError, match=r"request 1: the continuation is \d+ tokens, more than "
                                         "one pass of the model's context of 160"):
        lm.loglikelihood(requests(("abc", "def"), ("abc", "a b " * 200)))


def test_batch_size_is_lm_evals_or_the_model_args_and_a_bad_one_is_refused(quotes_model):
    """lm_eval's --batch_size (a string) is read where the model args give none, 1 where neither
    does; 0, -1, a word and lm_eval's "auto" are refused naming batch_size."""
    args = f"out_dir={quotes_model}"
    lm_evals = {"batch_size": "3", "max_batch_size": None, "device": "cuda:0"}
    assert RefusionLM.create_from_arg_string(args, lm_evals).batch_size == 3
    assert RefusionLM.create_from_arg_string(args + ",batch_size=2", lm_evals).batch_size == 2
    assert RefusionLM.create_from_arg_string(args).batch_size == 1
    for bad in (0, -1, "0", "two", True):
        with pytest.raises(ValueError, match=f"batch_size={bad}: give a whole number >= 1"):
            RefusionLM(out_dir=str(quotes_model), batch_size=bad)
    for auto in ("auto", "auto:4"):
        with pytest.raises(ValueError, match=f"batch_size={auto}: lm_eval's automatic batch "
                                             "size .* not implemented"):
            RefusionLM.create_from_arg_string(args, dict(lm_evals, batch_size=auto))


def test_a_local_task_quotes_its_path_and_refuses_counts_that_make_no_task(quotes_model,
                                                                           tmp_path):
    """The task's YAML reads back as written, whatever the folder's name (": " and " #" in it);
    num_samples, max_gen_toks and room below 1, room below max_gen_toks or past the context are
    refused naming the count."""
    folder = tmp_path / "tasks: a #b"
    task = write_local_task(folder, str(quotes_model), 2, 8)
    config = yaml.safe_load((folder / f"{task}.yaml").read_text())
    data = config["dataset_kwargs"]["data_files"]["test"]
    assert data == str(folder / f"{task}.jsonl")
    assert (config["task"], config["doc_to_text"]) == (task, "{{query}}")
    assert config["generation_kwargs"] == {"until": [], "max_gen_toks": 8}
    assert len(open(data).read().splitlines()) == 2
    for counts, message in ((dict(num_samples=0), "num_samples=0: give a whole number >= 1"),
                            (dict(num_samples=-1), "num_samples=-1: give a whole number >= 1"),
                            (dict(max_gen_toks=0), "max_gen_toks=0: give a whole number >= 1"),
                            (dict(room=0), "room=0: give a whole number >= 1"),
                            (dict(room=4), "room=4 < max_gen_toks=8"),
                            (dict(room=160), "room=160: the model's context of 160 positions")):
        with pytest.raises(ValueError, match=message):
            write_local_task(tmp_path / "other", str(quotes_model), **{"max_gen_toks": 8, **counts})


def test_the_model_arg_verify_exact_answers_as_next_token_decoding(quotes_model):
    """verify=exact (SPEC 4.5) as a model arg: every generation request is answered with next-token
    decoding's text, in fewer forward passes."""
    contexts = ["x = 'a'\n", "print('hi', end='')\n", "s = 'it''s'\n"]
    batch = requests(*[(c, {"until": [], "max_gen_toks": 24}) for c in contexts])
    exact = RefusionLM(out_dir=str(quotes_model), verify="exact", slot_size=8)
    next_token = RefusionLM(out_dir=str(quotes_model), method="next_token")
    assert exact.generate_until(batch) == next_token.generate_until(batch)
    assert exact.speed()["nfe"] < next_token.speed()["nfe"]
