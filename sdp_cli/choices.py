"""Every closed set of names sdp accepts, in one place (torch-free, imported by the CLI).
The correction modes are an open set: their registry is ``sdp_cli/modes.py``.

The config schema validates against these tuples, the kernels check their arguments against
them and the batch reader checks file metadata against them, so a name added here is accepted
everywhere at once. The order is the order in which help texts and reports list the names.
"""

from __future__ import annotations

#: aggregation levels of importance weights and rejection sampling (``loss.is_level``,
#: ``loss.rejection.level``; docs/math.md §2)
IS_LEVELS = ("token", "sequence", "geometric")
#: what a weight outside [floor, cap] becomes (``loss.weight_action``; docs/math.md §2)
WEIGHT_ACTIONS = ("truncate", "mask")
#: loss aggregations (``loss.agg``; docs/math.md §5.2)
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: the levels of rejection sampling (``loss.rejection.level``; docs/math.md §3): the weight's, and
#: ``max``, a sequence's largest per-token divergence (verl's seq_max_k2/k3)
REJECTION_LEVELS = (*IS_LEVELS, "max")
#: what rejection sampling bounds (``loss.rejection.metric``; docs/math.md §3): the ratio, or
#: verl's k2/k3 divergence estimates of its log
REJECTION_METRICS = ("ratio", "k2", "k3")
#: policy losses (``loss.loss_type``; docs/math.md §5.1, §9.5 CISPO, §9.6 DPPO)
LOSS_TYPES = ("ppo_clip", "reinforce", "cispo", "dppo")
#: the level of the PPO ratio π_θ/π_anchor (``loss.ratio_level``; sequence = GSPO, docs/math.md §9.3)
RATIO_LEVELS = ("token", "sequence")
#: where π_prox comes from (``loss.proximal_source``; docs/math.md §9.7): the trainer's forward, or
#: A-3PO's log-linear interpolation between π_behav and π_θ
PROXIMAL_SOURCES = ("forward", "loglinear")
#: consume-time staleness strategies (``staleness.strategy``; docs/design.md §3)
STALENESS_STRATEGIES = ("standard", "segment_wise")
#: when the engine recompute pass runs (``rollout.recompute``; docs/training.md)
RECOMPUTE_POLICIES = ("auto", "always", "never")
#: where π_prox_t of a token one version behind comes from (``rollout.proximal_t_source``;
#: docs/training.md)
PROXIMAL_T_SOURCES = ("engine", "trainer")
#: the built-in inference engines (``conf/engine/``) and ``sdp recompute --engine``'s scorers; a
#: run's ``engine.kind`` is checked against the engine registry, ``sdp_cli/engines.py``
ENGINE_KINDS = ("local", "vllm", "sglang")
#: the engines that are HTTP servers (``engine.kind``, ``sdp recompute --engine``)
REMOTE_ENGINE_KINDS = ("vllm", "sglang")
#: policy models (``model.kind``)
MODEL_KINDS = ("tiny", "hf")
#: character sets of the tiny character-level tokenizer (``model.charset``)
CHARSETS = ("arith", "ascii")
#: tasks (``task.name``; docs/tasks.md): the generated and built-in ones and your own data
TASKS = ("arith1", "arith2", "runsum", "gsm8k", "dataset")
#: the tasks that read a data file and take every data-set key (``task.path``, ...)
DATA_TASKS = ("gsm8k", "dataset")
#: where reward functions run (``task.reward_pool``; docs/tasks.md "How rewards run")
REWARD_POOLS = ("thread", "process")
#: what a failing or timed-out reward call does (``task.reward_errors``; docs/tasks.md "How rewards run")
REWARD_ERRORS = ("raise", "zero")
#: experiment trackers (``run.trackers``; docs/training.md "Experiment trackers")
TRACKERS = ("tensorboard", "wandb", "mlflow")
#: KL-to-reference estimators (``loss.kl_type``; docs/math.md §8)
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
#: training precisions (``train.dtype``; docs/training.md)
TRAIN_DTYPES = ("float32", "bfloat16")
#: how several training processes split the model (``train.parallel``; docs/training.md)
PARALLEL_MODES = ("ddp", "fsdp")
#: why a sample stopped generating (a finished rollout record, a server's answer)
FINISH_REASONS = ("stop", "length")

#: the drift clip κ of ``+preset=segment_wise_drift`` and of the shadow drift-clipped weight in
#: runs that train without one: the κ the drift-clip study recommends (docs/results.md)
RECOMMENDED_DRIFT_CLIP = 4.0
#: the κ values that study swept; ``sdp recompute --exact`` reports these unless told others
STUDIED_DRIFT_CLIPS = (1.5, 2.0, 3.0, 4.0)
