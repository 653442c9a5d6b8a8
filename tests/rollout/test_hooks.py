"""Pause/resume hooks: order, failure reporting, and the engine is never left paused."""

import pytest

from sdp_cli.rollout.hooks import HookError, PauseController, PauseHooks


class FakeEngine:
    def __init__(self, log, fail_pause=False):
        self.log = log
        self.is_paused = False
        self.fail_pause = fail_pause

    def pause(self):
        self.log.append("engine.pause")
        if self.fail_pause:
            raise RuntimeError("server gone")
        self.is_paused = True

    def resume(self):
        self.log.append("engine.resume")
        self.is_paused = False


def logger(log, name):
    def hook():
        log.append(name)

    hook.__qualname__ = name
    return hook


def failing(log, name):
    def hook():
        log.append(name)
        raise ValueError("boom")

    hook.__qualname__ = name
    return hook


def setup(**engine_kwargs):
    log = []
    engine = FakeEngine(log, **engine_kwargs)
    return log, engine, PauseController(engine)


def test_hooks_run_in_registration_order_around_the_engine():
    log, engine, ctl = setup()
    for phase in ("pre_pause", "post_pause", "pre_resume", "post_resume"):
        for i in (1, 2):
            getattr(ctl.hooks, f"register_{phase}_hook")(logger(log, f"{phase}{i}"))
    ctl.pause()
    assert engine.is_paused
    ctl.resume()
    assert log == [
        "pre_pause1",
        "pre_pause2",
        "engine.pause",
        "post_pause1",
        "post_pause2",
        "pre_resume1",
        "pre_resume2",
        "engine.resume",
        "post_resume1",
        "post_resume2",
    ]
    assert not engine.is_paused


def test_failing_pre_pause_hook_leaves_engine_running():
    log, engine, ctl = setup()
    ctl.hooks.register_pre_pause_hook(failing(log, "recompute"))
    ctl.hooks.register_pre_pause_hook(logger(log, "never"))
    with pytest.raises(HookError) as err:
        ctl.pause()
    assert err.value.phase == "pre_pause" and err.value.hook_name == "recompute"
    assert str(err.value) == "pre_pause hook recompute failed: ValueError: boom"
    assert isinstance(err.value.__cause__, ValueError)
    assert log == ["recompute"]  # the engine was never paused, the later hook never ran
    assert not engine.is_paused


def test_failing_post_pause_hook_resumes_before_raising():
    log, engine, ctl = setup()
    ctl.hooks.register_post_pause_hook(failing(log, "post"))
    ctl.hooks.register_pre_resume_hook(logger(log, "pre_resume"))
    with pytest.raises(HookError, match="post_pause hook post failed"):
        ctl.pause()
    assert log == ["engine.pause", "post", "engine.resume"]
    assert not engine.is_paused


def test_failing_engine_pause_is_followed_by_resume():
    log, engine, ctl = setup(fail_pause=True)
    with pytest.raises(RuntimeError, match="server gone"):
        ctl.pause()
    assert log == ["engine.pause", "engine.resume"]


def test_failing_pre_resume_hook_still_resumes_the_engine():
    log, engine, ctl = setup()
    ctl.hooks.register_pre_resume_hook(failing(log, "pre"))
    ctl.hooks.register_post_resume_hook(logger(log, "post"))
    ctl.pause()
    with pytest.raises(HookError, match="pre_resume hook pre failed"):
        ctl.resume()
    assert log == ["engine.pause", "pre", "engine.resume"]
    assert not engine.is_paused


def test_failing_post_resume_hook_is_reported_after_the_engine_resumed():
    log, engine, ctl = setup()
    ctl.hooks.register_post_resume_hook(failing(log, "post"))
    ctl.pause()
    with pytest.raises(HookError, match="post_resume"):
        ctl.resume()
    assert not engine.is_paused


def test_paused_context_always_resumes():
    log, engine, ctl = setup()
    with pytest.raises(KeyError):
        with ctl.paused():
            assert engine.is_paused
            raise KeyError("body failed")
    assert log == ["engine.pause", "engine.resume"] and not engine.is_paused


def test_hook_names_and_registration_errors():
    hooks = PauseHooks()

    class Recompute:
        def __call__(self):
            raise OSError("disk")

    hooks.register_pre_pause_hook(Recompute())
    with pytest.raises(HookError, match="pre_pause hook .*Recompute failed: OSError: disk"):
        hooks.run("pre_pause")
    with pytest.raises(ValueError, match="unknown hook phase"):
        hooks.register("during", lambda: None)
    with pytest.raises(TypeError):
        hooks.register_post_pause_hook(42)


@pytest.mark.parametrize("phase", ["pre_pause", "post_pause", "pre_resume", "post_resume"])
def test_a_hook_registered_without_wrapping_raises_its_own_exception(phase):
    log, engine, ctl = setup()
    getattr(ctl.hooks, f"register_{phase}_hook")(failing(log, phase), wrap_errors=False)
    getattr(ctl.hooks, f"register_{phase}_hook")(logger(log, "later"))
    if phase in ("pre_resume", "post_resume"):
        ctl.pause()
    with pytest.raises(ValueError, match="boom"):  # not HookError: callers catch it by type
        ctl.resume() if phase.endswith("resume") else ctl.pause()
    assert "later" not in log  # the first failure still stops the phase
    assert not engine.is_paused  # and the engine is still never left paused
