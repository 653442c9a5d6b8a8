"""Pause/resume hooks around the engine (docs/design.md §2 step 5).

``PauseController.pause()`` runs pre-pause hooks → ``engine.pause()`` → post-pause hooks;
``resume()`` runs pre-resume hooks → ``engine.resume()`` → post-resume hooks. Hooks take no
arguments, run synchronously in registration order, and a failure is raised as ``HookError``
naming the hook and the phase — unless the hook was registered with ``wrap_errors=False``: then
its own exception reaches the caller unchanged, for callers that handle failures by type (the
training loop's recompute pass, ``sdp_cli/train/asyncloop/loop.py``, raises ``EngineError`` like any other
engine call). Whatever fails, the engine is not left paused:

- a pre-pause hook fails: the engine was never paused; later hooks do not run.
- ``engine.pause()`` or a post-pause hook fails: ``engine.resume()`` is called (without the
  resume hooks, so that no further user code can mask the first error), then the error is raised.
- a pre-resume hook fails: ``engine.resume()`` is still called; the post-resume hooks are skipped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

Hook = Callable[[], None]
PHASES = ("pre_pause", "post_pause", "pre_resume", "post_resume")


class PausableEngine(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


class HookError(RuntimeError):
    """A pause/resume hook raised; ``__cause__`` is the original exception."""

    def __init__(self, phase: str, hook_name: str, error: BaseException):
        super().__init__(f"{phase} hook {hook_name} failed: {type(error).__name__}: {error}")
        self.phase = phase
        self.hook_name = hook_name


def hook_name(hook: Hook) -> str:
    """The hook's ``__qualname__`` (its class name for callable objects)."""
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


class PauseHooks:
    """Ordered hook lists for the four phases; registration is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: per phase: (hook, whether its failure is raised as HookError)
        self._hooks: dict[str, list[tuple[Hook, bool]]] = {phase: [] for phase in PHASES}

    def register(self, phase: str, hook: Hook, *, wrap_errors: bool = True) -> None:
        """Add ``hook`` to ``phase``; with ``wrap_errors=False`` its exception is raised as is."""
        if phase not in self._hooks:
            raise ValueError(f"unknown hook phase {phase!r}; use one of {', '.join(PHASES)}")
        if not callable(hook):
            raise TypeError(f"{phase} hook must be callable, got {hook!r}")
        with self._lock:
            self._hooks[phase].append((hook, wrap_errors))

    def register_pre_pause_hook(self, hook: Hook, *, wrap_errors: bool = True) -> None:
        self.register("pre_pause", hook, wrap_errors=wrap_errors)

    def register_post_pause_hook(self, hook: Hook, *, wrap_errors: bool = True) -> None:
        self.register("post_pause", hook, wrap_errors=wrap_errors)

    def register_pre_resume_hook(self, hook: Hook, *, wrap_errors: bool = True) -> None:
        self.register("pre_resume", hook, wrap_errors=wrap_errors)

    def register_post_resume_hook(self, hook: Hook, *, wrap_errors: bool = True) -> None:
        self.register("post_resume", hook, wrap_errors=wrap_errors)

    def hooks(self, phase: str) -> list[Hook]:
        with self._lock:
            return [hook for hook, _ in self._hooks[phase]]

    def run(self, phase: str) -> None:
        """Call the hooks of ``phase`` in order; the first failure raises ``HookError`` (or the
        hook's own exception, for a hook registered with ``wrap_errors=False``)."""
        with self._lock:
            hooks = list(self._hooks[phase])
        for hook, wrap in hooks:
            try:
                hook()
            except Exception as error:
                if not wrap:
                    raise
                raise HookError(phase, hook_name(hook), error) from error


class PauseController:
    """Pauses and resumes ``engine`` with hooks around each transition.

    ``pause``/``resume`` are serialised by a lock; hooks registered while a transition runs
    take effect from the next one.
    """

    def __init__(self, engine: PausableEngine, hooks: PauseHooks | None = None):
        self.engine = engine
        self.hooks = hooks if hooks is not None else PauseHooks()
        self._lock = threading.Lock()

    def pause(self) -> None:
        with self._lock:
            self.hooks.run("pre_pause")
            try:
                self.engine.pause()
                self.hooks.run("post_pause")
            except BaseException as error:
                self._resume_after(error)
                raise

    def _resume_after(self, error: BaseException) -> None:
        try:
            self.engine.resume()
        except Exception as resume_error:
            error.add_note(f"engine.resume() after the failure also failed: {resume_error!r}")

    def resume(self) -> None:
        with self._lock:
            try:
                self.hooks.run("pre_resume")
            except BaseException as error:
                self._resume_after(error)
                raise
            self.engine.resume()
            self.hooks.run("post_resume")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for the ``with`` body and resume afterwards, even if the body raises."""
        self.pause()
        try:
            yield
        finally:
            self.resume()
