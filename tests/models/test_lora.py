"""LoRA through peft (sdp_cli/models/lora.py) and dtype-cast saving (save_policy): merged weights
are W + (α/r)·B·A, engines and files see a plain model, adapters round-trip strictly."""

import copy
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from sdp_cli.errors import UserError
from sdp_cli.models import load_policy, save_policy
from sdp_cli.models.lora import (
    apply_lora,
    is_adapter_dir,
    is_lora,
    load_adapters,
    load_merged,
    merged_copy,
    merged_state_dict,
    save_adapters,
)

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _policy(seed=3):
    return load_policy("tiny", task="arith1", warm_start_steps=0, seed=seed, **SMALL)


def _lora_policy(r=4, alpha=None, seed=3):
    policy = _policy(seed)
    policy.model = apply_lora(policy.model, r=r, alpha=alpha, dropout=0.0, target_modules=TARGETS)
    # peft starts B at 0 (the update is 0); random B makes the adapters do something
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return policy


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


IDS = [1, 7, 14, 8, 18, 9, 12]


def test_only_adapters_train():
    policy = _lora_policy()
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers × 3 targets × (A, B)
    assert len(trainable) == 12
    assert is_lora(policy.model) and not is_lora(_policy().model)


def test_merged_weight_is_w_plus_scaled_b_a():
    policy = _lora_policy(r=4, alpha=6.0)
    layer = policy.model.get_base_model().model.layers[1].self_attn.q_proj
    w = layer.base_layer.weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    merged = merged_state_dict(policy.model)
    # scaling α/r = 6/4 = 1.5
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"], w + 1.5 * (b @ a))
    # the base's own names, nothing of peft's
    assert set(merged) == set(_policy().model.state_dict())
    # a layer without adapters is passed through as it is
    k = policy.model.get_base_model().model.layers[0].self_attn.k_proj.weight
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], k)


def test_alpha_defaults_to_twice_the_rank():
    policy = _lora_policy(r=4)
    assert policy.model.peft_config["default"].lora_alpha == 8.0


def test_merged_copy_computes_what_the_lora_model_computes():
    policy = _lora_policy()
    plain = merged_copy(policy.model)
    assert not is_lora(plain) and is_lora(policy.model)  # the original keeps its adapters
    torch.testing.assert_close(_logits(plain, IDS), _logits(policy.model, IDS), rtol=1e-5, atol=1e-5)


def test_save_policy_writes_a_plain_merged_model(tmp_path):
    policy = _lora_policy()
    save_policy(policy, tmp_path / "merged")
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in tensors)
    loaded = load_policy("hf", path=tmp_path / "merged")
    torch.testing.assert_close(_logits(loaded.model, IDS), _logits(policy.model, IDS), rtol=1e-5, atol=1e-5)


def test_save_policy_casts_weights_and_config(tmp_path):
    policy = _policy()
    save_policy(policy, tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # tied embeddings stay one tensor: the output embedding is not stored twice
    assert "lm_head.weight" not in tensors
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_policy("hf", path=tmp_path / "bf16", dtype="auto")
    assert loaded.model.dtype == torch.bfloat16
    assert load_policy("hf", path=tmp_path / "bf16").model.dtype == torch.float32  # the default casts
    emb = policy.model.model.embed_tokens.weight.detach()
    assert torch.equal(loaded.model.model.embed_tokens.weight, emb.to(torch.bfloat16))


def test_adapters_round_trip_and_refuse_other_settings(tmp_path):
    policy = _lora_policy()
    save_adapters(policy.model, tmp_path / "ad")
    assert is_adapter_dir(tmp_path / "ad") and not is_adapter_dir(tmp_path)
    assert {p.name for p in (tmp_path / "ad").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    fresh = _policy()
    fresh.model = apply_lora(fresh.model, r=4, alpha=None, dropout=0.0, target_modules=TARGETS)
    load_adapters(fresh.model, tmp_path / "ad")
    assert torch.equal(_logits(fresh.model, IDS), _logits(policy.model, IDS))
    other = _policy()
    other.model = apply_lora(other.model, r=8, alpha=None, dropout=0.0, target_modules=TARGETS)
    with pytest.raises(UserError, match="adapters do not fit the model"):
        load_adapters(other.model, tmp_path / "ad")
    # adapters merged onto a fresh copy of the base give the LoRA model's logits
    merged = load_merged(_policy().model, tmp_path / "ad")
    torch.testing.assert_close(_logits(merged, IDS), _logits(policy.model, IDS), rtol=1e-5, atol=1e-5)


def test_half_precision_base_keeps_float32_adapters_and_merges_in_its_dtype():
    policy = _policy()
    policy.model.to(torch.bfloat16)
    policy.model = apply_lora(policy.model, r=2, alpha=None, dropout=0.0, target_modules=TARGETS)
    dtypes = {n: p.dtype for n, p in policy.model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n)
    assert {t.dtype for t in merged_state_dict(policy.model).values()} == {torch.bfloat16}


def test_unknown_target_modules_are_one_line():
    with pytest.raises(UserError, match=r"model.lora.target_modules=\['nope'\] does not fit the model") as err:
        apply_lora(_policy().model, r=2, alpha=None, dropout=0.0, target_modules=["nope"])
    assert "\n" not in str(err.value)


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(UserError, match=r"install the lora extra: pip install 'sdp-cli\[lora\]'"):
        apply_lora(copy.deepcopy(_policy().model), r=2, alpha=None, dropout=0.0, target_modules=TARGETS)
