"""Every config composes; bad keys and values fail with one line naming the key."""

import itertools
from pathlib import Path

import pytest

from sdp_cli.choices import RECOMMENDED_DRIFT_CLIP
from sdp_cli.config.compose import compose_config, to_yaml
from sdp_cli.config.schema import SdpConfig, field_docs, groups_per_request
from sdp_cli.config.validation import validate
from sdp_cli.errors import UserError

CONF = Path(__file__).resolve().parents[2] / "sdp_cli" / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_defaults_compose_to_the_schema_defaults():
    cfg, _ = compose_config([])
    assert cfg.loss.mode == "decoupled"
    assert cfg.staleness.strategy == "standard"
    assert cfg.engine.kind == "local"
    assert cfg.model.kind == "tiny"
    assert cfg.task.name == "arith1"


@pytest.mark.parametrize(
    "mode,is_agg,staleness",
    list(itertools.product(_options("mode"), _options("is_agg"), _options("staleness"))),
)
def test_every_group_combination_composes(mode, is_agg, staleness):
    overrides = [f"mode={mode}", f"is_agg={is_agg}", f"staleness={staleness}"]
    if mode == "bypass" and staleness == "segment_wise":
        with pytest.raises(UserError, match="bypass"):
            compose_config(overrides)
        return
    cfg, _ = compose_config(overrides)
    assert (cfg.loss.mode, cfg.loss.is_level, cfg.staleness.strategy) == (mode, is_agg, staleness)


#: the presets of other frameworks' corrections (docs/math.md §9) and their mode: decoupled PPO with
#: their options, or bypass where the peer anchors at π_behav (prime-rl's DPPO)
FIELD_PRESETS = {
    "gspo": "decoupled",
    "icepop": "decoupled",
    "m2po": "decoupled",
    "decoupled_k3_rs": "decoupled",
    "opsm": "decoupled",
    "cispo": "decoupled",
    "dppo": "bypass",
    "a3po": "decoupled",
}


def test_every_field_preset_is_a_file_and_every_file_is_known():
    named = set(FIELD_PRESETS) | {"bypass", "decoupled", "segment_wise"}
    assert {p for p in _options("preset") if not p.startswith("segment_wise_drift")} == named


@pytest.mark.parametrize("preset", _options("preset"))
def test_presets_compose_and_set_mode_and_staleness(preset):
    cfg, _ = compose_config([f"+preset={preset}"])
    drift = preset.startswith("segment_wise_drift")
    assert cfg.loss.mode == ("segment_wise" if drift else FIELD_PRESETS.get(preset, preset))
    expected_staleness = "segment_wise" if preset.startswith("segment_wise") else "standard"
    assert cfg.staleness.strategy == expected_staleness
    # the drift presets: the plain one carries the recommended κ, the _kX ones fix κ = X
    if drift:
        kappa = preset.partition("_k")[2]
        assert cfg.loss.drift_clip == (float(kappa) if kappa else RECOMMENDED_DRIFT_CLIP)
    else:
        assert cfg.loss.drift_clip is None


def test_drift_clip_outside_segment_wise_or_below_one_is_refused():
    with pytest.raises(UserError, match="loss.drift_clip=2.0 needs loss.mode=segment_wise"):
        compose_config(["+preset=decoupled", "loss.drift_clip=2"])
    with pytest.raises(UserError, match="must be >= 1"):
        compose_config(["+preset=segment_wise_drift", "loss.drift_clip=0.5"])
    cfg, _ = compose_config(["+preset=segment_wise_drift", "loss.drift_clip=inf"])
    assert cfg.loss.drift_clip == float("inf")


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        # verl's decoupled_k3_rs: seq_mean_k3 ≤ 0.01, and no behavioural weight (held at 1)
        ("decoupled_k3_rs", {"rejection.level": "geometric", "rejection.metric": "k3", "rejection.upper": 0.01, "weight_cap": 1.0, "weight_floor": 1.0}),
        ("opsm", {"opsm_delta": 0.5}),  # TRL's suggested δ
        ("cispo", {"loss_type": "cispo", "clip": 1.0, "clip_high": 4.0}),  # floor 0, cap 5 (AReaL, TRL)
        ("dppo", {"loss_type": "dppo", "clip": 0.2, "clip_high": 0.2, "dppo_kl_coef": 1e-3, "weight_cap": None}),  # prime-rl's defaults
        ("a3po", {"proximal_source": "loglinear"}),
    ],
)
def test_field_presets_set_the_peers_values(preset, expected):
    cfg, _ = compose_config([f"+preset={preset}"])
    for key, value in expected.items():
        owner, _, name = key.rpartition(".")
        assert getattr(cfg.loss.rejection if owner else cfg.loss, name) == value, key


def test_segment_wise_preset_sets_weight_bounds():
    cfg, _ = compose_config(["+preset=segment_wise"])
    assert (cfg.loss.weight_cap, cfg.loss.weight_floor, cfg.loss.weight_action) == (5.0, 0.2, "truncate")


def test_command_line_overrides_win_over_a_preset():
    cfg, _ = compose_config(["+preset=segment_wise", "loss.weight_cap=3", "is_agg=geometric"])
    assert cfg.loss.weight_cap == 3.0
    assert cfg.loss.is_level == "geometric"
    assert cfg.loss.mode == "segment_wise"


@pytest.mark.parametrize("engine", _options("engine"))
def test_every_engine_option_composes(engine):
    cfg, _ = compose_config([f"engine={engine}"])
    assert cfg.engine.kind == engine
    assert cfg.engine.host == "127.0.0.1"


def test_hf_model_and_gsm8k_need_paths():
    with pytest.raises(UserError, match="model.path"):
        compose_config(["model=hf"])
    cfg, _ = compose_config(["model=hf", "model.path=/some/dir"])
    assert cfg.model.path == "/some/dir"
    with pytest.raises(UserError, match="task.path"):
        compose_config(["task=gsm8k"])


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["foo=1"], "unknown config key 'foo'"),
        (["loss.nope=1"], "unknown config key"),
        (["mode=nope"], "mode=nope: no such option; choose one of bypass, decoupled, segment_wise"),
        (["+preset=nope"], "preset=nope: no such option"),
        (["rollout.batch_groups=abc"], "rollout.batch_groups"),
        (["loss.mode=xx"], "loss.mode='xx' is not valid"),
        (["loss.clip=-1"], "loss.clip=-1.0 must be > 0"),
        (["loss.dual_clip=0.5"], "loss.dual_clip=0.5 must be > 1"),
        (["loss.weight_floor=3", "loss.weight_cap=2"], "loss.weight_floor=3.0 is above loss.weight_cap=2.0"),
        (["loss.weight_action=mask", "loss.weight_cap=null"], "weight_action=mask needs"),
        (["optim.beta1=1.5"], "optim.beta1=1.5 must be in [0, 1)"),
        (["rollout.max_head_offpolicyness=-1"], "must be >= 0"),
        (["mode=segment_wise", "rollout.recompute=never"], "needs the recompute pass"),
        # the Trainer trusts these (it no longer asserts them): A-3PO only with decoupled, and
        # never with the π_prox_t tracking that recompute=always turns on
        (["mode=segment_wise", "loss.proximal_source=loglinear"], "loss.proximal_source=loglinear (A-3PO) approximates"),
        (["mode=decoupled", "loss.proximal_source=loglinear", "rollout.recompute=always"],
         "rollout.recompute=always reads the batch's π_prox"),
        (["engine.port=70000"], "engine.port=70000"),
        (["model.hidden_size=130", "model.num_heads=4"], "divisible"),
        (["rollout.temperature"], "cannot parse override"),
        # the engines and the trainer trust the temperature (no check of their own)
        (["rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
        (["rollout.temperature=1000"], "rollout.temperature=1000.0 is outside [0.01, 100]"),
        (["rollout.temperature=nan"], "rollout.temperature=nan must be a finite number"),
        (["loss.rejection.level=token", "loss.rejection.upper=2", "loss.rejection.lower=3"], "is above"),
        (["optim.minibatches=100000"], "exceeds the batch size"),
        (["rollout.groups_per_request=0"], "rollout.groups_per_request=0 must be > 0"),
        # a value of the wrong type names the type wanted and an example of it
        (["train.steps=abc"], "train.steps=abc is not a whole number; pass one, e.g. train.steps=300"),
        (["train.steps=1.5"], "train.steps=1.5 is not a whole number; pass one, e.g. train.steps=300"),
        (["optim.lr=fast"], "optim.lr=fast is not a number; pass one, e.g. optim.lr=0.0001"),
        (["train.save_batches=maybe"], "train.save_batches=maybe is not true or false; pass train.save_batches=true or false"),
        (["rollout.groups_per_request=many"], "rollout.groups_per_request=many is not a whole number; pass one or null"),
        # a near miss of an option names it
        (["+preset=segmentwise"], "preset=segmentwise: no such option; did you mean segment_wise? Choose one of a3po,"),
        (["mode=decoupeld"], "mode=decoupeld: no such option; did you mean decoupled? Choose one of bypass, decoupled, segment_wise"),
    ],
)
def test_bad_input_gives_one_line_naming_the_problem(overrides, fragment):
    with pytest.raises(UserError) as info:
        compose_config(overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["loss.weight_cap=3"], "loss.weight_cap=3.0 bounds a behavioural weight"),
        (["loss.weight_floor=0.5"], "loss.weight_floor=0.5 bounds a behavioural weight"),
        (["loss.batch_normalize=true"], "loss.batch_normalize=true normalises a behavioural weight"),
        (["loss.rejection.level=token"], "loss.rejection needs a behavioural log ratio"),
        (["loss.rejection.veto=0.0001"], "loss.rejection needs a behavioural log ratio"),
        (["loss.loss_type=reinforce", "loss.rejection.level=geometric"], "loss.rejection needs"),
    ],
)
def test_bypass_refuses_what_it_would_ignore(overrides, fragment):
    # bypass with ppo_clip has no behavioural weight (the PPO ratio is π_θ/π_behav), and no
    # mode-level log ratio to reject on: these keys would silently do nothing
    with pytest.raises(UserError) as info:
        compose_config(["mode=bypass", *overrides])
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bypass_composes_and_reinforce_in_bypass_bounds_its_weight():
    cfg, _ = compose_config(["mode=bypass"])
    assert (cfg.loss.weight_cap, cfg.loss.weight_floor) == (None, None)
    cfg, _ = compose_config(
        ["mode=bypass", "loss.loss_type=reinforce", "loss.weight_cap=2", "loss.batch_normalize=true"]
    )
    assert (cfg.loss.weight_cap, cfg.loss.batch_normalize) == (2.0, True)


def test_resolved_yaml_round_trips_through_validate():
    cfg, raw = compose_config(["+preset=segment_wise", "engine=vllm"])
    text = to_yaml(raw)
    assert "mode: segment_wise" in text
    assert "${" not in text  # interpolations are resolved in what a run directory stores
    validate(cfg)


def test_every_schema_field_is_documented():
    undocumented = [key for key, _, doc in field_docs() if not doc.strip()]
    assert undocumented == []
    keys = {key for key, _, _ in field_docs()}
    assert {"loss.mode", "rollout.max_head_offpolicyness", "engine.urls", "run.dir"} <= keys


def test_schema_defaults_validate():
    validate(SdpConfig())


def test_debug_fast_is_the_documented_small_run_and_key_overrides_win():
    # the values written in sdp_cli/conf/debug/fast.yaml and README's `+debug` row; each differs
    # from the schema default (checked first), so a group that is not applied fails here
    default, _ = compose_config([])
    fast, _ = compose_config(["+preset=segment_wise", "+debug=fast", "rollout.group_size=2"])
    picked = lambda c: (  # noqa: E731
        c.model.hidden_size, c.model.num_layers, c.model.num_heads, c.model.intermediate_size,
        c.model.warm_start_steps, c.rollout.batch_groups, c.rollout.groups_per_request,
        c.run.progress, c.run.tensorboard, c.train.eval_samples,
    )
    expected = (64, 2, 2, 128, 10, 4, 4, False, False, 0)
    assert all(a != b for a, b in zip(picked(default), expected))
    assert picked(fast) == expected
    assert fast.rollout.group_size == 2  # a key=value override beats the debug group
    assert fast.loss.mode == "segment_wise"  # and the group leaves the preset's choices alone


@pytest.mark.parametrize(
    "overrides,expected",
    [
        # null: the whole batch at η = 0 (it is all generated before a step trains) and when the
        # engine runs recompute passes (segment-wise), else 8
        (["rollout.max_head_offpolicyness=0"], 16),
        (["rollout.max_head_offpolicyness=0", "rollout.batch_groups=5"], 5),
        (["rollout.max_head_offpolicyness=1"], 8),
        (["rollout.max_head_offpolicyness=4", "rollout.batch_groups=5"], 8),
        (["+preset=segment_wise", "rollout.max_head_offpolicyness=4", "rollout.batch_groups=40"], 40),
        (["+preset=decoupled", "rollout.max_head_offpolicyness=4", "rollout.recompute=always"], 16),
        (["+preset=decoupled", "rollout.max_head_offpolicyness=4"], 8),
        # a value that is set is kept at any η
        (["rollout.max_head_offpolicyness=0", "rollout.groups_per_request=3"], 3),
        (["rollout.max_head_offpolicyness=4", "rollout.groups_per_request=32"], 32),
    ],
)
def test_groups_per_request_resolves_null_by_staleness_and_recompute(overrides, expected):
    cfg, _ = compose_config(overrides)
    assert groups_per_request(cfg) == expected


# Each pair: the edge value a rule allows, and the first one past it, with its one line.
VLLM = ["engine=vllm", "model=hf", "model.path=org/x"]
DATA = ["task=dataset", "task.path=x.jsonl", "task.reward=final_number"]
ZERO = ["task.reward_errors=zero"]
EDGES = [
    (["optim.minibatches=128"], ["optim.minibatches=129"], "optim.minibatches=129 exceeds the batch size (16·8 samples)"),
    (
        ["loss.rejection.level=token", "loss.rejection.upper=2", "loss.rejection.lower=2"],
        ["loss.rejection.level=token", "loss.rejection.upper=2", "loss.rejection.lower=2.0001"],
        "loss.rejection.lower=2.0001 is above loss.rejection.upper=2.0",
    ),
    (
        ["train.batch_timeout_s=2592000"],
        ["train.batch_timeout_s=2592000.5"],
        "train.batch_timeout_s=2592000.5 is longer than 30 days (2592000 s); choose a shorter timeout",
    ),
    (
        [*DATA, "task.eval_path=y.jsonl"],
        [*DATA, "task.eval_path=y.jsonl", "task.eval_fraction=0.1"],
        "set one of task.eval_path and task.eval_fraction, not both",
    ),
    (["seed=4611686018427387904"], ["seed=4611686018427387905"],
     "seed=4611686018427387905 must be an integer between -4611686018427387904 and 4611686018427387904 (2**62)"),
    (["seed=-4611686018427387904"], ["seed=-4611686018427387905"],
     "seed=-4611686018427387905 must be an integer between -4611686018427387904 and 4611686018427387904 (2**62)"),
    (["rollout.temperature=0.01"], ["rollout.temperature=0.0099"], "rollout.temperature=0.0099 is outside [0.01, 100]"),
    (["rollout.temperature=100"], ["rollout.temperature=100.5"], "rollout.temperature=100.5 is outside [0.01, 100]"),
    (
        ["train.parallel=fsdp"],
        ["train.parallel=fsdp", "model.lora.r=8"],
        "train.parallel=fsdp with LoRA (model.lora.r > 0) is not supported; train LoRA adapters with "
        "train.parallel=ddp (the base is frozen, only the adapters train)",
    ),
    (["train.eval_every=2147483647"], ["train.eval_every=2147483648"],
     "train.eval_every=2147483648 is more than 2147483647 (2**31 - 1) in size; choose a smaller number"),
    ([*VLLM, "engine.retries=100"],
     [*VLLM, "engine.retries=101"],
     "engine.retries=101 is more than 100, the most sdp takes; choose a smaller number"),
    ([*VLLM, "engine.port=65535"],
     [*VLLM, "engine.port=65536"],
     "engine.port=65536 must be in 0..65535"),
    ([*ZERO, "task.reward_max_error_rate=1"],
     [*ZERO, "task.reward_max_error_rate=1.01"],
     "task.reward_max_error_rate=1.01 must be in [0, 1] (1: never stop for reward errors)"),
    ([*ZERO, "task.reward_max_error_rate=0"],
     [*ZERO, "task.reward_max_error_rate=-0.01"],
     "task.reward_max_error_rate=-0.01 must be in [0, 1] (1: never stop for reward errors)"),
    (["task=runsum", "task.digits=12"], ["task.digits=12"], "task.digits applies to task=runsum, not task=arith1; remove it"),
    # A-3PO's π_prox is made inside the step: a rejection veto alone reads the batch's π_prox too
    (["loss.rejection.veto=1e-4"], ["loss.proximal_source=loglinear", "loss.rejection.veto=1e-4"],
     "loss.rejection reads the batch's π_prox before the update, which loss.proximal_source=loglinear (A-3PO) "
     "never computes; turn it off or use loss.proximal_source=forward"),
    (["loss.mode=segment_wise", "loss.drift_clip=1"], ["loss.mode=segment_wise", "loss.drift_clip=0.99"],
     "loss.drift_clip=0.99 must be >= 1 (1 = segment-wise, inf = decoupled)"),
    (["loss.dual_clip=1.01"], ["loss.dual_clip=1"], "loss.dual_clip=1.0 must be > 1 (or null to turn it off)"),
    (["loss.dual_clip=1e9"], ["loss.dual_clip=inf"], "loss.dual_clip=inf must be > 1 (or null to turn it off)"),
    (["optim.beta1=0"], ["optim.beta1=-0.01"], "optim.beta1=-0.01 must be in [0, 1)"),
    (["optim.beta2=0.999999"], ["optim.beta2=1"], "optim.beta2=1.0 must be in [0, 1)"),
    (["model.warm_start_target=1"], ["model.warm_start_target=1.01"], "model.warm_start_target=1.01 must be in (0, 1]"),
    (["model.warm_start_target=0.01"], ["model.warm_start_target=0"], "model.warm_start_target=0.0 must be in (0, 1]"),
    (["task=runsum", "task.digits=2"], ["task=runsum", "task.digits=1"], "task.digits=1 must be in [2, 12]"),
    (["task=runsum", "task.digits=12"], ["task=runsum", "task.digits=13"], "task.digits=13 must be in [2, 12]"),
    ([*DATA, "task.eval_fraction=0.001"],
     [*DATA, "task.eval_fraction=0"],
     "task.eval_fraction=0.0 must be in (0, 1)"),
    ([*DATA, "task.eval_fraction=0.999"],
     [*DATA, "task.eval_fraction=1"],
     "task.eval_fraction=1.0 must be in (0, 1)"),
    (DATA, ["task=dataset", "task.path=x.jsonl"],
     "task=dataset needs task.reward=final_number|boxed|regex|package.module:function|path/to/file.py:function"),
    # what only one policy loss has: allowed with it, refused with another
    (
        ["loss.dual_clip=3"],
        ["loss.dual_clip=3", "loss.loss_type=dppo"],
        "loss.dual_clip bounds the PPO clip's loss, which loss.loss_type=dppo does not have; "
        "set loss.dual_clip=null or loss.loss_type=ppo_clip",
    ),
    (
        ["loss.dppo_kl_coef=0.1", "loss.loss_type=dppo"],
        ["loss.dppo_kl_coef=0.1"],
        "loss.dppo_kl_coef=0.1 is DPPO's penalty; set loss.loss_type=dppo or loss.dppo_kl_coef=0",
    ),
]


@pytest.mark.parametrize(("allowed", "refused", "message"), EDGES, ids=lambda v: v if isinstance(v, str) else None)
def test_a_rule_allows_its_edge_and_refuses_past_it(allowed, refused, message):
    compose_config(allowed)
    with pytest.raises(UserError) as err:
        compose_config(refused)
    assert str(err.value) == message


def test_a_dataset_task_takes_a_held_out_fraction_alone():
    cfg, _ = compose_config(["task=dataset", "task.path=x.jsonl", "task.reward=final_number", "task.eval_fraction=0.1"])
    assert cfg.task.eval_fraction == 0.1 and cfg.task.eval_path is None


@pytest.mark.parametrize("spec", [":score", "my_modes.py:", "my_modes:not-a-name", "my_modes.py:2x"])
def test_a_mode_of_yours_needs_a_module_and_a_function_name(spec):
    with pytest.raises(UserError) as err:
        compose_config([f"loss.mode={spec}"])
    assert str(err.value) == f"loss.mode={spec}: expected package.module:function or path/to/file.py:function"
