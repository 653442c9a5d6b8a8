"""The weight push goes through the pause/resume hooks (docs/design.md §2, sdp_cli/rollout/hooks.py):
the engine is paused by ``PauseController``, the recompute pass is the rollout side's post-pause hook,
and a failing pass reaches the caller as its own exception type with the engine resumed and the
new weights never loaded. A fake engine logs what is called, in order."""

import pytest

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import EngineError, WeightUpdate
from sdp_cli.rollout.hooks import HookError
from sdp_cli.rollout.recompute import RecomputeStats
from sdp_cli.train.asyncloop.rollout import RolloutSide

from .test_rewarding import Codec, CountingEngine, GatedTask


class LoggingEngine(CountingEngine):
    """Logs pause, resume and weight loads; remembers whether it is paused."""

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.paused = False

    def pause(self):
        self.log.append("engine.pause")
        self.paused = True

    def resume(self):
        self.log.append("engine.resume")
        self.paused = False

    def is_paused(self):
        return self.paused

    def update_weights(self, update):
        self.log.append(f"engine.update_weights({update.path})")


def _loop(mode, log):
    cfg = SdpConfig()
    cfg.loss.mode = mode
    cfg.rollout.batch_groups = 1
    cfg.rollout.group_size = 2
    engine = LoggingEngine(log)
    loop = RolloutSide(cfg, engine=engine, task=GatedTask(), codec=Codec(), stop_token_ids=(2,), max_new_tokens=1)
    return loop, engine


def push(loop):
    """The push of the trainer's step 1 (weights of version 1)."""
    return loop._push(WeightUpdate(version=1, path="v1"), last_step=False)


def _recompute_logged(log, error=None):
    def recompute_all(queue=None, cache=None, inflight=None):
        log.append("recompute")
        if error is not None:
            raise error
        return RecomputeStats(version=0, tokens_recomputed=3, samples_recomputed=1)

    return recompute_all


def test_the_push_pauses_recomputes_in_a_post_pause_hook_then_loads_and_resumes():
    log = []
    loop, engine = _loop("segment_wise", log)
    assert loop.pause_hooks.hooks("post_pause") == [loop._recompute_at_push]
    loop.recomputer.recompute_all = _recompute_logged(log)
    # hooks a user registers run around the same push
    loop.pause_hooks.register_pre_pause_hook(lambda: log.append("pre_pause"))
    loop.pause_hooks.register_post_resume_hook(lambda: log.append("post_resume"))
    metrics = push(loop)
    assert log == [
        "pre_pause",
        "engine.pause",
        "recompute",  # old weights still loaded: before the load
        "engine.update_weights(v1)",
        "engine.resume",
        "post_resume",
    ]
    assert metrics["recompute/tokens_at_push"] == 3.0  # the hook's pass is the push's
    assert not engine.paused


def test_a_mode_without_pi_prox_t_registers_no_recompute_hook():
    log = []
    loop, _ = _loop("decoupled", log)
    assert loop.pause_hooks.hooks("post_pause") == []
    metrics = push(loop)
    assert log == ["engine.pause", "engine.update_weights(v1)", "engine.resume"]
    assert "recompute/tokens" not in metrics


@pytest.mark.parametrize("error", [EngineError("server gone"), OSError("disk")])
def test_a_failing_recompute_reaches_the_push_as_its_own_type(error):
    log = []
    loop, engine = _loop("segment_wise", log)
    loop.recomputer.recompute_all = _recompute_logged(log, error)
    with pytest.raises(type(error)) as raised:
        push(loop)
    assert raised.value is error and not isinstance(raised.value, HookError)
    # the engine is resumed and the new weights are never loaded
    assert log == ["engine.pause", "recompute", "engine.resume"] and not engine.paused
