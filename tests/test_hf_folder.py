"""
Hugging Face model folders (support/hf_folder.py): from_pretrained checked against transformers'
own Qwen3 and Llama on tiny random models (logits, greedy decoding), config.json and the tensors
read as transformers reads them, folders written here for its error messages, malformed files
refused naming the file, and the command lines (sampler.py, train.py) on a folder.

Run: python -m pytest -q tests/test_hf_folder.py
     (needs requirements-test.txt; skips what is missing)
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sampler
from helpers import NOT_FILES, edit_json, give_ids, never_blocks, save_tiny_hf_folder, sparse
from model import ModelConfig, Transformer
from sampler import DecodeSettings, RefusionSettings, generate_next_token, generate_refusion
from support import tokenizer
from support.chat import chat_prompt
from support.files import INDEX_LIMIT, JSON_LIMIT, TOKENIZER_LIMIT
from support.hf_folder import FAMILIES, from_pretrained, hf_model_config, sliding_layers

TOL = 1e-5
VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


# ----------------------------------------------------------------------------------------------
# from_pretrained against transformers


def save_hf_model(folder, family, tied, sharded=False, n_kv_head=2, head_dim_written=True):
    """A tiny random transformers Qwen3ForCausalLM or LlamaForCausalLM, saved to folder by
    save_pretrained (without head_dim in config.json when not head_dim_written); returns it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    Config, Model = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                     "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    config = Config(**TINY | {"num_key_value_heads": n_kv_head}, tie_word_embeddings=tied,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                    attn_implementation="eager")
    hf = Model(config).eval()
    # every weight random, norms included, so a tensor loaded into the wrong place shows
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.1)
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB" if sharded else "1GB")
    shards = list(folder.glob("*.safetensors"))
    assert len(shards) > 2 if sharded else [s.name for s in shards] == ["model.safetensors"]
    if not head_dim_written:
        written = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({k: v for k, v in written.items()
                                                        if k != "head_dim"}))
    return hf


# Qwen3 one file and sharded, tied and untied; Llama (SmolLM2's family: no q/k norms) tied, untied,
# and with grouped-query attention (one key-value head for four query heads) and no head_dim in
# config.json
MODELS = {"qwen3-untied": ("qwen3", False, False), "qwen3-tied": ("qwen3", True, False),
          "qwen3-untied-sharded": ("qwen3", False, True),
          "qwen3-tied-sharded": ("qwen3", True, True),
          "llama-tied": ("llama", True, False, 4), "llama-untied": ("llama", False, False, 4),
          "llama-gqa": ("llama", True, False, 1, False)}


@pytest.fixture(scope="module", params=list(MODELS.values()), ids=list(MODELS))
def hf_pair(request, tmp_path_factory):
    """(transformers' model, our Transformer loaded from its save_pretrained folder)."""
    folder = tmp_path_factory.mktemp("hf")
    hf = save_hf_model(folder, *request.param)
    ours = from_pretrained(str(folder))
    assert ours.config.qk_norm == (request.param[0] == "qwen3") and ours.config.head_dim == 16
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == request.param[1]
    return hf, ours


def position_layout(name, B, T):
    """(B, T) int64 position ids of a buffer in physical order."""
    if name == "contiguous":
        return torch.arange(T).expand(B, T)
    # prompt 0..3, then 4-token slots in a random order (SPEC section 2)
    if name == "slots-permuted":
        slots = torch.arange(4, T).view(-1, 4)
        return torch.stack([torch.cat([torch.arange(4),
                                       slots[torch.randperm(len(slots))].flatten()])
                            for _ in range(B)])
    if name == "gapped":  # increasing, with holes, not starting at 0
        return torch.stack([torch.randperm(100)[:T].sort().values + 20 for _ in range(B)])
    raise ValueError(name)


@pytest.mark.parametrize("layout", ["contiguous", "slots-permuted", "gapped"])
def test_logits_match_transformers(hf_pair, layout):
    hf, ours = hf_pair
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, 16))
    pos = position_layout(layout, 2, 16)
    with torch.no_grad():
        # The all-ones attention_mask keeps transformers' mask causal over the physical order:
        # without it, position ids that do not step by 1 are read as packed sequences that cannot
        # see each other.
        expected = hf(input_ids=idx, position_ids=pos, attention_mask=torch.ones_like(idx)).logits
        got = ours(idx, pos)
    assert got.dtype == torch.float32 and got.shape == (2, 16, VOCAB)
    assert torch.allclose(got, expected, atol=TOL, rtol=0), (got - expected).abs().max()


def test_greedy_generate_ar_matches_transformers(hf_pair):
    hf, ours = hf_pair
    prompt = [5, 17, 42, 99, 3]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        free = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                           do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        # VOCAB: an EOS never produced
        assert generate_next_token(ours, prompt, DecodeSettings(24),
                                   eos_ids=(VOCAB,)).tokens == free
        eos = free[12]  # now a token it does produce: both must stop at its first occurrence
        stopped = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
    assert generate_next_token(ours, prompt, DecodeSettings(24), eos_ids=(eos,)).tokens == \
        stopped == free[:free.index(eos) + 1]


def test_refusion_decode_runs_on_loaded_model(hf_pair):
    _, ours = hf_pair
    mask_id, eos_id = VOCAB - 1, VOCAB - 2
    settings = RefusionSettings(16, slot_size=4, serial_num_blocks=2, slot_threshold=0.5,
                                token_threshold=0.1)
    out = generate_refusion(ours, [5, 17, 42, 99, 3], settings, mask_id=mask_id, eos_ids=(eos_id,))
    assert 1 <= len(out.tokens) <= 16 and out.nfe >= 1
    assert all(0 <= t < VOCAB and t != mask_id for t in out.tokens)


def test_missing_shard_is_named(tmp_path):
    save_hf_model(tmp_path, "qwen3", tied=False, sharded=True)
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard.name} not found"):
        from_pretrained(str(tmp_path))


# config.json and the tensors read as transformers reads them (bad input, fifth round)


def with_config(folder, **changes):
    """Rewrites folder's config.json with changes; a value of DELETE drops the field."""
    config = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                    if v != "DELETE"}))


def with_inv_freq(folder):
    """Adds each layer's rotary_emb.inv_freq, as older Llama conversions store it (of another base,
    so that reading it would change the logits)."""
    tensors = load_file(folder / "model.safetensors")
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, 16, 2).float() / 16)
    save_file(tensors | {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone()
                         for i in range(TINY["num_hidden_layers"])}, folder / "model.safetensors")


FOLDER_VARIANTS = {
    # transformers 5 takes rope_parameters' base before a top-level one
    "two-rope-bases": lambda f: with_config(
        f, rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # transformers 4's spelling
    "rope-theta-and-null-scaling": lambda f: with_config(
        f, rope_theta=500.0, rope_scaling=None, rope_parameters="DELETE"),
    "rope-scaling-default": lambda f: with_config(
        f, rope_theta=500.0, rope_scaling={"rope_type": "default", "rope_theta": 2000.0},
        rope_parameters="DELETE"),
    "no-rope-theta": lambda f: with_config(f, rope_theta="DELETE", rope_parameters="DELETE"),
    "rope-parameters-without-theta": lambda f: with_config(
        f, rope_theta=500.0, rope_parameters={"rope_type": "default"}),
    "swish": lambda f: with_config(f, hidden_act="swish"),
    "inv-freq": with_inv_freq,
}


@pytest.mark.parametrize("variant", list(FOLDER_VARIANTS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_folder_transformers_loads_gives_transformers_logits(tmp_path, family, variant):
    transformers = pytest.importorskip("transformers")
    save_hf_model(tmp_path, family, tied=True)
    FOLDER_VARIANTS[variant](tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
    ours = from_pretrained(str(tmp_path))
    assert ours.config.rope_theta == reference.config.rope_parameters["rope_theta"]
    torch.manual_seed(1)
    idx, pos = torch.randint(0, VOCAB, (2, 16)), position_layout("gapped", 2, 16)
    with torch.no_grad():
        expected = reference(input_ids=idx, position_ids=pos,
                             attention_mask=torch.ones_like(idx)).logits
        got = ours(idx, pos)
    assert torch.allclose(got, expected, atol=TOL, rtol=0), (got - expected).abs().max()


# every field a model is built from: (ours, transformers' attribute)
BUILT_FROM = [("vocab_size", "vocab_size"), ("block_size", "max_position_embeddings"),
              ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
              ("n_kv_head", "num_key_value_heads"), ("n_embd", "hidden_size"),
              ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
              ("norm_eps", "rms_norm_eps"), ("tie_embeddings", "tie_word_embeddings")]


REFUSED = {("qwen3", "head_dim=null"): r"head_dim=None \(expected a positive whole number\)",
           ("qwen3", "num_key_value_heads"): "n_head=4 must be a multiple of n_kv_head=32"}


@pytest.mark.parametrize("left_out", [transformers_name for _, transformers_name in BUILT_FROM]
                         + ["rope_theta", "num_key_value_heads=null", "head_dim=null"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_field_config_json_leaves_out_takes_transformers_default(tmp_path, family, left_out):
    """Each field the model is built from, left out of config.json (or null where transformers
    derives it), is what transformers' own config class makes of it."""
    transformers = pytest.importorskip("transformers")
    name, _, null = left_out.partition("=")
    config = {"model_type": family, **TINY, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True}
    config[name] = None if null else "DELETE"
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                      if v != "DELETE"}))
    if (family, left_out) in REFUSED:
        # both refuse a null head_dim; 32 key-value heads (Qwen3Config's default) for 4 query heads
        # cannot be built
        with pytest.raises(ValueError, match=REFUSED[family, left_out]):
            hf_model_config(str(tmp_path))
        if null:
            with pytest.raises(Exception, match="head_dim"):
                transformers.AutoConfig.from_pretrained(str(tmp_path))
        return
    reference = transformers.AutoConfig.from_pretrained(str(tmp_path))
    ours = hf_model_config(str(tmp_path))
    # transformers' LlamaConfig keeps head_dim None where it derives it at the attention layers
    expected = {ours_name: getattr(reference, name) for ours_name, name in BUILT_FROM}
    expected["head_dim"] = expected["head_dim"] or reference.hidden_size // \
        reference.num_attention_heads
    assert {ours_name: getattr(ours, ours_name) for ours_name, _ in BUILT_FROM} == expected
    assert ours.rope_theta == reference.rope_parameters["rope_theta"]


# ----------------------------------------------------------------------------------------------
# from_pretrained on folders written here (no transformers needed)


def save_released_layout(folder, tied=True):
    """A random tiny Transformer saved as the released checkpoints are: config.json in transformers
    4's spelling (rope_theta, rope_scaling null) and model.safetensors with Hugging Face's tensor
    names."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, block_size=128, n_layer=2, n_head=4,
                                    n_kv_head=2, n_embd=64, head_dim=16, intermediate_size=128,
                                    rope_theta=1e6, tie_embeddings=tied)).eval()
    config = {**TINY, "model_type": "qwen3", "rope_theta": 1e6, "rope_scaling": None,
              "rms_norm_eps": 1e-6, "attention_bias": False, "hidden_act": "silu",
              "use_sliding_window": False, "tie_word_embeddings": tied}
    os.makedirs(folder, exist_ok=True)
    Path(folder, "config.json").write_text(json.dumps(config))
    save_file({("" if n == "lm_head.weight" else "model.") + n: t.clone()
               for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")},
              os.path.join(folder, "model.safetensors"))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_released_layout_loads_exactly(tmp_path, tied):
    saved = save_released_layout(tmp_path, tied)
    loaded = from_pretrained(str(tmp_path))
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    assert not loaded.training and loaded.config.block_size == 128 and \
        loaded.config.rope_theta == 1e6
    idx, pos = torch.randint(0, VOCAB, (1, 10)), torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(idx, pos), saved(idx, pos))


def test_a_weight_index_naming_a_file_outside_the_folder_is_refused(tmp_path):
    """model.safetensors.index.json is data from elsewhere: an entry that leaves the model folder
    (.., an absolute path, a symlink out) is refused before anything is read. The links of a Hugging
    Face cache snapshot into its own blobs/ are the folder's own and load."""
    saved = save_released_layout(tmp_path / "other")
    weights = tmp_path / "other" / "model.safetensors"
    names = list(load_file(weights))
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tmp_path / "other" / "config.json", folder)
    os.symlink(weights, folder / "linked.safetensors")
    index = folder / "model.safetensors.index.json"
    for entry in ("../other/model.safetensors", str(weights), "linked.safetensors"):
        index.write_text(json.dumps({"weight_map": {name: entry for name in names}}))
        with pytest.raises(ValueError,
                           match=rf"{re.escape(str(index))} lists the weights file "
                                 rf"'{re.escape(entry)}', outside {re.escape(str(folder))}; "
                                 r".*download the model whole"):
            from_pretrained(str(folder))
    # huggingface_hub's cache
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "blobs").mkdir()
    shutil.copy(weights, snapshot.parent.parent / "blobs" / "9f8e7d")
    shutil.copy(tmp_path / "other" / "config.json", snapshot)
    os.symlink("../../blobs/9f8e7d", snapshot / "model-00001-of-00001.safetensors")
    shard_map = {name: "model-00001-of-00001.safetensors" for name in names}
    (snapshot / index.name).write_text(json.dumps({"weight_map": shard_map}))
    idx, pos = torch.randint(0, VOCAB, (1, 10)), torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(from_pretrained(str(snapshot))(idx, pos), saved(idx, pos))


def test_bfloat16_load_keeps_the_weights_rounded(tmp_path):
    saved = save_released_layout(tmp_path)
    loaded = from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    w = loaded.layers[1].mlp.up_proj.weight
    assert torch.equal(w, saved.layers[1].mlp.up_proj.weight.to(torch.bfloat16))


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                        if v != "DELETE"}))
    return edit


def edit_tensors(keep=lambda name: True, add=()):
    def edit(folder):
        tensors = {n: t for n, t in load_file(folder / "model.safetensors").items() if keep(n)}
        save_file(tensors | {n: torch.zeros(64) for n in add}, folder / "model.safetensors")
    return edit


@pytest.mark.parametrize("fields", [
    {}, {"use_sliding_window": True}, {"use_sliding_window": True, "max_window_layers": 1},
    {"use_sliding_window": True, "max_window_layers": 3},
    {"layer_types": ["sliding_attention", "full_attention"] * 2},
    {"layer_types": ["full_attention"] * 4, "use_sliding_window": True},
    {"layer_types": ["full_attention", "sliding_attention"] * 2, "use_sliding_window": True}])
def test_the_sliding_layers_are_those_of_transformers_qwen3(fields):
    """sliding_layers against Qwen3Config: the layers whose layer type is sliding attention."""
    transformers = pytest.importorskip("transformers")
    config = {"num_hidden_layers": 4, "sliding_window": 8, **fields}
    reference = transformers.Qwen3Config(**config).layer_types
    assert sliding_layers(config, FAMILIES["qwen3"], "config.json") == \
        [i for i, kind in enumerate(reference) if kind == "sliding_attention"]


@pytest.mark.parametrize("edit", [
    edit_config(layer_types=["full_attention"] * 2, use_sliding_window=True, sliding_window=4),
    edit_config(use_sliding_window=True, sliding_window=4),          # max_window_layers 28 > 2
], ids=["every-layer-full", "window-from-layer-28"])
def test_a_sliding_window_no_layer_uses_loads_as_full_attention(tmp_path, edit):
    """use_sliding_window true where transformers slides no layer (layer_types all full, or fewer
    layers than max_window_layers) is full attention there, and here."""
    saved = save_released_layout(tmp_path)
    edit(tmp_path)
    idx, pos = torch.randint(0, VOCAB, (1, 10)), torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(from_pretrained(str(tmp_path))(idx, pos), saved(idx, pos))


@pytest.mark.parametrize("edit, error, message", [
    (lambda f: shutil.rmtree(f), FileNotFoundError, "config.json not found"),
    (lambda f: (f / "config.json").unlink(), FileNotFoundError, "config.json not found"),
    (lambda f: (f / "model.safetensors").unlink(), FileNotFoundError,
     "model.safetensors not found"),
    (edit_config(model_type="mistral"), ValueError, "model_type='mistral' is not implemented"),
    # Llama has no q/k norms: a Qwen3's are refused by name
    (edit_config(model_type="llama"), ValueError,
     r"unexpected tensors: model\.layers\.0\.self_attn\.k_norm\.weight, "
     r"model\.layers\.0\.self_attn\.q_norm"),
    (edit_config(mlp_bias=True), ValueError, "mlp_bias=True is not implemented"),
    (edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ValueError,
     "rope_scaling=.*yarn"),
    (edit_config(attention_bias=True), ValueError, "attention_bias=True is not implemented"),
    # a sliding window as transformers reads one: layer_types first, else use_sliding_window from
    # max_window_layers on; named layers without use_sliding_window, which transformers cannot run
    (edit_config(layer_types=["sliding_attention", "full_attention"]), ValueError,
     r"a sliding window in layers 0 \(layer_types names them while use_sliding_window is false, "
     r"which transformers cannot run either\) is not implemented"),
    (edit_config(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
                 sliding_window=4), ValueError, r"a sliding window in layers 1 is not implemented"),
    (edit_config(use_sliding_window=True, sliding_window=4, max_window_layers=1), ValueError,
     r"a sliding window in layers 1 is not implemented"),
    (edit_config(layer_types=["full_attention"]), ValueError,
     r'layer_types is not "full_attention" or "sliding_attention" for each layer'),
    # a Qwen3 config.json without head_dim means transformers' default, 128
    (edit_config(head_dim="DELETE"), ValueError,
     r"wrongly shaped tensors: model\.layers\.0\.self_attn\.k_norm\.weight \[16\] "
     r"\(config.json implies \[128\]\)"),
    (edit_config(vocab_size=301), ValueError,
     r"wrongly shaped tensors: model\.embed_tokens\.weight \[300, 64\] "
     r"\(config.json implies \[301, 64\]\)"),
    (edit_tensors(keep=lambda n: n != "model.layers.1.mlp.up_proj.weight"), ValueError,
     r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight\."),
    (edit_tensors(add=["model.layers.0.self_attn.q_proj.bias"]), ValueError,
     r"unexpected tensors: model\.layers\.0\.self_attn\.q_proj\.bias\."),
    # 22 missing: five named, then a count
    (edit_tensors(keep=lambda n: "layers" not in n), ValueError,
     r"missing tensors: (model\.layers\.[^,]*, ){4}model\.layers\.[^,]* and 17 more\."),
], ids=["no-folder", "no-config", "no-weights", "model-type", "llama-with-qk-norm", "mlp-bias",
        "rope-scaling", "attention-bias", "sliding-layer-types", "sliding-named-and-used",
        "sliding-from-max-window-layers", "layer-types-too-short", "no-head-dim",
        "wrong-shape", "missing-tensor", "unexpected-tensor", "many-missing"])
def test_from_pretrained_errors_name_the_problem(tmp_path, edit, error, message):
    folder = tmp_path / "model"
    save_released_layout(folder)
    edit(folder)
    with pytest.raises(error, match=message):
        from_pretrained(str(folder))


# ----------------------------------------------------------------------------------------------
# the command lines on a Hugging Face folder: decode it (sampler.py), fine-tune it (train.py)


def test_sampler_decodes_a_folder_in_the_chat_template(tmp_path, capsys):
    # <|mask|> 259: decoded with ReFusion
    save_tiny_hf_folder(tmp_path / "refusion")
    folder = f"--init_from={tmp_path / 'refusion'}"
    enc = tokenizer.get_tokenizer(f"hf:{tmp_path / 'refusion'}")
    # user text stays text
    assert chat_prompt(enc, "Say <|im_end|>") == ([257] + list(b"user\nSay <|im_end|>")
                                                  + [258, 10, 257] + list(b"assistant\n"))
    sampler.main([folder, "--chat", "--prompt=Say hi", "--max_new_tokens=16", "--slot_size=4",
                  "--serial_num_blocks=1", "--json"])
    sampler.main([folder, "--prompt=Say hi", "--max_new_tokens=5", "--method=next_token",
                  "--json"])
    refusion, ar = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert refusion["prompt"].startswith("<|im_start|>user\nSay hi<|im_end|>") and \
        0 < refusion["tokens"] <= 16
    assert ar["nfe"] == ar["tokens"] <= 5
    with pytest.raises(ValueError, match="trained with a causal objective"):
        sampler.main([folder, "--prompt=hi", "--method=mdm"])
    # a plain Qwen3: next-token decoding only
    save_tiny_hf_folder(tmp_path / "qwen3", mask=False)
    with pytest.raises(ValueError, match="no mask token"):
        sampler.main([f"--init_from={tmp_path / 'qwen3'}", "--prompt=hi", "--method=refusion"])
    with pytest.raises(ValueError, match="has no validation split"):
        sampler.main([f"--init_from={tmp_path / 'qwen3'}"])


def test_train_fine_tunes_a_folder_without_a_mask_token(tmp_path, qa_file, capsys, monkeypatch):
    """The paper's recipe from a pretrained Qwen3: its weights and tokenizer, a mask id added after
    the tokenizer's own ids, the hybrid objective; the sampler then decodes the checkpoint."""
    import train
    from support.checkpoint import load_checkpoint
    pretrained = save_tiny_hf_folder(tmp_path / "qwen3", mask=False)
    # a relative folder is recorded absolute
    monkeypatch.chdir(tmp_path)
    flags = ["--init_from=qwen3", f"--dataset={qa_file[0]}", f"--data_root={tmp_path / 'data'}",
             f"--out_dir={tmp_path / 'ft'}", "--block_size=64", "--batch_size=4",
             "--eval_iters=1", "--slot_sizes=2,4", "--warmup_iters=1", "--max_iters=1",
             "--learning_rate=1e-12", "--min_lr=0"]
    with pytest.raises(ValueError, match="--n_layer=3 differs from the checkpoint's 2"):
        train.main(flags + ["--n_layer=3"])
    with pytest.raises(ValueError, match="uses its own tokenizer"):
        train.main(flags + ["--tokenizer=bytes"])
    train.main(flags)
    ckpt = load_checkpoint(str(tmp_path / "ft"))
    meta = ckpt["meta"]
    # <|im_end|>, the added mask, <|endoftext|>
    assert (meta["tokenizer"], meta["eos_id"], meta["mask_id"], meta["pad_id"]) == (
        f"hf:{tmp_path / 'qwen3'}", 258, 259, 256)
    assert ckpt["model_args"]["vocab_size"] == 300 and ckpt["config"]["n_embd"] == 32
    # a 1e-12 step: still the folder's weights
    for name, p in pretrained.state_dict().items():
        torch.testing.assert_close(ckpt["model"][name], p, atol=1e-6, rtol=0)
    capsys.readouterr()
    # the sampler finds the tokenizer from anywhere
    monkeypatch.chdir(tmp_path / "data")
    sampler.main([f"--out_dir={tmp_path / 'ft'}", "--num_samples=1", "--max_new_tokens=8",
                  "--slot_size=4", "--serial_num_blocks=1", "--json"])
    assert json.loads(capsys.readouterr().out)["tokens"] >= 1


def test_token_ids_past_65536_are_stored_as_uint32(tmp_path, qa_file):
    from support.prepare import TokenDataset, prepare
    save_tiny_hf_folder(tmp_path / "big")
    spec = json.loads((tmp_path / "big" / "tokenizer.json").read_text())
    # <|im_end|>, the EOS every sample ends with
    give_ids(spec, [256, 257, 70000, 259])
    (tmp_path / "big" / "tokenizer.json").write_text(json.dumps(spec))
    # a tokenizer alone: its model has no row 70000
    (tmp_path / "big" / "config.json").unlink()
    data_dir = prepare(qa_file[0], f"hf:{tmp_path / 'big'}", 64, data_root=str(tmp_path / "data"))
    ds = TokenDataset(data_dir, "train")
    assert ds.meta["token_dtype"] == "uint32" and ds.tokens.dtype == "uint32"
    prompt, response = ds.sample(0)
    # an id above 2**16 read back whole
    assert response[-1] == 70000
    assert ds.meta["mask_id"] == 259 and ds.meta["vocab_size"] == 70001


def save_sharded_tiny_hf_folder(folder):
    """save_tiny_hf_folder's model with its weights in two shards and an index, as save_pretrained
    writes a large one."""
    save_tiny_hf_folder(folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5],
              "model-00002-of-00002.safetensors": names[5:]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / shard)
    index = {"metadata": {},
             "weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def cut(path, keep=0.5):
    """Truncate the file at path to this share of its bytes, as an interrupted
    download leaves it."""
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:int(len(raw) * keep)])


def as_int8(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = \
        tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(tensors, folder / "model.safetensors")


def larger_than(limit):
    """What is said of a file one byte larger than limit, the most read of it."""
    return rf" is {limit + 1:,} bytes, larger than any real one \(this reads at most {limit:,}\)"


def one_byte_over(limit):
    """A damage that makes the file (created if missing) one byte larger than limit, sparse: nothing
    large is written, and nothing of it may be read."""
    return lambda p: sparse(p, limit + 1)


def replaced_by(make):
    """A damage that puts make(path) where the file was: a directory, a FIFO, a link to a device."""
    def damage(p):
        p.unlink(missing_ok=True)
        make(p)
    return damage


def not_a_file(kind):
    """What is said of a folder's file that is NOT_FILES[kind], and how to make one."""
    make, said = NOT_FILES[kind]
    return replaced_by(make), f" {said}, not a regular file; a model folder holds regular files"


DEEP = "[" * 100_000 + "]" * 100_000
# how a tokenizer.json the `tokenizers` library refuses is named, before the library's reason
LIBRARY = r" does not load in the tokenizers library \("


# (the file, how it is damaged, what the message says after the file's path)
MALFORMED = {
    "config-truncated": ("config.json", lambda p: cut(p), ": invalid JSON at line 1, column "),
    "config-bom": ("config.json", lambda p: p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes()),
                   " starts with a byte order mark"),
    "config-not-utf8": ("config.json",
                        lambda p: p.write_bytes(p.read_bytes().replace(b"silu", b"s\xe9lu")),
                        r" is not UTF-8 \(byte offset "),
    "config-deep": ("config.json", lambda p: p.write_text(DEEP),
                    " is nested deeper than Python's JSON parser can read"),
    "config-list": ("config.json", lambda p: p.write_text("[" + p.read_text() + "]"),
                    ": its top level is a list, not an object"),
    "config-wrong-type": ("config.json",
                          lambda p: edit_json(p, lambda c: c.update(num_hidden_layers="2",
                                                                    rms_norm_eps=None)),
                          r": num_hidden_layers='2' \(expected a positive whole number\), "
                          r"rms_norm_eps=None \(expected a positive finite number\)"),
    "config-rope-type": ("config.json",
                         lambda p: edit_json(p, lambda c: c.update(rope_scaling="linear")),
                         ": rope_scaling is a str, not an object"),
    "config-quantized": ("config.json", lambda p: edit_json(p, lambda c: c.update(
        quantization_config={"quant_method": "gptq", "bits": 4})),
                         r": quantization_config \(quant_method='gptq'\)"),
    "config-pad-id-type": ("config.json",
                           lambda p: edit_json(p, lambda c: c.update(pad_token_id="<pad>")),
                           r": pad_token_id='<pad>' is not a token id"),
    "weights-truncated": ("model.safetensors", lambda p: cut(p, 0.9),
                          " is not a readable safetensors file"),
    "weights-lfs-pointer": ("model.safetensors", lambda p: p.write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456\n"),
                            " is not a readable safetensors file"),
    "weights-int8": ("model.safetensors", lambda p: as_int8(p.parent),
                     r" holds weights that are not floats: "
                     r"model\.layers\.0\.mlp\.up_proj\.weight \(I8\)"),
    "index-no-weight-map": ("model.safetensors.index.json",
                            lambda p: p.write_text('{"metadata": {}}'),
                            ": it has no 'weight_map' object"),
    "index-truncated": ("model.safetensors.index.json", lambda p: cut(p), ": invalid JSON"),
    "shard-truncated": ("model-00002-of-00002.safetensors", lambda p: cut(p),
                        " is not a readable safetensors file"),
    "tokenizer-truncated": ("tokenizer.json", lambda p: cut(p),
                            LIBRARY + r"EOF while parsing a value at line \d+"),
    "tokenizer-bom": ("tokenizer.json", lambda p: p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes()),
                      LIBRARY + r"expected value at line 1 column 1\)"),
    "tokenizer-deep": ("tokenizer.json", lambda p: p.write_text('{"model": ' + DEEP + "}"),
                       LIBRARY + "recursion limit exceeded"),
    "tokenizer-model-type": ("tokenizer.json",
                             lambda p: edit_json(p, lambda s: s.update(model=["BPE"])),
                             LIBRARY + "data did not match any variant of untagged enum "
                                       "ModelUntagged"),
    "tokenizer-vocab-type": ("tokenizer.json",
                             lambda p: edit_json(p, lambda s: s["model"].update(vocab=["a", "b"])),
                             LIBRARY + "invalid type: sequence, expected a map"),
    "tokenizer-id-type": ("tokenizer.json",
                          lambda p: edit_json(p, lambda s: s["added_tokens"][0].update(id="256")),
                          LIBRARY + 'invalid type: string "256", expected u32'),
    "tokenizer-merge-shape": ("tokenizer.json", lambda p: edit_json(p, lambda s: s["model"].update(
        merges=["a b c"])), LIBRARY + "Merges text file invalid"),
    "tokenizer-pre-tokenizer-type": ("tokenizer.json",
                                     lambda p: edit_json(p, lambda s: s.update(pre_tokenizer=[1])),
                                     LIBRARY + "data did not match any variant of untagged enum "
                                               "PreTokenizerUntagged"),
    "tokenizer-config-truncated": ("tokenizer_config.json",
                                   lambda p: (p.write_text('{"chat_template": "{{ x }}"}'), cut(p)),
                                   ": invalid JSON"),
    # larger than any real one: refused by its size, unread (a tokenizer.json of 3 GB was read)
    "config-oversized": ("config.json", one_byte_over(JSON_LIMIT), larger_than(JSON_LIMIT)),
    "index-oversized": ("model.safetensors.index.json", one_byte_over(INDEX_LIMIT),
                        larger_than(INDEX_LIMIT)),
    "tokenizer-oversized": ("tokenizer.json", one_byte_over(TOKENIZER_LIMIT),
                            larger_than(TOKENIZER_LIMIT)),
    "tokenizer-config-oversized": ("tokenizer_config.json", one_byte_over(JSON_LIMIT),
                                   larger_than(JSON_LIMIT)),
    "generation-config-oversized": ("generation_config.json", one_byte_over(JSON_LIMIT),
                                    larger_than(JSON_LIMIT)),
    "chat-template-oversized": ("chat_template.jinja", one_byte_over(JSON_LIMIT),
                                larger_than(JSON_LIMIT)),
    # not a regular file: named for what it is, never opened for reading (a FIFO would block)
    "tokenizer-fifo": ("tokenizer.json", *not_a_file("fifo")),
    "tokenizer-config-directory": ("tokenizer_config.json", *not_a_file("directory")),
    "generation-config-fifo": ("generation_config.json", *not_a_file("fifo")),
    "chat-template-fifo": ("chat_template.jinja", *not_a_file("fifo")),
    "index-directory": ("model.safetensors.index.json", *not_a_file("directory")),
    "shard-fifo": ("model-00002-of-00002.safetensors", *not_a_file("fifo")),
    "weights-dev-zero": ("model.safetensors", *not_a_file("dev-zero")),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_of_a_folder_are_refused_naming_the_file(tmp_path, qa_file, case):
    """A folder's JSON files (truncated, a byte order mark, not UTF-8, nested too deep, fields of
    the wrong type, quantization_config, larger than any real one), its weights (truncated, a Git
    LFS pointer, integer) and its index, or a directory, a FIFO or a device in a file's place, are
    refused by each command line that loads a folder with one line naming the file, before anything
    is written; never a traceback (the message comes through run_cli, which lets no other error
    pass), never a wait on a FIFO."""
    import train
    from tools import eval_humaneval
    from configurator import run_cli
    name, damage, message = MALFORMED[case]
    folder = tmp_path / "model"
    (save_sharded_tiny_hf_folder if "index" in case or "shard" in case
     else save_tiny_hf_folder)(folder)
    damage(folder / name)
    commands = {
        "sampler.py": (sampler.main, ["--prompt=hi"]),
        "train.py": (train.main, [f"--dataset={qa_file[0]}", f"--data_root={tmp_path / 'data'}",
                                  f"--out_dir={tmp_path / 'ft'}", "--block_size=64",
                                  "--max_iters=1"]),
        "tools.eval_humaneval": (eval_humaneval.main, ["--allow_code_eval", "--limit=1"]),
    }
    for command, (main, flags) in commands.items():
        with never_blocks(), pytest.raises(SystemExit) as stop:
            run_cli(main, [f"--init_from={folder}"] + flags)
        line = str(stop.value.code)
        assert "\n" not in line and \
            re.match(f"error: {re.escape(str(folder / name))}{message}", line), (command, line)
    assert not (tmp_path / "ft" / "ckpt.pt").exists()


@pytest.mark.parametrize("name, make, said", [
    *[("config.json", make, f" {said}, not a regular file; a model folder holds regular files")
      for make, said in NOT_FILES.values()],
    ("", os.mkfifo, r" is a FIFO \(named pipe\), not a directory; name a model folder: ")],
    ids=[f"config-{kind}" for kind in NOT_FILES] + ["folder-fifo"])
def test_a_config_json_or_folder_of_another_kind_is_named_not_called_missing(tmp_path, name, make,
                                                                            said):
    """config.json, or the folder itself, that is a directory, a FIFO or a link to /dev/zero: the
    sampler and a fine-tune (train.py --init_from) say what is there and what to do, in one line,
    without waiting on the FIFO (each was called missing)."""
    import train
    from configurator import run_cli
    folder = tmp_path / "model"
    save_tiny_hf_folder(folder)
    if not name:
        shutil.rmtree(folder)   # the folder itself replaced
    there = folder / name if name else folder
    replaced_by(make)(there)
    # (train.py names a FIFO given as --init_from "not a regular file; a checkpoint is ...")
    fine_tune = [(train.main, [f"--out_dir={tmp_path / 'ft'}", "--dataset=quotes"])] if name else []
    for main, flags in [(sampler.main, ["--prompt=hi"])] + fine_tune:
        with never_blocks(), pytest.raises(SystemExit) as stop:
            run_cli(main, [f"--init_from={folder}"] + flags)
        assert re.fullmatch(f"error: {re.escape(str(there))}{said}.*", str(stop.value.code))


def test_a_checkpoint_whose_folder_moved_is_sampled_with_the_folder_named_anew(tmp_path, qa_file,
                                                                               capsys):
    """A checkpoint fine-tuned from a folder records its tokenizer as hf:FOLDER; once the folder
    has moved, the sampler says so and takes it from --tokenizer=hf:NEW."""
    import train
    save_tiny_hf_folder(tmp_path / "qwen3", mask=False)
    train.main([f"--init_from={tmp_path / 'qwen3'}", f"--dataset={qa_file[0]}",
                f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'ft'}",
                "--block_size=64", "--batch_size=2", "--eval_iters=1", "--max_iters=1",
                "--warmup_iters=1"])
    (tmp_path / "qwen3").rename(tmp_path / "moved")
    flags = [f"--out_dir={tmp_path / 'ft'}", "--prompt=hi", "--max_new_tokens=4",
             "--slot_size=4", "--json"]
    with pytest.raises(FileNotFoundError, match=r"records its tokenizer as hf:.*qwen3, a folder "
                                                r"that is no longer there .*--tokenizer=hf:FOLDER"):
        sampler.main(flags)
    capsys.readouterr()
    sampler.main(flags + [f"--tokenizer=hf:{tmp_path / 'moved'}"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt"] == "hi"
