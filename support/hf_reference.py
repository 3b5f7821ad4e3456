"""
The reference a user would otherwise pick: transformers' model with our Transformer's weights,
decoding greedily with its own KV cache (support/benchmark.py measures it beside ours).

    hf_model(model)     Qwen3ForCausalLM or LlamaForCausalLM holding the same weights
    hf_decode(hf, ...)  one prompt through its generate, greedy
"""

import time

import torch


def hf_model(model):
    """transformers' model with the weights of our Transformer `model`: Qwen3ForCausalLM with
    qk_norm, else LlamaForCausalLM, in eval mode on its device and dtype. Returns None where
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    c = model.config
    shape = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd,
                 intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                 num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
                 max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
                 rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                 tie_word_embeddings=c.tie_embeddings)
    if c.qk_norm:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attention_bias=False,
                                                                    mlp_bias=False))
    hf.load_state_dict({("" if k == "lm_head.weight" else "model.") + k: v
                        for k, v in model.state_dict().items()})
    weights = next(model.parameters())
    return hf.to(weights.device, weights.dtype).eval()


def hf_decode(hf, prompt, ids, max_new_tokens):
    """Greedy `generate` of prompt (a list of ids) by hf, stopping at the first EOS, the mask and
    pad ids suppressed (ids: {"eos_ids", "mask_id", "pad_id"}). Returns (the generated ids, EOS
    included, wall-clock seconds)."""
    device = next(hf.parameters()).device
    x = torch.tensor([prompt], device=device)
    suppress = [i for i in (ids["mask_id"], ids["pad_id"])
                if i is not None and i not in ids["eos_ids"]]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=list(ids["eos_ids"]),
                          pad_token_id=ids["eos_ids"][0], suppress_tokens=suppress or None)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0
