"""Config keys of precision, memory, checkpoints, KL/entropy and LoRA (schema.py): defaults,
overrides and one-line errors."""

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import LORA_TARGETS
from sdp_cli.errors import UserError


def test_defaults_keep_the_old_behaviour():
    cfg, _ = compose_config([])
    assert cfg.train.dtype == "float32" and cfg.train.gradient_checkpointing is False
    assert cfg.train.save_optimizer is True and cfg.train.keep_checkpoints == 2
    assert cfg.train.eval_max_new_tokens is None
    assert cfg.loss.kl_coef == 0.0 and cfg.loss.entropy_coef == 0.0 and cfg.loss.kl_type == "low_var_kl"
    assert cfg.model.lora.r == 0
    # Qwen2 and Llama name their attention and MLP projections alike
    assert list(cfg.model.lora.target_modules) == list(LORA_TARGETS)


def test_overrides_land_typed():
    cfg, _ = compose_config(
        [
            "train.dtype=bfloat16",
            "train.gradient_checkpointing=true",
            "train.save_optimizer=false",
            "train.keep_checkpoints=5",
            "train.eval_max_new_tokens=64",
            "loss.kl_coef=0.05",
            "loss.kl_type=k2",
            "loss.entropy_coef=0.001",
            "model.lora.r=16",
            "model.lora.alpha=8",
            "model.lora.target_modules=[q_proj,v_proj]",
        ]
    )
    assert (cfg.train.dtype, cfg.train.keep_checkpoints, cfg.train.eval_max_new_tokens) == ("bfloat16", 5, 64)
    assert (cfg.loss.kl_coef, cfg.loss.kl_type, cfg.loss.entropy_coef) == (0.05, "k2", 0.001)
    lora = cfg.model.lora
    assert (lora.r, lora.alpha, lora.dropout, list(lora.target_modules)) == (16, 8.0, 0.0, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["train.dtype=float16"], "train.dtype='float16' is not valid; choose one of float32, bfloat16"),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints=0 must be > 0"),
        (["train.eval_max_new_tokens=0"], "train.eval_max_new_tokens=0 must be > 0"),
        (["loss.kl_coef=-0.1"], "loss.kl_coef=-0.1 must be >= 0"),
        (["loss.kl_type=full"], "loss.kl_type='full' is not valid"),
        (["loss.entropy_coef=nan"], "loss.entropy_coef=nan must be a finite number"),
        (["model.lora.r=-1"], "model.lora.r=-1 must be >= 0"),
        (["model.lora.r=4", "model.lora.dropout=0.1"], "model.lora.dropout=0.1 is not supported: the trainer runs without dropout"),
        (["model.lora.r=4", "model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
        (["model.lora.r=4", "model.lora.target_modules=[q_proj,lm_head]"], "may not include lm_head"),
        (["model.lora.r=4", "model.lora.alpha=0"], "model.lora.alpha=0.0 must be > 0"),
    ],
)
def test_bad_values_give_one_line(overrides, fragment):
    with pytest.raises(UserError) as err:
        compose_config(overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_lora_settings_are_not_validated_while_lora_is_off():
    # r = 0 turns LoRA off; its other keys need not make sense then where they are not judged (a
    # config file, a resumed run's saved overrides); on the command line they are refused
    # (tests/config/test_inapplicable_keys.py)
    cfg, _ = compose_config(["model.lora.target_modules=[]"], accepted=["model.lora.target_modules=[]"])
    assert cfg.model.lora.r == 0
