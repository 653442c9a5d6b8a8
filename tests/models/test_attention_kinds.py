"""sdp_cli/models/attention.py: which padding layouts a config's attention keeps exact, on the
configs transformers ships (defaults, unless a field is set as named)."""

import pytest
from transformers import AutoConfig

from sdp_cli.models.attention import AttentionLayout, attention_layout, unvouched_kinds

ANY, CONTIGUOUS, PLAIN = AttentionLayout.ANY, AttentionLayout.CONTIGUOUS, AttentionLayout.PLAIN


@pytest.mark.parametrize(
    ("model_type", "fields", "layout", "named"),
    [
        ("llama", {}, ANY, []),
        ("qwen2", {}, ANY, []),  # use_sliding_window=False: Qwen2 clears sliding_window itself
        ("qwen2_moe", {}, ANY, []),  # its default sliding_window is 0: no window
        ("mistral", {"sliding_window": None}, ANY, []),  # Mistral-7B-v0.2 on
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}, CONTIGUOUS, []),
        ("mistral", {}, CONTIGUOUS, []),  # v0.1: a 4096 window in every layer, no layer_types
        ("phi3", {"sliding_window": 2047}, CONTIGUOUS, []),  # Phi-3-mini-4k
        ("gemma2", {}, CONTIGUOUS, []),  # alternating full and sliding layers
        ("gemma3_text", {}, CONTIGUOUS, []),
        ("llama4_text", {}, PLAIN, ["attention_chunk_size", "chunked_attention"]),
        ("qwen3_next", {}, PLAIN, ["linear_attention", "linear_conv_kernel_dim"]),
        ("gpt_neo", {}, PLAIN, ["attention_layers", "attention_types", "window_size"]),
        ("rwkv", {}, PLAIN, ["rwkv"]),  # recurrent, with no field that says so
        ("mamba", {}, PLAIN, ["conv_kernel", "mamba", "state_size"]),
    ],
)
def test_layouts_of_shipped_configs(model_type, fields, layout, named):
    config = AutoConfig.for_model(model_type, **fields)
    assert attention_layout(config) is layout
    assert unvouched_kinds(config) == named


def test_a_field_the_model_ignores_still_counts_and_no_config_is_plain():
    config = AutoConfig.for_model("llama")
    config.attention_chunk_size = 8  # conservative: the config alone decides
    assert attention_layout(config) is PLAIN and unvouched_kinds(config) == ["attention_chunk_size"]
    assert attention_layout(None) is PLAIN and unvouched_kinds(None) == ["no config"]
    assert attention_layout(AutoConfig.for_model("qwen2", layer_types=["full_attention", "mamba"], num_hidden_layers=2)) is PLAIN
