"""Training runs: start modes, schedule, resume, distributed, precision (train.py,
support/runs.py)."""

import contextlib
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import data
import train
from helpers import ROOT, TOL, free_port, qa_rows, tiny_model, tiny_run_flags, write
from support import checkpoint, compiled, runs
from support.benchmark import train_or_reuse
from support.checkpoint import load_checkpoint, save_checkpoint
from support.compiled import ISA_SETTINGS, check_compile
from support.progress import Rates
from test_refusion import random_samples
from train import flops_per_token, hybrid_loss, load_weights, make_batch



def test_init_from_a_checkpoint_without_the_mask_token_adds_its_row():
    # an ARM whose vocabulary has no mask id
    small = tiny_model(seed=4, vocab_size=38)
    big = tiny_model(seed=5, vocab_size=40)
    load_weights(big, {"model": small.state_dict()})
    emb_small, emb_big = small.embed_tokens.weight, big.embed_tokens.weight
    torch.testing.assert_close(emb_big[:38], emb_small, atol=0, rtol=0)
    torch.testing.assert_close(emb_big[38:], emb_small.mean(0).expand(2, -1), atol=TOL, rtol=0)
    for name, p in small.named_parameters():                  # every other weight copied exactly
        if "embed_tokens" not in name and "lm_head" not in name:
            torch.testing.assert_close(big.get_parameter(name), p, atol=0, rtol=0)
    with pytest.raises(ValueError, match="does not fit"):
        load_weights(tiny_model(n_layer=3), {"model": small.state_dict()})


def test_learning_rate_schedule_and_a_resume_with_more_iterations_holds_min_lr(tmp_path, qa_file):
    """Warm-up, cosine to min_lr at lr_decay_iters (default: max_iters, fixed when the run starts),
    then min_lr: resuming with a larger --max_iters continues at min_lr instead of jumping back
    up."""
    cfg = dict(learning_rate=1.0, min_lr=0.1, warmup_iters=2, lr_decay_iters=12)
    assert [train.get_lr(it, cfg) for it in (0, 1, 2, 7, 12, 20)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1, 0.1])
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--warmup_iters=1", "--learning_rate=0.01",
                                                        "--min_lr=0.001"]
    train.main(flags + ["--max_iters=3"])
    assert load_checkpoint(str(tmp_path / "run"))["config"]["lr_decay_iters"] == 3
    train.main(flags + ["--max_iters=5", "--init_from=resume"])
    ckpt = load_checkpoint(str(tmp_path / "run"))
    assert ckpt["iter_num"] == 5 and ckpt["config"]["lr_decay_iters"] == 3
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == pytest.approx([0.001, 0.001])
    # a checkpoint from before the setting: its decay ended at its max_iters (5)
    del ckpt["config"]["lr_decay_iters"]
    save_checkpoint(str(tmp_path / "run"), ckpt)
    train.main(flags + ["--max_iters=7", "--init_from=resume"])
    ckpt = load_checkpoint(str(tmp_path / "run"))
    assert ckpt["config"]["lr_decay_iters"] == 5
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == pytest.approx([0.001, 0.001])


def test_grad_clip_zero_means_no_clipping(tmp_path, qa_file):
    """--grad_clip=0 trains unclipped (as in nanoGPT), the same as a clip far above any gradient
    norm."""
    for name, clip in (("none", "0.0"), ("huge", "1e9")):
        train.main(tiny_run_flags(tmp_path, qa_file, name) +
                   ["--max_iters=2", f"--grad_clip={clip}"])
    a, b = load_checkpoint(str(tmp_path / "none")), load_checkpoint(str(tmp_path / "huge"))
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], atol=0, rtol=0)


@pytest.mark.parametrize("objective", ["refusion", "mdm"])
def test_resumed_training_matches_an_uninterrupted_run(tmp_path, qa_file, objective):
    train.main(tiny_run_flags(tmp_path, qa_file, "straight", objective) + ["--max_iters=6"])
    train.main(tiny_run_flags(tmp_path, qa_file, "resumed", objective) + ["--max_iters=3"])
    train.main(tiny_run_flags(tmp_path, qa_file, "resumed", objective) +
               ["--max_iters=6", "--init_from=resume"])
    a, b = load_checkpoint(str(tmp_path / "straight")), load_checkpoint(str(tmp_path / "resumed"))
    assert a["iter_num"] == b["iter_num"] == 6
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], atol=0, rtol=0)


def timed_main(flags):
    """train.main(flags); the minutes it took, timed from outside."""
    t0 = time.perf_counter()
    train.main(flags)
    return (time.perf_counter() - t0) / 60


def test_a_checkpoint_records_the_minutes_of_every_run_that_trained_it(tmp_path, qa_file):
    """train_minutes: the first run's, then its resume's added; a run from a checkpoint's weights
    counts from nothing; a checkpoint from before the minutes were recorded resumes without them;
    a benchmark's train_or_reuse returns (and keeps) the checkpoint's figure."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    first = timed_main(flags + ["--max_iters=3"])
    m1 = load_checkpoint(str(tmp_path / "run"))["train_minutes"]
    assert 0 < m1 <= first
    second = timed_main(flags + ["--max_iters=6", "--init_from=resume"])
    m2 = load_checkpoint(str(tmp_path / "run"))["train_minutes"]
    assert m1 < m2 <= m1 + second
    tuned = timed_main(tiny_run_flags(tmp_path, qa_file, "tuned") +
                       ["--max_iters=2", f"--init_from={tmp_path / 'run'}"])
    assert 0 < load_checkpoint(str(tmp_path / "tuned"))["train_minutes"] <= tuned
    old = load_checkpoint(str(tmp_path / "run"))
    del old["train_minutes"]
    save_checkpoint(str(tmp_path / "run"), old)
    train.main(flags + ["--max_iters=8", "--init_from=resume"])
    assert load_checkpoint(str(tmp_path / "run"))["train_minutes"] is None
    minutes = train_or_reuse(train.main, train.DEFAULTS,
                             tiny_run_flags(tmp_path, qa_file, "bench") + ["--max_iters=2"])
    assert minutes == load_checkpoint(str(tmp_path / "bench"))["train_minutes"] == json.loads(
        (tmp_path / "bench" / "train_minutes.json").read_text())["minutes"]


def test_training_never_overwrites_a_checkpoint_unless_resuming(tmp_path, qa_file):
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"]
    train.main(flags)
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    # neither a fresh run nor a fine-tune
    for init in ([], [f"--init_from={ckpt}"]):
        with pytest.raises(ValueError, match="already exists.*--init_from=resume"):
            train.main(flags + init)
    assert ckpt.read_bytes() == before
    with pytest.raises(ValueError, match="--n_layer=2 differs from the checkpoint's 1"):
        train.main(flags + ["--init_from=resume", "--n_layer=2", "--max_iters=4"])
    with pytest.raises(ValueError, match="already trained for 2 iterations"):
        train.main(flags + ["--init_from=resume"])
    assert ckpt.read_bytes() == before


def _ddp_worker(rank, flags, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    train.main(flags)


def test_two_processes_match_one_with_gradient_accumulation(tmp_path, qa_file):
    """torchrun's data parallelism (2 processes, gloo) equals 1 process accumulating the same global
    batch."""
    steps = ["--max_iters=3", "--gradient_accumulation_steps=2"]
    train.main(tiny_run_flags(tmp_path, qa_file, "one") + steps)
    torch.multiprocessing.spawn(_ddp_worker,
                                args=(tiny_run_flags(tmp_path, qa_file, "two") + steps,
                                       free_port()),
                                nprocs=2)
    a, b = load_checkpoint(str(tmp_path / "one")), load_checkpoint(str(tmp_path / "two"))
    assert a["iter_num"] == b["iter_num"] == 3
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], atol=1e-5, rtol=0)


def test_under_torchrun_nccl_is_told_the_gpu_of_each_process(monkeypatch):
    """On CUDA each process takes cuda:LOCAL_RANK and hands it to init_process_group as device_id,
    so NCCL does not guess it from the rank; gloo on a CPU gets none. No GPU needed: both calls are
    recorded, not made."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cuda = {"device": "cuda", "gradient_accumulation_steps": 4}
    cpu = {"device": "cpu", "gradient_accumulation_steps": 4}
    assert runs.setup_distributed(cuda) == runs.setup_distributed(cpu) == (3, 4)
    assert cuda["device"] == "cuda:1"
    assert calls == [(("nccl",), {"device_id": torch.device("cuda:1")}), (("gloo",), {})]


@pytest.mark.parametrize("ending", ["end", "error", "ctrl_c", "sigterm"])
def test_every_end_of_a_run_under_torchrun_leaves_the_process_group(tmp_path, qa_file, monkeypatch,
                                                                    ending):
    """A run under torchrun (here 1 process, gloo) leaves its process group however it ends: at
    max_iters, an error inside the loop, Ctrl-C raised there, or a SIGTERM it saves and stops on
    (support.runs.process)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    real_step = train.train_step
    joined = []

    def ending_step(cfg, model, forward, optimizer, train_data, it, *rest):
        joined.append(torch.distributed.is_initialized())
        if it == 1 and ending == "error":
            raise RuntimeError("a step failed")
        if it == 1 and ending == "ctrl_c":
            raise KeyboardInterrupt
        if it == 1 and ending == "sigterm":
            signal.raise_signal(signal.SIGTERM)
        return real_step(cfg, model, forward, optimizer, train_data, it, *rest)

    monkeypatch.setattr(train, "train_step", ending_step)
    raised = {"end": None, "error": RuntimeError, "ctrl_c": KeyboardInterrupt,
              "sigterm": SystemExit}[ending]
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=3"])
    assert joined and all(joined)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_is_what_torch_counts_for_a_training_step(tie):
    """The FLOP/s and MFU in the progress bar: flops_per_token x tokens equals the matrix-multiply
    FLOPs PyTorch's own counter sees in one forward + backward (dense attention kernel)."""
    model = tiny_model(seed=9, tie_embeddings=tie).train()
    B, T = 3, 48
    idx = torch.randint(0, 40, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, torch.arange(T).expand(B, T)).sum().backward()
    assert flops_per_token(model, T) * B * T == counter.get_total_flops()


# CPU autocast's rms_norm
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("objective", ["refusion", "next_token", "mdm"])
def test_bf16_autocast_trains_every_objective_close_to_float32(objective):
    """On CUDA training runs under bf16 autocast; the same code under CPU autocast (a stand-in for
    a GPU here) gives float32 logits, a loss within 1% and gradients for every weight."""
    # the MDM's canvas: prompt + gen_length positions, within the context
    model = tiny_model(seed=12, causal=objective != "mdm", block_size=512).train()
    tokens, prompt_len, length = random_samples(13, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    cfg = dict(train.DEFAULTS, objective=objective)
    meta = {"mask_id": 38, "eos_id": 37, "pad_id": 39}
    batch = make_batch(cfg, tokens, prompt_len, length, meta, torch.Generator().manual_seed(0))
    logits = model(batch.idx, batch.position_ids, attn_mask=batch.attn_mask)
    reference = hybrid_loss(logits, batch)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch.idx, batch.position_ids, attn_mask=batch.attn_mask)
    assert logits.dtype == torch.float32
    loss = hybrid_loss(logits, batch)[0]
    loss.backward()
    assert abs(loss.item() - reference.item()) < 0.01 * reference.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("objective", ["refusion", "ar"])
def test_packed_rows_give_the_unpacked_loss_and_gradients(objective):
    """--pack: each sample of the batch lies whole in one row, at its own position ids, and the
    loss and every gradient are the unpacked batch's, from fewer rows."""
    model = tiny_model(seed=14).train()
    tokens, prompt_len, length = random_samples(15, B=12, T=60, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    cfg = dict(train.DEFAULTS, objective=objective, slot_sizes=(4, 8), ar_fraction=0.3)
    batch = make_batch(cfg, tokens, prompt_len, length, {"mask_id": 38, "eos_id": 37,
                                                         "pad_id": 39}, torch.Generator())
    packed = data.pack_rows(batch, length)
    assert packed.idx.shape[0] < 12 and packed.idx.shape[1] == batch.idx.shape[1]
    for i in range(12):                                # sample i's tokens, in order, in one row
        row, at = (packed.sample_id == i).nonzero().T
        assert len(set(row.tolist())) == 1 and at.tolist() == list(range(at[0], at[0] + length[i]))
        for name in ("idx", "position_ids", "labels", "mdm_weight"):
            assert torch.equal(getattr(packed, name)[row, at], getattr(batch, name)[i, :length[i]])

    def loss_and_grads(b):
        model.zero_grad()
        losses = hybrid_loss(model(b.idx, b.position_ids, attn_mask=b.attn_mask), b)
        losses[0].backward()
        return [x.detach() for x in losses] + [p.grad.clone() for p in model.parameters()]

    for a, b in zip(loss_and_grads(packed), loss_and_grads(batch), strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_compile_never_changes_the_loss_or_the_gradients():
    """--compile=True (torch.compile) on a ReFusion batch: the same hybrid loss and gradients as
    eager."""
    model = tiny_model(seed=10).train()
    tokens, prompt_len, length = random_samples(11, B=4, T=40, vocab=36)
    tokens[tokens == 258] = 39                                        # the tiny model's pad id
    batch = data.reorganize_slots(tokens, prompt_len, length, (4, 8), 38,
                                  torch.Generator().manual_seed(0))

    def loss_and_grads(forward):
        model.zero_grad()
        loss = hybrid_loss(forward(batch.idx, batch.position_ids, attn_mask=batch.attn_mask),
                           batch)[0]
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    cfg = {"compile": True, "device": "cpu"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # what train.py does with --compile=True
        check_compile(cfg)
    if not cfg["compile"]:
        pytest.skip(f"torch.compile cannot run here: {caught[0].message}")
    compiled = torch.compile(model)
    for a, b in zip(loss_and_grads(compiled), eager, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_compiling_under_lowered_code_paths_never_reads_kernels_compiled_under_others(tmp_path):
    """Inductor's cache, shared, gave NaN losses to a model compiled under
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 after a run without them (torch 2.13, an
    AVX-512 CPU): check_compile gives those settings a cache of their own. The test above, run
    without them and then with them, both in one fresh temporary folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ISA_SETTINGS + ("TORCHINDUCTOR_CACHE_DIR",)}
    env["TMPDIR"] = str(tmp_path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/test_train.py::test_compile_never_changes_the_loss_or_the_gradients"]
    for lowered in ({}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}):
        done = subprocess.run(command, cwd=ROOT, env=env | lowered, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout[-3000:]


def test_deterministic_training_turns_deterministic_kernels_on_and_repeats_to_the_bit(
        tmp_path, qa_file, monkeypatch, capsys):
    """--deterministic=True: while the run trains, torch's deterministic algorithms are on, cuBLAS
    gets its fixed workspace and cuDNN picks no kernel by timing; two runs of the same seed end on
    the same bits and print the same losses (a CPU is deterministic anyway: the GPU's part is what
    the flags are); the checkpoint records the setting, and the process's settings are back after
    the run."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    real_step = train.train_step
    seen = set()

    def watched_step(*args):
        seen.add((torch.are_deterministic_algorithms_enabled(),
                  os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.backends.cudnn.benchmark))
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", watched_step)
    printed = {}
    for name in ("a", "b"):
        train.main(tiny_run_flags(tmp_path, qa_file, name) + ["--max_iters=4",
                                                              "--deterministic=True"])
        printed[name] = re.findall(r"^iter \d+: (?:val )?loss \d+\.\d{4}", capsys.readouterr().out,
                                   re.MULTILINE)
    assert seen == {(True, ":4096:8", False)}
    assert printed["a"] == printed["b"] and len(printed["a"]) >= 4
    a, b = load_checkpoint(str(tmp_path / "a")), load_checkpoint(str(tmp_path / "b"))
    assert a["config"]["deterministic"] is True
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], atol=0, rtol=0)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    # without the flag, nothing is changed
    seen.clear()
    train.main(tiny_run_flags(tmp_path, qa_file, "c") + ["--max_iters=2"])
    assert seen == {(False, None, torch.backends.cudnn.benchmark)}


def test_deterministic_kernels_reach_torch_compile_and_every_setting_comes_back(monkeypatch):
    """With compile, Inductor chooses no kernel by timing either; a CUBLAS_WORKSPACE_CONFIG already
    set is kept; after the block, even one that raised, every setting is as it was."""
    from torch._inductor import config as inductor_config
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.raises(RuntimeError, match="inside"):
        with runs.deterministic_algorithms(compiled=True):
            assert torch.are_deterministic_algorithms_enabled() and inductor_config.deterministic
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
            raise RuntimeError("inside")
    assert not torch.are_deterministic_algorithms_enabled() and not inductor_config.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_training_input_errors_lose_nothing(tmp_path, qa_file):
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    other = tiny_run_flags(tmp_path, qa_file, "other")
    for extra, message in [
        (["--device=cuda"] if not torch.cuda.is_available() else ["--device=tpu"],
         "--device=.*use"),
        (["--n_embd=20", "--n_head=4"], "head_dim=5 must be even"),
        (["--too_long=truncate"], "--too_long='truncate': choose skip or fail"),
        (["--block_size=24", "--too_long=fail"],
         "is .* tokens, longer than block_size=24; raise --block_size"),
        (["--gradient_accumulation_steps=0"], "--gradient_accumulation_steps=0: must be positive"),
        (["--n_kv_head=-2"], "--n_kv_head=-2: must be 0 or more"),
        (["--grad_clip=-1.0"], "--grad_clip=-1.0: must be 0 or more"),
        (["--mask_eps=2.0"], r"--mask_eps=2.0: must be in \[0, 1\)"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            train.main(other + extra + ["--max_iters=2"])
    assert ckpt.read_bytes() == before and not (tmp_path / "other" / "ckpt.pt").exists()


def test_a_loss_that_becomes_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, qa_file):
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    # an absurd learning rate overflows the weights after one step, as a diverging run would
    with pytest.raises(SystemExit,
                       match=r"loss became nan at iteration \d; the last good checkpoint"):
        train.main(flags + ["--max_iters=6", "--init_from=resume", "--learning_rate=1e30",
                            "--grad_clip=0"])
    assert ckpt.read_bytes() == before


# long enough to be stopped after its first checkpoint
KILLED_RUN = ["--max_iters=400", "--eval_interval=50"]


def train_py(flags, **kwargs):
    """train.py run as a command, on one thread (so that runs in two processes give the same
    weights)."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], check=True,
                          capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"), **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights of a KILLED_RUN never stopped (trained once for every signal below)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    train_py(tiny_run_flags(tmp, (write(tmp, "sums.json", json.dumps(qa_rows())),), "straight") +
             KILLED_RUN)
    return load_checkpoint(str(tmp / "straight"))["model"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGKILL"])
def test_killed_training_resumes_to_the_same_weights(tmp_path, qa_file, uninterrupted, sig):
    """Interrupted (Ctrl-C; SIGTERM from Slurm, `docker stop` or torchrun; SIGHUP when the terminal
    closes; a scheduler's SIGUSR1: saves at once) or killed (resumes from the last periodic
    checkpoint), then resumed: the same final weights as a run that was never stopped."""
    stopped = tiny_run_flags(tmp_path, qa_file, "stopped") + KILLED_RUN
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *stopped],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt = tmp_path / "stopped" / "ckpt.pt"
    while not ckpt.exists() and proc.poll() is None:       # stop it after the first checkpoint
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    if sig != "SIGKILL":
        assert proc.returncode == 1 and b"--init_from=resume" in err
    stopped_at = load_checkpoint(str(ckpt))["iter_num"]
    assert 0 < stopped_at < 400
    train_py(stopped + ["--init_from=resume"])
    resumed = load_checkpoint(str(ckpt))["model"]
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=0, rtol=0)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                    reason="torch.compile on a CPU needs a C compiler")
def test_a_stop_while_the_first_step_compiles_ends_the_run_at_once_losing_nothing(tmp_path,
                                                                                  qa_file):
    """SIGTERM (`docker stop`, which waits 10 s) while a resumed --compile=True run compiles its
    first step (tens of seconds on a CPU, in an empty compile cache): the run ends within seconds,
    saying its checkpoint is as it was and how to continue; it was, and it continues."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "compiled"))
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags, "--init_from=resume",
                             "--max_iters=6", "--compile=True"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # the line before the loop, then a second into compiling
    while "parameters" not in proc.stdout.readline():
        assert proc.poll() is None
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 1
    assert err.splitlines()[-1] == (f"interrupted before the first step; {ckpt} is as it was. "
                                    f"Continue with `python train.py --out_dir={ckpt.parent} "
                                    "--init_from=resume`")
    assert ckpt.read_bytes() == before and sorted(os.listdir(ckpt.parent)) == [".lock", "ckpt.pt"]
    train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert load_checkpoint(str(ckpt))["iter_num"] == 4


def test_a_stop_before_the_first_step_of_a_new_run_ends_it_at_once_writing_nothing(tmp_path,
                                                                                   qa_file,
                                                                                   monkeypatch):
    """SIGTERM during a new run's first evaluation (before any step, nothing to save): the run ends
    there, not after its first step, and leaves no out_dir behind."""
    real_estimate = train.estimate_loss

    def stopped(*args):
        signal.raise_signal(signal.SIGTERM)
        return real_estimate(*args)
    monkeypatch.setattr(train, "estimate_loss", stopped)
    with pytest.raises(SystemExit, match="^interrupted before the first step; nothing was saved: "
                                         "run the same command again to start$"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=4"])
    assert not (tmp_path / "run").exists()


def test_checkpoint_tokenizer_mismatch_and_crashed_writes_lose_nothing(tmp_path, qa_file,
                                                                       monkeypatch):
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    # a checkpoint of another tokenizer
    foreign = torch.load(ckpt, weights_only=True)
    foreign["meta"]["tokenizer"] = "gpt2"
    torch.save(foreign, tmp_path / "gpt2.pt")
    with pytest.raises(ValueError,
                       match="trained with the 'gpt2' tokenizer but this run uses 'bytes'"):
        train.main(tiny_run_flags(tmp_path, qa_file, "ft") +
                   [f"--init_from={tmp_path / 'gpt2.pt'}"])

    def crash(obj, f):                                                # an error mid-write
        f.write(b"partial")
        raise OSError("Input/output error")
    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match="Input/output error"):
        train.main(flags + ["--init_from=resume", "--max_iters=4"])
    assert ckpt.read_bytes() == before                                # the old checkpoint is intact
    # no temp file; the lock, released
    assert sorted(os.listdir(ckpt.parent)) == [".lock", "ckpt.pt"]


def test_small_data_warns_and_compile_falls_back_where_it_cannot_run(tmp_path, qa_file,
                                                                     monkeypatch, capsys):
    # no C compiler on this machine
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="torch.compile cannot run here"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") +
                   ["--max_iters=1", "--compile=True", "--batch_size=200"])
    assert "fewer than one batch of 200; batches draw samples with replacement" in \
        capsys.readouterr().err


def test_what_a_resumed_run_or_a_fine_tune_cannot_change_is_checked_first_and_named_at_once(
        tmp_path, qa_file):
    """A resume repeating its first command's flags but another objective and depth: the flags
    that contradict the checkpoint are named together, before the checks of the settings they
    would make (an MDM's canvas of the default --gen_length=128 does not fit --block_size=64)."""
    flags = [f for f in tiny_run_flags(tmp_path, qa_file, "run") if not f.startswith("--gen")]
    train.main(flags + ["--max_iters=2"])
    with pytest.raises(ValueError) as refused:
        train.main(flags + ["--init_from=resume", "--max_iters=4", "--objective=mdm",
                            "--n_layer=2"])
    assert re.fullmatch(r"--n_layer=2 differs from the checkpoint's 1; --objective=mdm differs "
                        r"from the checkpoint's 'refusion'; a resumed run keeps its model, data, "
                        r"objective and sharding: drop the flags", str(refused.value))
    with pytest.raises(ValueError) as refused:
        train.main(tiny_run_flags(tmp_path, qa_file, "ft") + [
            f"--init_from={tmp_path / 'run'}", "--n_layer=2", "--n_embd=32"])
    assert str(refused.value).startswith("--n_layer=2 differs from the checkpoint's 1; --n_embd=32 "
                                         "differs from the checkpoint's 16; a fine-tune keeps")
    # the checkpoint's n_kv_head 0 means n_head's 2: --n_kv_head=2 repeats it, 1 would change it
    with pytest.raises(ValueError, match=r"^--n_kv_head=1 differs from the checkpoint's 0 "
                                         r"\(n_head's 2\); a resumed run keeps"):
        train.main(flags + ["--init_from=resume", "--max_iters=4", "--n_kv_head=1"])
    train.main(flags + ["--init_from=resume", "--max_iters=4", "--n_kv_head=2"])


def test_a_benchmark_never_removes_a_directory_a_live_run_holds(tmp_path, qa_file):
    """train_or_reuse trains anew into a directory only under its lock: while another process
    holds it (a live training run), it is refused naming that run, and nothing there is lost."""
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2"]
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"a live run's checkpoint")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from support.runs import hold_out_dir\n"
         f"with hold_out_dir({str(out)!r}):\n    print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=r"is in use by another training run \(pid "
                                             f"{holder.pid} on "):
            train_or_reuse(train.main, train.DEFAULTS, flags, retrain=True)
        assert (out / "ckpt.pt").read_bytes() == b"a live run's checkpoint"
    finally:
        holder.kill()
        holder.wait()
    train_or_reuse(train.main, train.DEFAULTS, flags, retrain=True)   # released: trained anew
    assert checkpoint.load_checkpoint(str(out), settings_only=True)["iter_num"] == 2


def test_a_resume_refuses_to_flip_the_mdms_shift(tmp_path, qa_file):
    """--mdm_shift changes what every output means (position i predicts token i + 1): a resumed
    run that asks for the other layout is refused, naming it, and one that repeats it goes on."""
    flags = tiny_run_flags(tmp_path, qa_file, "mdm", objective="mdm") + ["--mdm_shift=True"]
    train.main(flags + ["--max_iters=2"])
    resume = [f"--out_dir={tmp_path / 'mdm'}", f"--data_root={tmp_path / 'data'}",
              "--init_from=resume", "--max_iters=4"]
    with pytest.raises(ValueError, match=r"^--mdm_shift=False differs from the checkpoint's True; "
                                         r"a resumed run keeps"):
        train.main(resume + ["--mdm_shift=False"])
    train.main(resume + ["--mdm_shift=True"])
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "mdm"), settings_only=True)
    assert ckpt["config"]["mdm_shift"] and ckpt["iter_num"] == 4


def test_resume_takes_the_checkpoints_settings_and_init_from_its_shape(tmp_path, qa_file):
    train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2", "--batch_size=3"])
    out = f"--out_dir={tmp_path / 'run'}"
    train.main([out, "--init_from=resume", "--max_iters=4"])            # no other flag repeated
    cfg = load_checkpoint(str(tmp_path / "run"))["config"]
    assert (cfg["batch_size"], cfg["n_embd"], cfg["dataset"], cfg["max_iters"]) == \
        (3, 16, qa_file[0], 4)
    ft = tiny_run_flags(tmp_path, qa_file, "ft")
    with pytest.raises(ValueError,
                       match="--n_embd=32 differs from the checkpoint's 16; a fine-tune keeps"):
        train.main(ft + [f"--init_from={tmp_path / 'run'}", "--n_embd=32"])
    with pytest.raises(FileNotFoundError,
                       match="--init_from=Resume: use 'scratch', 'resume', or the path"):
        train.main(ft + ["--init_from=Resume"])
    # a folder that is neither kind of model
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError,
                       match="holds neither a checkpoint .ckpt.pt. nor a Hugging Face model"):
        train.main(ft + [f"--init_from={tmp_path / 'empty'}"])
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("flag", ["--learning_rate=inf", "--min_lr=nan", "--weight_decay=inf",
                                  "--grad_clip=1e999", "--beta1=1.0", "--beta2=nan",
                                  "--mask_eps=nan", "--rope_theta=0.0", "--rope_theta=nan",
                                  "--peak_tflops=0.0", "--log_interval=0"])
def test_settings_that_are_not_finite_or_out_of_range_are_refused_before_any_work(tmp_path,
                                                                                  qa_file, flag):
    """A NaN or infinite rate, a beta outside [0, 1), a rope_theta that is not a positive finite
    number: refused with the setting named before any data is prepared, instead of a loss of NaN
    (or a message from AdamW) after preparing and training."""
    with pytest.raises(ValueError, match=rf"{flag.split('=')[0]}=\S+: must be"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=2", flag])
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_packing_an_mdms_bidirectional_samples_is_refused_before_any_work(tmp_path, qa_file):
    with pytest.raises(ValueError, match="--pack lays samples side by side for causal attention"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run", "mdm") + ["--pack=True"])
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_shifting_the_labels_of_a_model_that_is_not_an_mdm_is_refused(tmp_path, qa_file):
    with pytest.raises(ValueError, match="--mdm_shift shifts an MDM's labels; --objective=refusion "
                                         "is not an MDM"):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") + ["--mdm_shift=True"])
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_a_loss_that_becomes_nan_before_the_first_checkpoint_says_none_was_written(tmp_path,
                                                                                   qa_file):
    flags = tiny_run_flags(tmp_path, qa_file, "run") + ["--max_iters=6", "--learning_rate=1e30",
                                                        "--grad_clip=0"]
    with pytest.raises(SystemExit, match=r"loss became nan at iteration \d; no checkpoint was "
                                         r"written yet: lower --learning_rate .* and start again"):
        train.main(flags)
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.parametrize("flag", ["out_dir", "data_root"])
def test_a_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, qa_file, flag):
    """--out_dir (or --data_root) naming a file, where no directory can be made: refused with the
    path and the fix before the data is prepared or a step is trained (not at the first
    checkpoint)."""
    taken = write(tmp_path, "taken", "a file, not a directory")
    message = {"out_dir": rf"--out_dir={re.escape(taken)}: cannot write a checkpoint there "
                          r".*choose a directory",
               "data_root": rf"cannot create {re.escape(taken)}/\S+ for the prepared data "
                            r".*choose a --data_root"}
    with pytest.raises(ValueError, match=message[flag]):
        train.main(tiny_run_flags(tmp_path, qa_file, "run") +
                   ["--max_iters=2", f"--{flag}={taken}"])
    assert not (tmp_path / "data").exists() and not (tmp_path / "run" / "ckpt.pt").exists()


def test_without_a_terminal_training_prints_one_plain_line_every_log_interval(tmp_path, qa_file,
                                                                              capsys):
    """Into a log file or a pipe (here pytest's capture), no progress bar frames: a line every
    log_interval steps with the loss, its two parts, tokens/s and FLOP/s, and one per evaluation."""
    train.main(tiny_run_flags(tmp_path, qa_file, "run") +
               ["--max_iters=5", "--log_interval=2", "--eval_interval=4"])
    printed = capsys.readouterr()
    assert "\r" not in printed.err and "train:" not in printed.err
    steps = re.findall(r"^iter (\d+): loss \d+\.\d{4} \(ar \d+\.\d{4}, mdm \d+\.\d{4}\), "
                       r"\d+ tok/s, \d+\.\d{3} TFLOP/s$", printed.out, re.MULTILINE)
    evals = re.findall(r"^iter (\d+): val loss \d+\.\d{4}$", printed.out, re.MULTILINE)
    assert (steps, evals) == (["0", "2", "4"], ["0", "4"])


def test_the_speed_is_over_the_last_interval_without_compiling_or_evaluating():
    """Rates on a clock that reads what the test says: a step that compiled and an evaluation are
    left out, each interval starts where the last one was taken, and one that counted no time has
    no rate."""
    readings = iter([0.0, 61.2, 63.2, 73.2, 75.2, 77.2, 80.2, 81.0])
    rates = Rates(lambda: next(readings))
    assert rates.skip() == pytest.approx(61.2)        # step 0 compiled: 61.2 s
    rates.count(tokens=100, flops=1e6)                # step 1: 2 s
    rates.skip()                                      # an evaluation and its checkpoint: 10 s
    rates.count(tokens=100, flops=1e6)                # step 2: 2 s
    assert rates.take() == pytest.approx((200 / 4, 2e6 / 4))
    rates.count(tokens=50, flops=1e6)                 # step 3: 2 s
    rates.count(tokens=250, flops=2e6)                # step 4: 3 s
    assert rates.take() == pytest.approx((300 / 5, 3e6 / 5))
    rates.skip()                                      # step 5 recompiled: 0.8 s
    assert rates.take() is None


def test_a_compiled_run_prints_its_compile_time_once_and_speeds_without_it(tmp_path, qa_file,
                                                                          monkeypatch, capsys):
    """A real run (torch.compile with its eager backend: dynamo's tracing, fast on a CPU) on a clock
    that advances 1 ms a reading, whose evaluations take 1000 s on it: the compile time is said
    once, the first step's line has no speed (it only compiled), and every speed printed is of
    training alone (with an evaluation in it, a step's ~80 tokens would make under 1 tok/s)."""
    clock = {"seconds": 0.0}

    def reading():
        clock["seconds"] += 0.001
        return clock["seconds"]

    monkeypatch.setattr(time, "perf_counter", reading)
    real_estimate = train.estimate_loss

    def slow_estimate(*args):
        clock["seconds"] += 1000
        return real_estimate(*args)

    monkeypatch.setattr(train, "estimate_loss", slow_estimate)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    train.main(tiny_run_flags(tmp_path, qa_file, "run") +
               ["--max_iters=6", "--log_interval=1", "--compile=True"])
    torch._dynamo.reset()
    out = capsys.readouterr().out
    assert len(re.findall(r"^compile: first step took \d+\.\d s \(not counted in tokens/s\)$",
                          out, re.MULTILINE)) == 1
    steps = dict(re.findall(r"^iter (\d+): loss \d+\.\d{4} \(ar \d+\.\d{4}, mdm \d+\.\d{4}\)(.*)$",
                            out, re.MULTILINE))
    assert list(steps) == [str(it) for it in range(6)] and steps["0"] == ""
    speeds = [re.fullmatch(r", (\d+) tok/s, \d+\.\d{3} TFLOP/s", rest) for rest in steps.values()
              if rest]
    assert speeds and all(speed and int(speed[1]) >= 1000 for speed in speeds), steps


def test_a_second_run_into_the_same_out_dir_is_refused_naming_the_first(tmp_path, qa_file):
    """While a run trains into out_dir, another run into it, fresh or resumed, is refused with the
    first one's pid and host and writes nothing; once the first has ended (here: killed, its lock
    released by the operating system), out_dir can be resumed."""
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    out, ckpt = str(tmp_path / "run"), tmp_path / "run" / "ckpt.pt"
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags, "--max_iters=100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        # training, a checkpoint written
        while not ckpt.exists() and first.poll() is None:
            time.sleep(0.05)
        for extra in ([], ["--init_from=resume"]):
            with pytest.raises(ValueError, match=rf"--out_dir={re.escape(out)} is in use by "
                                                 rf"another training run \(pid {first.pid} on "
                                                 rf"{re.escape(socket.gethostname())}, "
                                                 r"started [-\d: ]+\); wait for it to end"):
                train.main(flags + extra + ["--max_iters=200000"])
        assert first.poll() is None                                   # still training, undisturbed
    finally:
        first.kill()
        first.wait()
    train.main(flags + ["--init_from=resume",
                        f"--max_iters={load_checkpoint(out)['iter_num'] + 1}"])
    assert ".lock.holder" not in os.listdir(out)


def test_resuming_on_prepared_data_that_changed_is_refused(tmp_path, qa_file):
    """The checkpoint records the SHA-1 of the prepared data; when the data file was edited since,
    a resume is refused (instead of training on other data and comparing losses across validation
    sets) and the checkpoint is kept as it was."""
    path, rows = qa_file
    flags = tiny_run_flags(tmp_path, qa_file, "run")
    train.main(flags + ["--max_iters=2"])
    ckpt = tmp_path / "run" / "ckpt.pt"
    before = ckpt.read_bytes()
    assert re.fullmatch(r"[0-9a-f]{40}", load_checkpoint(str(ckpt))["meta"]["data_sha1"])
    write(tmp_path, "sums.json", json.dumps(rows + [{"query": "What is 1 + 2?", "response": " 3"}]))
    with pytest.raises(ValueError, match=r"the prepared data \S+ is not the data \S+ckpt.pt was "
                                         r"trained on \(its SHA-1 differs: --dataset=\S+sums.json "
                                         r"was edited.*--init_from="):
        train.main(flags + ["--max_iters=4", "--init_from=resume"])
    assert ckpt.read_bytes() == before
