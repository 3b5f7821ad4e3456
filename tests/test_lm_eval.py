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
from helpers import ROOT, save_tiny_hf_folder, tiny_run_flags
from support.corpora import double_quoted
from support.tokenizer import encode

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test-only package: pip install -r "
                                                "requirements-test.txt")
from tools.lm_eval_model import RefusionLM, write_local_task  # noqa: E402  (only where lm_eval is installed)

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
    task = write_local_task(tmp_path, str(quotes_model), N_LINES, DECODING["max_new_tokens"])
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # the same decoder settings; the task's max_gen_toks is DECODING's max_new_tokens
    knobs = {k: v for k, v in DECODING.items() if k != "max_new_tokens"}
    lm = RefusionLM(out_dir=str(quotes_model), method=method, **knobs)
    results = simple_evaluate(model=lm, tasks=[task], log_samples=True,
                              task_manager=TaskManager(include_path=str(tmp_path)))
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


def test_without_lm_eval_the_adapter_says_how_to_install_it():
    code = "import sys; sys.modules['lm_eval'] = None; import tools.lm_eval_model"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "pip install lm-eval==0.4.13" in run.stderr



def test_bad_model_args_are_refused_before_any_request_and_in_one_line(quotes_model, tmp_path):
    """A decoder setting that cannot work, or a sampler.py setting the model does not read
    (compile, max_new_tokens, ...), is refused when the model is built; from the command line
    each mistake is one error line, as sampler.py's, not a traceback."""
    with pytest.raises(ValueError, match="slot_size=0: a slot holds at least one token"):
        RefusionLM(out_dir=str(quotes_model), slot_size=0)
    with pytest.raises(ValueError, match="model args compile, max_new_tokens: not read"):
        RefusionLM(out_dir=str(quotes_model), compile=True, max_new_tokens=5)
    task = write_local_task(tmp_path, str(quotes_model), 2, 8)
    for args, message in ((f"out_dir={quotes_model},slot_sze=4", "error: unknown config key"),):
        run = subprocess.run([sys.executable, "-m", "tools.lm_eval_model", "--model", "refusion",
                              "--model_args", args, "--tasks", task, "--include_path",
                              str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                  "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"})
        assert run.returncode == 1, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith(message), run.stderr[-500:]
        assert "Traceback" not in run.stderr
