"""
nanoGPT-style configuration: defaults in the script, then config files (`config/*.py`, plain
assignments), then `--key=value` flags, applied left to right. Every key must already have a
default, and every value must have the default's type, so a typo fails loudly instead of silently.

    python train.py config/train_stdlib.py --max_iters=200 --slot_sizes=(4,8)
    python train.py --help          # every setting, its default and what it does
"""

import ast
import difflib
import io
import math
import numbers
import os
import sys
import tokenize
import traceback

import torch


class Defaults(dict):
    """A script's settings {name: default}, the file that declares them (its comments are --help's
    descriptions) and the command that runs it (None: command_of(script))."""

    def __init__(self, values, script=None, command=None):
        super().__init__(values)
        self.script = script
        self.command = command


def settings_in(namespace):
    """The settings a module declares at its top level (lowercase names holding an int, float,
    bool, str or tuple, in order) as Defaults: `settings_in(globals())` after the defaults block."""
    kinds = (int, float, bool, str, tuple)
    return Defaults({k: v for k, v in namespace.items()
                     if not k.startswith("_") and k.islower() and isinstance(v, kinds)},
                    namespace.get("__file__"))


def descriptions(script):
    """{setting: the trailing comment of its module-level assignment (each name of a tuple
    target), or of its entry in a dict so assigned} in the Python file `script`, for --help."""
    with open(script, encoding="utf-8") as f:
        source = f.read()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokens
                if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(name, ast.Name):
                        found.setdefault(name.id, comments.get(node.end_lineno, ""))
            # the entries of a dict of settings: each described by the comment after its value
            for table in ast.walk(node.value):
                if not isinstance(table, ast.Dict):
                    continue
                for key, value in zip(table.keys, table.values):
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        found.setdefault(key.value, comments.get(value.end_lineno, ""))
    return found


def command_of(script):
    """How `script` runs from the root: `train.py`, or `-m tools.bench` for a package's module."""
    if not script:
        return "script.py"
    folder, name = os.path.split(os.path.abspath(script))
    if os.path.isfile(os.path.join(folder, "__init__.py")):
        return f"-m {os.path.basename(folder)}.{os.path.splitext(name)[0]}"
    return name


def usage(defaults):
    """The --help text: the call, then per setting --key=default and its description."""
    script = getattr(defaults, "script", None)
    command = getattr(defaults, "command", None) or command_of(script)
    about = descriptions(script) if script else {}
    shown = {k: ",".join(map(str, v)) if isinstance(v, tuple) else v if isinstance(v, str)
             else repr(v) for k, v in defaults.items()}
    width = max(len(f"--{k}={v}") for k, v in shown.items())
    lines = [f"usage: python {command} [config.py ...] [--key=value ...]",
             "Config files and flags apply left to right. Settings, with their defaults:"]
    lines += [f"  {f'--{k}={v}':<{width}}  {about.get(k, '')}".rstrip() for k, v in shown.items()]
    return "\n".join(lines)


class ConfigError(ValueError):
    """A config file or flag that names an unknown key or gives a value of the wrong type."""


def _literal(text):
    """The Python literal `text` spells (1500, 2e-3, (4, 8), True), else `text` itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def _coerce(key, value, default, where="the command line"):
    """`value` as the default's type: an int for a float; a list, one value or "a,b" for a tuple;
    a numpy number as ours; ~ expanded in a PATHS setting. Raises ConfigError."""
    shown = f"--{key}={value!r}" if where == "the command line" else f"{key} = {value!r} in {where}"
    if key in PATHS and isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if not isinstance(value, bool) and not isinstance(default, bool):  # numpy's numbers as ours
        if isinstance(default, float) and isinstance(value, numbers.Real):
            return float(value)
        if isinstance(default, int) and isinstance(value, numbers.Integral):
            return int(value)
    if isinstance(default, tuple):
        # items of a tuple of text are taken as written, others as literals
        if isinstance(value, str):
            texts = default and isinstance(default[0], str)
            value = tuple(v.strip() if texts else _literal(v.strip()) for v in value.split(","))
        value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if default and any(type(v) is not type(default[0]) for v in value):
            raise ConfigError(f"{shown}: expected a tuple of {type(default[0]).__name__} "
                              f"like {default!r}")
        return value
    if isinstance(default, float) and value in ("nan", "inf", "-inf"):
        return float(value)
    if type(value) is not type(default):
        spelled = " (True or False)" if isinstance(default, bool) else ""
        raise ConfigError(f"{shown}: expected {type(default).__name__}{spelled} like {default!r}, "
                          f"got {type(value).__name__}")
    return value


def _check_key(key, defaults, where):
    """Refuse a key defaults lacks, naming its new name (RENAMED) or close matches (ConfigError)."""
    if key not in defaults and RENAMED.get(key) in defaults:
        new = RENAMED[key]
        raise ConfigError(f"{key!r} in {where} was renamed {new!r}: write "
                          + (f"--{new}=..." if where == "the command line" else f"{new} = ..."))
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else "."
        if where != "the command line":  # a config file's own helper value is welcome, named _x
            hint += f" A value of the file's own (a helper) is named with a leading _, e.g. _{key}."
        raise ConfigError(f"unknown config key {key!r} in {where}{hint} Known keys: "
                          f"{', '.join(sorted(defaults))}")


# the settings that name files or directories, of every script (~ expands to the home directory)
PATHS = {"out_dir", "init_from", "dataset", "data_root", "prompt_file", "plot", "out_json",
         "layout_png", "decode_png"}


# settings renamed: old -> new. An old name, in a flag or a config file, is refused naming the new
RENAMED = {"num_blocks": "serial_num_blocks", "compare_ar": "compare_next_token"}


def explicit_keys(cfg, defaults, argv):
    """The set of keys a run chose: named by a --key flag, or off its default by a config file."""
    return ({a[2:].partition("=")[0] for a in argv if a.startswith("--")}
            | {k for k in cfg if cfg[k] != defaults[k]})


def parse_args(defaults, argv):
    """Apply the config files and --key=value flags of argv, in order, to a copy of defaults.

    A bare boolean flag means True; --help or -h prints usage(defaults) and exits 0. Returns the
    dict. Raises ConfigError naming the fix for an unknown key, a wrong type, a malformed flag, a
    missing config file, or an argument that is neither a flag nor a .py file."""
    if {"--help", "-h"} & set(argv):
        print(usage(defaults))
        raise SystemExit(0)
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            if not arg.endswith(".py"):
                # a run's directory or a checkpoint is a model to start from; another file, text
                model = os.path.isdir(arg) or arg.endswith(".pt")
                readers = ("init_from",) if model else ("prompt_file", "dataset")
                flags = " or ".join(f"--{key}={arg}" for key in readers if key in defaults)
                fix = f"to read it, write {flags}" if flags else "flags are written --key=value"
                if arg.partition("=")[0] in defaults and "=" in arg:  # a flag without its dashes
                    fix = f"a setting is written with two dashes: --{arg}"
                raise ConfigError(f"{arg!r} is not a config file (a .py file of assignments); "
                                  f"{fix}")
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found (flags are written --key=value)")
            namespace = {}
            try:
                with open(arg, encoding="utf-8") as f:
                    # a config file is the user's own code
                    exec(compile(f.read(), arg, "exec"), namespace)
            except Exception as e:  # any error in the user's file: say which file and line
                frames = traceback.extract_tb(e.__traceback__)
                lineno = ([f.lineno for f in frames if f.filename == arg]
                          or [getattr(e, "lineno", None)])[-1]      # a SyntaxError has no frame
                line = f", line {lineno}" if lineno else ""
                raise ConfigError(f"config file {arg}{line}: {type(e).__name__}: {e}; a config "
                                  "file holds plain assignments such as max_iters = 300") from None
            for key, value in namespace.items():
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue  # imports and helpers are not settings
                _check_key(key, defaults, arg)
                config[key] = _coerce(key, value, defaults[key], arg)
            continue
        key, _, text = arg[2:].partition("=")
        _check_key(key, defaults, "the command line")
        if "=" not in arg:
            if not isinstance(defaults[key], bool):
                raise ConfigError(f"flag {arg!r} has no value: write it as {arg}=VALUE")
            text = "True"  # a bare boolean flag such as --json switches it on
        # a str setting takes the text as written: --out_dir=1e1, --prompt='x' with its quotes
        value = text if isinstance(defaults[key], str) else _literal(text)
        config[key] = _coerce(key, value, defaults[key])
    return config


def require(cfg, keys, rule, test):
    """Refuse the first of `keys` whose cfg value fails test (a NaN fails any comparison) as
    "--key=value: must be <rule>". Raises ConfigError."""
    for key in keys:
        if not test(cfg[key]):
            raise ConfigError(f"--{key}={cfg[key]}: must be {rule}")


def check_device(device):
    """Refuse a device torch cannot use here, with the fix. Raises ConfigError."""
    if device == "cpu" or (device == "mps" and torch.backends.mps.is_available()):
        return
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device={device}: no CUDA GPU is visible to torch here; use "
                              "--device=cpu")
        return
    raise ConfigError(f"--device={device}: use cpu, cuda (or cuda:N), or mps where available")


def check_seed(cfg):
    """Refuse a --seed outside 0 .. 2**63 - 1 (numpy's and torch's generators): ConfigError."""
    require(cfg, ("seed",), "a whole number from 0 to 2**63 - 1", lambda v: 0 <= v < 2**63)


def run_cli(main, argv):
    """Run main(argv); a ValueError or FileNotFoundError exits with its message, a closed output
    pipe with status 1, neither with a traceback."""
    try:
        try:
            main(argv)
        finally:
            sys.stdout.flush()  # a reader that left shows here, not in the interpreter's last flush
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except BrokenPipeError:
        # what is still buffered goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


# -----------------------------------------------------------------------------
# the decoders' settings (sampler.py's DecodeSettings, RefusionSettings, MDMSettings): the values
# they may take, checked when a settings object is built, and a model checked against them

# ReFusion's step 3: the paper's infill, or the next-token pathway in charge (SPEC 4.1)
INFILL_MODES = ("paper", "speculative")
# what the MDM's low-confidence remasking ranks a step's drafts by (SPEC section 4): "prob", the
# drafted token's probability (LLaDA); "margin" and "entropy", Dream's rules (opt-in)
MDM_CONFIDENCES = ("prob", "margin", "entropy")


def check_decode_settings(s):
    """Refuse a DecodeSettings whose max_new_tokens, temperature or eos_every cannot work.
    Raises ValueError."""
    if s.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={s.max_new_tokens}: ask for at least one new token")
    if not 0 <= s.temperature < math.inf:  # also catches NaN
        raise ValueError(f"temperature={s.temperature}: use 0 for greedy decoding or a finite "
                         "positive value to sample")
    if s.eos_every is not None and s.eos_every < 1:
        raise ValueError(f"eos_every={s.eos_every}: look for EOS at least every token (1), or "
                         "leave it None (every token on a CPU, every 16 on a GPU)")


def check_refusion_settings(s):
    """Refuse a RefusionSettings that cannot work (check_decode_settings, then infill, slot_size,
    serial_num_blocks, thresholds >= 0 and finite). Raises ValueError."""
    check_decode_settings(s)
    if s.infill not in INFILL_MODES:
        renamed = " (infill='ar' is now called 'speculative')" if s.infill == "ar" else ""
        raise ValueError(f"infill={s.infill!r}: choose 'paper' (the forced token of each infill "
                         "round is its masked draft, as in the paper) or 'speculative' (the "
                         f"next-token prediction, SPEC 4.1){renamed}")
    if s.verify not in ("paper", "exact"):
        raise ValueError(f"verify={s.verify!r}: choose 'paper' (the thresholds, as in the paper) "
                         "or 'exact' (next-token decoding's own tokens, SPEC 4.5)")
    if s.verify == "exact" and s.temperature != 0:
        raise ValueError(f"verify='exact' with temperature={s.temperature}: exact verification "
                         "decodes greedily (the speculative-sampling rule that would keep "
                         "next-token sampling's distribution is not built); use temperature=0, or "
                         "verify='paper' to sample")
    if s.slot_size <= 0:
        raise ValueError(f"slot_size={s.slot_size}: a slot holds at least one token (the paper "
                         "uses 4 to 32)")
    if s.serial_num_blocks <= 0:
        raise ValueError(f"serial_num_blocks={s.serial_num_blocks}: use at least one serial block")
    for name in ("slot_threshold", "token_threshold"):
        if not 0 <= getattr(s, name) < math.inf:  # also catches NaN
            raise ValueError(f"{name}={getattr(s, name)}: thresholds are finite probabilities "
                             ">= 0 (any value >= 1 already means never)")


def check_mdm_settings(s):
    """Refuse an MDMSettings that cannot work (check_decode_settings, then LLaDA's schedule and
    confidence in MDM_CONFIDENCES). Raises ValueError."""
    check_decode_settings(s)
    n = s.max_new_tokens
    if s.steps <= 0 or s.block_length <= 0:
        raise ValueError(f"steps={s.steps}, block_length={s.block_length}: both must be positive")
    if n % s.block_length:
        raise ValueError(f"max_new_tokens={n} is not a multiple of block_length={s.block_length}; "
                         f"pick a block_length dividing {n}")
    if s.steps % s.n_semi_ar_blocks:
        raise ValueError(f"steps={s.steps} cannot be shared equally by the {s.n_semi_ar_blocks} "
                         f"semi-autoregressive blocks of {s.block_length} tokens; pick steps as a "
                         f"multiple of {s.n_semi_ar_blocks}")
    if s.steps > n:
        raise ValueError(f"steps={s.steps} > max_new_tokens={n}: some steps would commit no "
                         f"token; use at most {n} steps (one token per step)")
    if s.confidence not in MDM_CONFIDENCES:
        raise ValueError(f"confidence={s.confidence!r}: choose one of "
                         f"{', '.join(MDM_CONFIDENCES)}")


def check_confidence(cfg):
    """Refuse a --confidence not in MDM_CONFIDENCES, whatever the method. Raises ValueError."""
    if cfg["confidence"] not in MDM_CONFIDENCES:
        raise ValueError(f"--confidence={cfg['confidence']!r}: choose one of "
                         f"{', '.join(MDM_CONFIDENCES)} (it ranks the MDM's drafts)")


class ContextTooLong(ValueError):
    """A prompt + generation past the model's context; the message names the settings to change."""

    def __init__(self, prompt_len, settings, limit):
        how = ""
        fix = "lower max_new_tokens"
        # ReFusion's generation: whole serial blocks of slots (verify="exact": max_new_tokens)
        if hasattr(settings, "slot_size") and settings.verify != "exact":
            how = (f", max_new_tokens={settings.max_new_tokens} rounded up to "
                   f"{settings.serial_num_blocks} serial block(s) of whole {settings.slot_size}-"
                   "token slots")
            fix = "lower max_new_tokens, slot_size or serial_num_blocks"
        super().__init__(f"prompt ({prompt_len} tokens) + generation ({settings.gen_length} "
                         f"tokens{how}) exceeds the model's context of {limit} positions; shorten "
                         f"the prompt or {fix}")


def check_context(model, prompt_len, settings):
    """Refuse an empty prompt (ValueError) or prompt_len + settings.gen_length past the model's
    context (ContextTooLong)."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token of context")
    if prompt_len + settings.gen_length > model.config.block_size:
        raise ContextTooLong(prompt_len, settings, model.config.block_size)


def check_attention(model, method):
    """Refuse a method the model's attention cannot run: refusion and next_token need causal
    attention, mdm bidirectional (model.config.causal). Raises ValueError."""
    if method == "mdm" and model.config.causal:
        raise ValueError("this model was trained with a causal objective (refusion or ar), so it "
                         "cannot denoise a sequence of masks bidirectionally; use "
                         "--method=refusion or --method=next_token")
    if method != "mdm" and not model.config.causal:
        raise ValueError(f"this model has bidirectional attention (trained with "
                         f"--objective=mdm), but --method={method} decodes causally after a KV "
                         "cache; use --method=mdm")
