"""Config files and --key=value flags (configurator.py), and every file under config/."""

import os
import re
import subprocess
import sys

import pytest

import sampler
import train
from configurator import ConfigError, check_confidence, parse_args
from helpers import ROOT
from support import runs, sampling
from tools import bench, consolidate, eval_humaneval


def test_flags_override_defaults_with_type_checks():
    d = dict(slot_sizes=(4, 8), datasets=("arith",), lr=1e-3, json=False, device="cpu", n_layer=4)
    cfg = parse_args(d, ["--slot_sizes=(16,)", "--datasets=arith,stdlib", "--lr=1", "--json",
                         "--device=cuda"])
    assert cfg == dict(slot_sizes=(16,), datasets=("arith", "stdlib"), lr=1.0, json=True,
                       device="cuda", n_layer=4)
    assert parse_args(d, ["--slot_sizes=4,8"])["slot_sizes"] == (4, 8)
    with pytest.raises(ConfigError, match="did you mean --n_layer"):
        parse_args(d, ["--n_layers=2"])
    with pytest.raises(ConfigError, match="expected int"):
        parse_args(d, ["--n_layer=2.5"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_args(d, ["--n_layer"])
    # text keys keep the text as written
    for text in ("1e1", "'quoted'", "3,4", "0x1F", '"""doc"""'):
        assert parse_args(d, [f"--device={text}"])["device"] == text


@pytest.mark.parametrize("content, message", [
    # an import is no setting
    ("from math import sqrt\nn_layer = int(sqrt(4))\n", None),
    ("n_layer = (2\n", r"config file .*bad.py, line 1: SyntaxError"),
    ("n_layer = undefined_name\n", r"config file .*bad.py, line 1: NameError"),
    ("n_layer = '3'\n", r"n_layer = '3' in .*bad.py: expected int like 4, got str"),
    (b"device = '\xff'\n", r"config file .*bad.py: UnicodeDecodeError"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.py"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    d = dict(n_layer=4, device="cpu")
    if message is None:
        assert parse_args(d, [str(path)]) == dict(n_layer=2, device="cpu")
    else:
        with pytest.raises(ConfigError, match=message):
            parse_args(d, [str(path)])


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "config").glob("*.py")))
def test_every_config_file_names_known_keys_and_passes_the_scripts_checks(path):
    """config/train_*.py and finetune_*.py are read by train.py, sample_*.py by sampler.py,
    bench_*.py by tools/bench.py; a GPU config is checked as if on CPU, since this machine may have
    no GPU."""
    assert path.startswith(("train_", "finetune_", "sample_", "bench_")), \
        "name a config after the script that reads it"
    script, check = ((train, runs.check_train_config) if path.startswith(("train_", "finetune_"))
                     else (sampler, check_sample_config) if path.startswith("sample_")
                     else (bench, bench.check_bench_config))
    cfg = parse_args(script.DEFAULTS, [str(ROOT / "config" / path), "--device=cpu"])
    # raises on a setting that cannot work
    check(cfg)


@pytest.mark.parametrize("flag, expected", [
    # a leading zero is no Python literal
    ("--slot_sizes=4,08", "expected a tuple of int like (4, 8)"),
    ("--slot_sizes=4,\u0663", "expected a tuple of int like (4, 8)"),  # an Arabic-Indic digit
    ("--n_layer=" + "-" * 100_000 + "1", "expected int like 4"),      # too deep for Python's parser
], ids=["leading-zero", "arabic-indic-digit", "too-deep"])
def test_a_value_the_parser_cannot_read_names_the_type_expected(flag, expected):
    d = dict(slot_sizes=(4, 8), n_layer=4)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_args(d, [flag])


@pytest.mark.parametrize("script", [train, sampler, bench, eval_humaneval],
                         ids=lambda m: m.__name__)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_setting_with_its_default_and_description_then_exits_0(script, flag,
                                                                                capsys):
    with pytest.raises(SystemExit) as stop:
        # help wins over a flag it cannot read
        script.main(["--no_such_key=1", flag])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    command = (f"-m {script.__name__}" if script.__name__.startswith("tools.")
               else f"{script.__name__}.py")
    assert lines[0] == f"usage: python {command} [config.py ...] [--key=value ...]"
    for key, value in script.DEFAULTS.items():
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        line = next(line for line in lines if line.startswith(f"  --{key}="))
        # the default, then words
        assert line.split()[0] == f"--{key}={shown}" and len(line.split()) > 1, line


def test_a_file_that_is_not_a_py_config_is_refused_and_never_run(tmp_path):
    """A prompt or data file given without its flag (python sampler.py my_prompt.txt) is not run as
    Python: refused with the flag that reads it."""
    marker = tmp_path / "code-ran"
    # valid Python, as a config file is
    code = f"open({str(marker)!r}, 'w')\n"
    for script, name, flag in [(sampler, "my_prompt.txt", "--prompt_file="),
                               (train, "data.json", "--dataset="), (consolidate, "notes.md", None)]:
        path = tmp_path / name
        path.write_text(code)
        hint = (re.escape(f"to read it, write {flag}{path}") if flag
                else "flags are written --key=value")
        with pytest.raises(ConfigError, match=rf"'{re.escape(str(path))}' is not a config file "
                                              rf"\(a .py file of assignments\); {hint}"):
            script.main([str(path)])
    assert not marker.exists()


def test_output_into_a_reader_that_left_ends_every_script_quietly(tmp_path):
    """`python X.py --help | head -1` (the reader gone before the output is written): no
    BrokenPipeError traceback, nothing on stderr, exit status 1, for every script and tool."""
    scripts = [[str(ROOT / "train.py")], [str(ROOT / "sampler.py")]] + [
        ["-m", f"tools.{name}"] for name in ("consolidate", "bench", "eval_humaneval", "figures")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    # all at once: each imports torch
    for script in scripts:
        read, written = os.pipe()
        os.close(read)                                                # the reader has left
        procs.append(subprocess.Popen([sys.executable, *script, "--help"], stdout=written,
                                      stderr=subprocess.PIPE, env=env, cwd=ROOT))
        os.close(written)
    for script, proc in zip(scripts, procs):
        _, err = proc.communicate(timeout=120)
        assert (script, proc.returncode, err.decode()) == (script, 1, "")


def test_an_old_name_is_refused_naming_the_new_one(tmp_path):
    """A renamed setting (--num_blocks, compare_ar = ... in a config file) and a renamed value
    (--method=ar, infill = "ar") are refused with the new name, never silently read."""
    with pytest.raises(ConfigError, match=re.escape(
            "'num_blocks' in the command line was renamed 'serial_num_blocks': write "
            "--serial_num_blocks=...")):
        parse_args(sampler.DEFAULTS, ["--num_blocks=2"])
    config = tmp_path / "decode.py"
    config.write_text("compare_ar = False\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"'compare_ar' in {config} was renamed 'compare_next_token': write "
            "compare_next_token = ...")):
        parse_args(sampler.DEFAULTS, [str(config)])
    with pytest.raises(ValueError, match="unknown config key 'num_block'"):
        parse_args(sampler.DEFAULTS, ["--num_block=2"])
    old_values = [("--method=ar", r"--method='ar': choose one of refusion, next_token, mdm "
                                  r"\(--method=ar is now called next_token\)"),
                  ("--infill=ar", r"infill='ar': choose .* \(infill='ar' is now called "
                                  r"'speculative'\)")]
    for flag, message in old_values:
        cfg = parse_args(sampler.DEFAULTS, ["--method=refusion", flag])
        with pytest.raises(ValueError, match=message):
            sampler.decoder_settings(cfg)


def test_every_tool_answers_help_as_a_module_and_as_a_file(tmp_path):
    """`python -m tools.<name> --help` from the root, and `python tools/X.py --help` from elsewhere
    (a file's own directory is first on its path, not the root), both print the usage."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for name in ("bench", "bench_pretrained", "eval_humaneval", "convert_gguf", "consolidate",
                 "figures", "prepare"):
        for how, command, cwd in [("module", ["-m", f"tools.{name}"], ROOT),
                                  ("file", [str(ROOT / "tools" / f"{name}.py")], tmp_path)]:
            runs[name, how] = subprocess.Popen([sys.executable, *command, "--help"], cwd=cwd,
                                               env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE)
    for (name, how), proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out.decode().split(" [")[0], err.decode()) == \
            (0, f"usage: python -m tools.{name}", ""), (name, how)


def test_a_config_file_s_helpers_numpy_numbers_and_home_paths(tmp_path, monkeypatch):
    """A config file's own helper value is refused with how to name one (a leading _), which is
    then ignored; numpy's float64 and int64 are the numbers they are; ~ in a path setting is the
    home directory (saved ~/run/ckpt.pt was written to ./~/run/ckpt.pt)."""
    config = tmp_path / "c.py"
    config.write_text("steps = 300\nmax_iters = steps\n")
    with pytest.raises(ConfigError, match="named with a leading _, e.g. _steps"):
        parse_args(train.DEFAULTS, [str(config)])
    config.write_text("import numpy as np\n_steps = 300\nmax_iters = _steps\n"
                      "learning_rate = np.float64(1e-3)\nbatch_size = np.int64(8)\n")
    cfg = parse_args(train.DEFAULTS, [str(config)])
    assert (cfg["max_iters"], cfg["learning_rate"], cfg["batch_size"]) == (300, 1e-3, 8)
    assert type(cfg["learning_rate"]) is float and type(cfg["batch_size"]) is int
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = parse_args(train.DEFAULTS, ["--out_dir=~/run", "--data_root=~/data"])
    assert (cfg["out_dir"], cfg["data_root"]) == (str(tmp_path / "run"), str(tmp_path / "data"))
    assert parse_args(sampler.DEFAULTS, ["--prompt=~/run"])["prompt"] == "~/run"   # text stays


def test_a_module_of_support_run_as_a_command_says_it_is_none_and_prepare_is_a_tool(tmp_path):
    """python -m support.prepare (and prepare.py before the layout) did nothing and exited 0: a
    module of support/ run as a command says it is none and names the commands; tools.prepare
    prepares a data set ahead of training."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for command in (["-m", "support.prepare"], ["-m", "support.runs", "--help"],
                    [str(ROOT / "support" / "files.py")]):
        done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 1 and "is a module of support/, not a command" in done.stderr
    done = subprocess.run([sys.executable, "-m", "tools.prepare", "--dataset=transform",
                           f"--data_root={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)
    assert done.stdout.splitlines()[-1].startswith(
        f"prepared {tmp_path / 'transform-bytes-384'}: 18,989 training")


def check_sample_config(cfg):
    """What sampler.main checks before any weights are read: the command line's settings, then the
    decoder's (when --method is given)."""
    sampling.check_sample_config(cfg)
    check_confidence(cfg)
    sampler.decoder_settings(dict(cfg, method=cfg["method"] or "refusion"))  # its knobs, checked


def test_a_setting_written_without_its_dashes_is_told_so():
    """`python sampler.py num_samples=3` names the flag it meant, not a file to read."""
    with pytest.raises(ConfigError, match="a setting is written with two dashes: --num_samples=3"):
        parse_args(sampler.DEFAULTS, ["num_samples=3"])
