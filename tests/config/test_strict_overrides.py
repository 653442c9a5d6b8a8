"""Strict overrides (issue 14): nothing on the command line is accepted and then ignored.

`+loss.kl_coef=0.1`, `+train.stpes=5` and `hydra.run.dir=...` used to compose without error and
change nothing. Every unknown key — with or without `+`/`++` — is refused in one line naming
the nearest valid key; the check is driven by the schema, so a key the schema gains is accepted.
"""

import dataclasses

import pytest

from sdp_cli.config import schema
from sdp_cli.config.compose import compose_config
from sdp_cli.config.overrides import nearest_key, schema_keys
from sdp_cli.errors import UserError


def _refused(overrides) -> str:
    with pytest.raises(UserError) as info:
        compose_config(overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("override", "key", "nearest"),
    [
        ("+train.stpes=5", "train.stpes", "train.steps"),  # the typo is one transposition from steps
        ("train.stpes=5", "train.stpes", "train.steps"),
        ("++train.stpes=5", "train.stpes", "train.steps"),
        ("+optim.lrr=0.1", "optim.lrr", "optim.lr"),
        ("+rollout.group_sise=4", "rollout.group_sise", "rollout.group_size"),
        ("+task.prompt_kye=q", "task.prompt_kye", "task.prompt_key"),
    ],
)
def test_an_unknown_key_is_refused_naming_the_nearest_valid_key(override, key, nearest):
    message = _refused([override])
    assert f"unknown config key '{key}'" in message
    assert f"the nearest valid key is {nearest}" in message


def test_an_added_key_the_schema_lacks_is_refused():
    # `loss.kl_target` (an adaptive-KL setting elsewhere) is not a schema key: whatever the
    # nearest key, it must not pass
    message = _refused(["+loss.kl_target=0.1"])
    assert "unknown config key 'loss.kl_target'" in message and "nearest valid key is loss." in message


def test_the_check_follows_the_schema_not_a_list(monkeypatch):
    # a schema that gains loss.kl_target accepts it, with and without '+'
    fields = [(f.name, f.type, f) for f in dataclasses.fields(schema.LossConfig)]
    extended = dataclasses.make_dataclass(
        "LossConfig", [*fields, ("kl_target", float, dataclasses.field(default=0.0))]
    )
    extended.__module__ = schema.__name__
    sdp_fields = [(f.name, f.type, f) for f in dataclasses.fields(schema.SdpConfig)]
    sdp_fields = [
        (n, t, dataclasses.field(default_factory=extended)) if n == "loss" else (n, t, f)
        for n, t, f in sdp_fields
    ]
    extended_sdp = dataclasses.make_dataclass("SdpConfig", sdp_fields)
    extended_sdp.__module__ = schema.__name__
    monkeypatch.setattr(schema, "LossConfig", extended)
    monkeypatch.setattr(schema, "SdpConfig", extended_sdp)
    assert "loss.kl_target" in schema_keys(extended_sdp)
    from sdp_cli.config import compose, overrides

    monkeypatch.setattr(compose, "SdpConfig", extended_sdp)
    monkeypatch.setattr(compose, "to_config", lambda cfg: cfg)
    assert overrides.unknown_keys(compose.compose_dict(["loss.kl_target=0.1"])) == []
    assert overrides.unknown_keys(compose.compose_dict(["++loss.kl_target=0.1"])) == []
    with pytest.raises(UserError, match=r"\+loss.kl_target: the key exists already; set it without '\+'"):
        compose.compose_dict(["+loss.kl_target=0.1"])


def test_free_form_mappings_and_group_additions_keep_working():
    cfg, _ = compose_config(["engine=vllm", "+engine.env.MY_VAR=1", "+preset=segment_wise", "++train.steps=3"])
    assert cfg.engine.env == {"MY_VAR": "1"} and cfg.loss.mode == "segment_wise" and cfg.train.steps == 3


def test_hydra_run_dir_becomes_run_dir():
    cfg, _ = compose_config(["hydra.run.dir=/tmp/somewhere"])
    assert cfg.run.dir == "/tmp/somewhere"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["hydra.job.chdir=true"], "has no effect on sdp train"),
        (["hydra.verbose=true"], "has no effect on sdp train"),
        (["hydra/launcher=basic"], "sdp ablate"),
        (["hydra.sweep.dir=x"], "sdp ablate"),
        (["hydra.searchpath=[file:///x]"], "--config-dir"),
        (["~train.steps"], "cannot delete a config key"),
        (["~preset"], "cannot delete a config key"),
        (["seed=1,2"], "is a sweep; sdp train runs one job; sweep with sdp ablate"),
        (["seed=range(3)"], "is a sweep"),
        (["mode=bypass,decoupled"], "is a sweep"),
        (["-m", "seed=1"], "-m: sdp train runs one job"),
        (["--multirun"], "--multirun: sdp train runs one job"),
        (["--stpes=3"], "unknown option '--stpes'"),
        (["task.prompt_template={question}"], "quote a value with braces"),
    ],
)
def test_overrides_sdp_train_cannot_honour_are_refused(overrides, fragment):
    assert fragment in _refused(overrides)


def test_a_quoted_comma_is_a_value_not_a_sweep():
    cfg, _ = compose_config(["run.name='a,b'"])
    assert cfg.run.name == "a,b"


def test_every_schema_leaf_is_its_own_nearest_key():
    for key in schema_keys():
        assert nearest_key(key) == key


def test_the_command_line_limits_allow_their_edge_and_refuse_past_it():
    """check_override_sizes: at most MAX_OVERRIDES overrides, MAX_OVERRIDE_CHARS characters each,
    MAX_OVERRIDE_ITEMS list or mapping items in all (``a=[x,y]`` counts 2: its "[" and ","),
    each refused one past its limit in one line."""
    from sdp_cli.config import limits

    limits.check_override_sizes(["seed=1"] * limits.MAX_OVERRIDES)
    with pytest.raises(UserError, match=r"^1001 overrides; sdp takes at most 1000; put them in a config file"):
        limits.check_override_sizes(["seed=1"] * (limits.MAX_OVERRIDES + 1))
    longest = "run.name=" + "x" * (limits.MAX_OVERRIDE_CHARS - len("run.name="))
    limits.check_override_sizes([longest])
    with pytest.raises(UserError, match=r"^override 'run.name=x{31}…' is longer than 65536 characters"):
        limits.check_override_sizes([longest + "x"])
    assert limits.override_items("a=[x,y]") == 2 and limits.override_items("a='[x,y]'") == 0
    at_limit = "a=[" + ",".join("x" * limits.MAX_OVERRIDE_ITEMS) + "]"  # 1 "[" and 999 ","
    assert limits.override_items(at_limit) == limits.MAX_OVERRIDE_ITEMS
    limits.check_override_sizes([at_limit])
    with pytest.raises(UserError, match=r"the overrides have more than 1000 list or mapping items"):
        limits.check_override_sizes([at_limit, "b=[y]"])
