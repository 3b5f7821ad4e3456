"""
Hugging Face model folders (config.json and safetensors weights) read into our Transformer.

    from_pretrained(folder)        a Qwen3 or Llama-family folder (Llama, SmolLM2) -> Transformer
    hf_model_config(folder)        its config.json -> ModelConfig, refusing what model.py lacks

Its tokenizer is support/hf_tokenizer.py's, its chat template support/chat.py's.
"""

import math
import os
import stat

import torch
from safetensors import SafetensorError, safe_open

from model import ModelConfig, Transformer
from support.checkpoint import check_finite
from support.files import INDEX_LIMIT, NOT_A_FILE, abridged, check_kind, expect, is_int, read_json


FOLDER_HOLDS = ("a Hugging Face model folder holds config.json, tokenizer.json and "
                "model.safetensors (or its shards), downloaded whole")


def need(folder, name):
    """The path of `name` in a model folder. Raises FileNotFoundError when it is not there;
    ValueError when the folder is not a directory or the file not a regular file (check_kind)."""
    check_kind(folder, f"name a model folder: {FOLDER_HOLDS}", stat.S_ISDIR)
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {FOLDER_HOLDS}")
    check_kind(path, NOT_A_FILE)
    return path


def weight_file_in(folder, name, index):
    """name, a weights file the index `index` lists, once checked to be a file of `folder` (not
    absolute, no "..", no symlink out of it but a cache snapshot's into its blobs/). Raises
    ValueError naming the index and the entry."""
    root = os.path.realpath(folder)
    roots = [root]
    # ~/.cache/huggingface/hub/models--*/snapshots/REV
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    inside = isinstance(name, str) and not os.path.isabs(name) \
        and ".." not in name.replace("\\", "/").split("/") \
        and any(os.path.commonpath([os.path.realpath(os.path.join(folder, name)), r]) == r
                for r in roots)
    if not inside:
        raise ValueError(f"{index} lists the weights file {name!r}, outside {folder}; "
                         "a model folder's index names files of that folder only: "
                         "download the model whole into one folder")
    return name


# -----------------------------------------------------------------------------
# model folders: config.json and safetensors -> Transformer

# What differs between the families: the query/key norms, the defaults of transformers' config
# class (Qwen3Config, LlamaConfig) for fields config.json leaves out, and the fields it derives when
# null (tests/test_hf_folder.py checks them against the classes).
FAMILIES = {
    "qwen3": dict(qk_norm=True, derived=("num_key_value_heads",), layer_types=True, defaults=dict(
        vocab_size=151936, max_position_embeddings=32768, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_size=4096, intermediate_size=22016,
        head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Llama 2/3, SmolLM2
    "llama": dict(qk_norm=False, derived=("num_key_value_heads", "head_dim"), layer_types=False,
                  defaults=dict(
        vocab_size=32000, max_position_embeddings=2048, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, hidden_size=4096,
        intermediate_size=11008, head_dim=None, rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
DEFAULT_ROPE_THETA = 10000.0  # both classes' default_theta
# the activations transformers' ACT2FN maps to SiLU
SILU = ("silu", "swish")

# what config.json's fields must be: the sizes WHOLE, the others FIELD_KINDS
WHOLE = ("a positive whole number", lambda v: is_int(v, 1))
POSITIVE = ("a positive finite number", lambda v: isinstance(v, (int, float))
            and not isinstance(v, bool) and 0 < v < math.inf)
FIELD_KINDS = {"rope_theta": POSITIVE, "rms_norm_eps": POSITIVE,
               "tie_word_embeddings": ("true or false", lambda v: isinstance(v, bool))}
# safetensors' names of the weight dtypes from_pretrained loads
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def sliding_layers(hf, family, path):
    """The layers that config.json `hf` attends with through a sliding window, as transformers reads
    it: Qwen3's layer_types, else max_window_layers (default 28) on with use_sliding_window; every
    layer of a Llama with use_sliding_window. Raises ValueError naming the file for a bad
    layer_types or max_window_layers."""
    layers = hf.get("num_hidden_layers", 32)
    if not is_int(layers):
        return []                                    # refused with the other sizes
    if not family["layer_types"]:
        return list(range(layers)) if hf.get("use_sliding_window") else []
    layer_types = hf.get("layer_types")
    if layer_types is None:
        start = hf.get("max_window_layers", 28)
        expect(is_int(start), path, f"max_window_layers={start!r} (expected a whole number)")
        return list(range(start, layers)) if hf.get("use_sliding_window") else []
    expect(isinstance(layer_types, list) and len(layer_types) == layers
           and all(kind in ("full_attention", "sliding_attention") for kind in layer_types),
           path, 'layer_types is not "full_attention" or "sliding_attention" for each layer')
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def hf_model_config(folder):
    """The ModelConfig of a folder's config.json (a Qwen3 or Llama-family model; SPEC 5), each
    field read as transformers' config class reads it (defaults: FAMILIES). Raises
    FileNotFoundError without config.json; ValueError for a folder or file of the wrong kind (need)
    or a config.json larger than any real one, naming the file and each field this model
    does not implement (model_type, rope scaling, attention or MLP bias, sliding window, activation,
    quantization), a field of the wrong type (FIELD_KINDS), or a file that is not JSON."""
    path = need(folder, "config.json")
    hf = read_json(path)
    if "quantization_config" in hf:
        method = hf["quantization_config"].get("quant_method") \
            if isinstance(hf["quantization_config"], dict) else None
        raise ValueError(f"{path}: quantization_config (quant_method={method!r}) says the weights "
                         f"are quantized; this loads {', '.join(FLOAT_DTYPES)} weights only: "
                         "use the model's unquantized release")
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    # transformers 4 writes rope_theta and rope_scaling (null when plain), transformers 5
    # rope_parameters; read as transformers 5 reads them (RotaryEmbeddingConfigMixin): rope_scaling
    # when set, else rope_parameters, whose rope_theta comes before a top-level one
    rope_key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(rope_key) or {}
    expect(isinstance(rope, dict), path, f"{rope_key} is a {type(rope).__name__}, not an object")
    unsupported = [f"{key}={hf.get(key)!r}" for key, ok in [
        ("model_type", family is not None),
        (rope_key, rope.get("rope_type", rope.get("type", "default")) == "default"),
        ("attention_bias", not hf.get("attention_bias")),
        ("mlp_bias", not hf.get("mlp_bias")),
        ("hidden_act", hf.get("hidden_act", "silu") in SILU)] if not ok]
    sliding = sliding_layers(hf, family, path) if family is not None else []
    if sliding:
        unsupported.append(f"a sliding window in layers {abridged([str(i) for i in sliding])}"
                           + ("" if hf.get("use_sliding_window") else
                              " (layer_types names them while use_sliding_window is false, "
                              "which transformers cannot run either)"))
    if unsupported:
        raise ValueError(f"{path}: {', '.join(unsupported)} is not implemented here; this model "
                         f"loads Qwen3 and Llama-family checkpoints ({', '.join(FAMILIES)}: "
                         "plain RoPE, no attention or MLP bias, full attention, SiLU) only")
    # a field left out takes the config class's default; a null one is derived where the class
    # derives it
    values = {key: hf.get(key, default) for key, default in family["defaults"].items()}
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))
    wrong = [f"{key}={value!r} (expected {FIELD_KINDS.get(key, WHOLE)[0]})"
             for key, value in values.items() if not FIELD_KINDS.get(key, WHOLE)[1](value)
             and not (value is None and key in family["derived"])]
    expect(not wrong, path, ", ".join(wrong))
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    try:
        return ModelConfig(
            vocab_size=values["vocab_size"], block_size=values["max_position_embeddings"],
            n_layer=values["num_hidden_layers"], n_head=values["num_attention_heads"],
            n_kv_head=values["num_key_value_heads"], n_embd=values["hidden_size"],
            head_dim=values["head_dim"],
            intermediate_size=values["intermediate_size"], rope_theta=values["rope_theta"],
            norm_eps=values["rms_norm_eps"], tie_embeddings=values["tie_word_embeddings"],
            qk_norm=family["qk_norm"], causal=True)
    except ValueError as e:  # sizes that do not fit together, e.g. heads that do not divide
        raise ValueError(f"{path}: {e}") from None


def open_safetensors(path):
    """safe_open(path) for torch. Raises ValueError naming the file when it is not a whole
    safetensors file (truncated, a Git LFS pointer, another format)."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be truncated "
                         "or an unfinished download: download it again") from None


def from_pretrained(folder, dtype=torch.float32):
    """The causal Transformer (block_size: max_position_embeddings), in eval mode on the CPU with
    `dtype` parameters, of a Qwen3 or Llama-family folder as save_pretrained writes it (Qwen3's,
    ReFusion's or SmolLM2's release, convert_gguf's output): config.json and model.safetensors or
    the shards its index lists, tensor names ours prefixed "model." but lm_head.weight. Names and
    shapes are checked in the headers first; the weights are then held once. Raises
    FileNotFoundError for a missing file; ValueError naming the file for what hf_model_config
    refuses, a file that is not a regular file (need), a bad or oversized index, a file outside
    the folder, a weights file that is not whole, weights that are not floats (quantized), NaN or
    infinite ones, or names or shapes not config.json's."""
    config = hf_model_config(folder)
    with torch.device("meta"):
        model = Transformer(config)
    # Hugging Face name -> shape (a tied lm_head.weight listed once, as embed_tokens.weight)
    expected = {("" if name == "lm_head.weight" else "model.") + name: list(p.shape)
                for name, p in model.named_parameters()}

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, INDEX_LIMIT).get("weight_map")
        expect(isinstance(weight_map, dict) and
               all(isinstance(v, str) for v in weight_map.values()), index,
               "it has no 'weight_map' object of tensor names to file names")
        files = [need(folder, weight_file_in(folder, name, index))
                 for name in sorted(set(weight_map.values()))]
    else:
        files = [need(folder, "model.safetensors")]
    # from the files' headers: Hugging Face name -> shape; file -> tensors not floats
    found, not_float = {}, {}
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                # "BF16", "I8", ...
                found[name], kind = f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()
                if kind not in FLOAT_DTYPES:
                    not_float.setdefault(path, []).append(f"{name} ({kind})")
    if not_float:
        path, names = next(iter(not_float.items()))
        others = f" (and {len(not_float) - 1} more files)" if len(not_float) > 1 else ""
        raise ValueError(f"{path} holds weights that are not floats: {abridged(sorted(names))}"
                         f"{others}; integer or 8-bit weights are quantized, and this loads "
                         f"{', '.join(FLOAT_DTYPES)} weights only: use "
                         "the model's unquantized release")
    if config.tie_embeddings:
        # a stored copy of the tied matrix is ignored, as transformers does
        found.pop("lm_head.weight", None)
    # RoPE's inverse frequencies, which some conversions store, follow from rope_theta: transformers
    # ignores them, and so does this
    found = {name: shape for name, shape in found.items()
             if not name.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(expected.keys() - found.keys()), \
        sorted(found.keys() - expected.keys())
    misshaped = [f"{name} {found[name]} (config.json implies {expected[name]})"
                 for name in sorted(expected.keys() & found.keys())
                 if found[name] != expected[name]]
    problems = [f"{kind} tensors: {abridged(names)}" for kind, names in
                [("missing", missing), ("unexpected", unexpected), ("wrongly shaped", misshaped)]
                if names]
    if problems:
        raise ValueError(f"the weights in {folder} do not match its config.json: "
                         f"{'; '.join(problems)}. "
                         "Check that the folder holds one whole model and its own config.json")

    for path in files:  # shard by shard; its tensors become the parameters (no second copy)
        with open_safetensors(path) as f:
            shard = {name.removeprefix("model."): f.get_tensor(name).to(dtype)
                     for name in f.keys() if name in expected}
        check_finite(shard, path)
        model.load_state_dict(shard, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign replaced the shared parameter
    return model.eval()
