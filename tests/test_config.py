"""Config files and --key=value flags (configurator.py), and every file under config/."""

import pytest

import bench
import train
from configurator import ConfigError, parse_args
from helpers import ROOT



def test_flags_override_defaults_with_type_checks():
    d = dict(slot_sizes=(4, 8), datasets=("arith",), lr=1e-3, json=False, device="cpu", n_layer=4)
    cfg = parse_args(d, ["--slot_sizes=(16,)", "--datasets=arith,stdlib", "--lr=1", "--json", "--device=cuda"])
    assert cfg == dict(slot_sizes=(16,), datasets=("arith", "stdlib"), lr=1.0, json=True, device="cuda", n_layer=4)
    assert parse_args(d, ["--slot_sizes=4,8"])["slot_sizes"] == (4, 8)
    with pytest.raises(ConfigError, match="did you mean --n_layer"):
        parse_args(d, ["--n_layers=2"])
    with pytest.raises(ConfigError, match="expected int"):
        parse_args(d, ["--n_layer=2.5"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_args(d, ["--n_layer"])
    for text in ("1e1", "'quoted'", "3,4", "0x1F", '"""doc"""'):                  # text keys keep the text as written
        assert parse_args(d, [f"--device={text}"])["device"] == text


@pytest.mark.parametrize("content, message", [
    ("from math import sqrt\nn_layer = int(sqrt(4))\n", None),                      # an import is no setting
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
    """config/train_*.py and finetune_*.py are read by train.py, config/bench_*.py by bench.py; a GPU config is
    checked as if on CPU, since this machine may have no GPU."""
    script, check = ((train, train.check_config) if path.startswith(("train_", "finetune_"))
                     else (bench, bench.check_bench_config))
    cfg = parse_args(script.DEFAULTS, [str(ROOT / "config" / path), "--device=cpu"])
    check(cfg)                                                        # raises on a setting that cannot work
