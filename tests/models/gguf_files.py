"""Tiny GGUF files for the tests, written with the ``gguf`` package from a tiny random Llama: the
metadata keys, tensor names and the q/k row permutation of llama.cpp's converter, and a byte-level
BPE vocabulary (every byte, one merge, ChatML's special tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: special tokens after the 256 byte tokens; EOS is <|im_end|> as in SmolLM2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens of a byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for _, code in sorted(zip(printable, codes))]


def tokens() -> list[str]:
    """The vocabulary: 256 byte tokens, one merged token ("ĠĠ", two spaces), the specials."""
    return _byte_tokens() + ["ĠĠ"] + SPECIALS


def tiny_llama(seed: int = 0, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    """A random LlamaForCausalLM over the tiny vocabulary (untied output layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokens()),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokens().index("<|im_start|>"),
        eos_token_id=tokens().index("<|im_end|>"),
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so that a mixed-up tensor shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.eval()


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary pairs interleaved); transformers undoes it on load."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: Path, model: torch.nn.Module, *, quant: str = "F32") -> Path:
    """``model`` (from ``tiny_llama``) as a GGUF file; ``quant`` F32 or Q8_0 (2-D weights only,
    norms stay F32 as llama.cpp stores them)."""
    import gguf

    cfg = model.config
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens())
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        for hf, short in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{short}.weight"
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if ".q_proj." in hf_name:
            data = _permute(data, cfg.num_attention_heads)
        elif ".k_proj." in hf_name:
            data = _permute(data, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(names[hf_name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(names[hf_name], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
