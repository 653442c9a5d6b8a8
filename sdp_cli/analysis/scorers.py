"""Scoring backends of ``sdp recompute``: score token sequences under one version checkpoint at a
time, with the embedded engine (``LocalScorer``) or any engine that loads weights from disk, such
as a running vLLM or SGLang server (``EngineScorer``). The planning and bookkeeping live in
``sdp_cli.analysis.recompute``."""

from __future__ import annotations

import abc
import math
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdp_cli.choices import REMOTE_ENGINE_KINDS
from sdp_cli.errors import UserError
from sdp_cli.server_url import server_url_problem

if TYPE_CHECKING:
    from sdp_cli.engine.base import InferenceEngine

DEVICE_FIX = "use auto, cpu, cuda or cuda:N"


def resolve_device(text: str) -> str:
    """The torch device of ``--device``: ``auto`` is cuda when available, else cpu; a CUDA
    device must exist on this machine; other device types are refused. One-line UserErrors."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"--device {text!r} is not a device; {DEVICE_FIX}") from None
    if device.type == "cpu":
        return str(device)
    if device.type != "cuda":
        raise UserError(f"--device {text!r} is not supported; {DEVICE_FIX}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {text}: CUDA is not available on this machine; use --device cpu (or auto)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UserError(
            f"--device {text}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}); pick one of them"
        )
    return str(device)


def check_server_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and a valid port, else a one-line UserError
    (before any connection attempt, so a typo costs no retries)."""
    problem = server_url_problem(url)
    if problem is not None:
        raise UserError(f"--server {url!r} is not a server URL ({problem}); pass e.g. --server http://127.0.0.1:8000")
    return url


def load_version_policy(path: Path, device: str = "cpu") -> Any:
    """The policy of a version checkpoint, in the dtype it was saved in (the one the engine ran):
    a whole model, or LoRA adapters merged onto the run's base, ``versions/base``
    (sdp_cli/train/session/policy_setup.py)."""
    from sdp_cli.models.loader import load_policy
    from sdp_cli.models.lora import is_adapter_dir, load_merged
    from sdp_cli.rundir import VERSION_BASE

    if not is_adapter_dir(path):
        return load_policy("hf", path=path, device=device, dtype="auto")
    base = Path(path).parent / VERSION_BASE
    if not (base / "config.json").is_file():
        raise UserError(
            f"{path} holds LoRA adapters but their base model {base} is missing; "
            "pass the run's whole versions/ directory"
        )
    policy = load_policy("hf", path=base, device=device, dtype="auto")
    policy.model = load_merged(policy.model, path).to(device)
    return policy


class Scorer(abc.ABC):
    """Scores token sequences under one version checkpoint at a time."""

    #: what the scorer is, for reports ("local engine (cpu)")
    description: str

    @abc.abstractmethod
    def load(self, version: int, path: Path) -> None:
        """Make the checkpoint of ``version`` (a Hugging Face directory) the one scored under."""

    @abc.abstractmethod
    def score(
        self, temperature: float, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        """``InferenceEngine.score`` at ``temperature`` under the loaded checkpoint."""

    def unload(self) -> None:
        """Release the loaded checkpoint."""

    def close(self) -> None:
        """Release everything."""

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalScorer(Scorer):
    """The embedded engine (``LocalEngine.score``) over each checkpoint loaded in turn, in the
    dtype it was saved in: the dtype the run's engine ran (docs/recompute.md "Noise floor")."""

    def __init__(self, device: str = "cpu", max_batch_size: int = 64):
        self.device = device
        self.max_batch_size = max_batch_size
        #: the dtypes the loaded checkpoints were scored in
        self.scored_dtypes: set[str] = set()
        self._policy: Any = None
        self._engines: dict[float, Any] = {}
        self._path: Path | None = None

    def load(self, version: int, path: Path) -> None:
        self.unload()
        self._policy = load_version_policy(path, self.device)
        self._path = path
        self.scored_dtypes.add(str(self._policy.model.dtype).removeprefix("torch."))

    @property
    def description(self) -> str:  # type: ignore[override]
        dtypes = ", ".join(sorted(self.scored_dtypes)) or "as saved"
        return f"local engine ({self.device}, {dtypes})"

    def _engine(self, temperature: float) -> Any:
        from sdp_cli.engine.local import LocalEngine

        assert self._policy is not None, "load() a checkpoint before scoring"
        if temperature not in self._engines:
            self._engines[temperature] = LocalEngine(
                self._policy.model,
                temperature=temperature,
                eos_token_id=self._policy.eos_token_id,
                pad_token_id=self._policy.pad_token_id,
                max_batch_size=self.max_batch_size,
                device=self.device,
            )
        return self._engines[temperature]

    def score(
        self, temperature: float, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        engine = self._engine(temperature)
        vocab = engine.vocab_size
        bad = next((t for s in sequences for t in s if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(
                f"a batch holds token id {bad}, outside the vocabulary [0, {vocab}) of the checkpoint "
                f"{self._path}; pass the checkpoints of the run that wrote the batch"
            )
        return engine.score(sequences, starts)

    def unload(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self._policy = None
        self._path = None

    def close(self) -> None:
        self.unload()


class EngineScorer(Scorer):
    """Any ``InferenceEngine`` that loads weights from disk (vLLM, SGLang, or the local
    engine): paused once, then ``update_weights(path)`` per version and ``score``. The engine
    scores at its own temperature only. LoRA adapter checkpoints are merged onto their base
    into a temporary directory first (engines load whole models)."""

    def __init__(self, engine: InferenceEngine, description: str):
        self.engine = engine
        self.description = description
        self._merged: Path | None = None
        engine.pause()

    def load(self, version: int, path: Path) -> None:
        from sdp_cli.engine.base import WeightUpdate
        from sdp_cli.models.loader import save_policy
        from sdp_cli.models.lora import is_adapter_dir

        self._drop_merged()
        if is_adapter_dir(path):
            self._merged = Path(tempfile.mkdtemp(prefix="sdp-merged-"))
            path = save_policy(load_version_policy(path), self._merged / f"v{version:06d}")
        self.engine.update_weights(WeightUpdate(version=version, path=Path(path).resolve()))

    def _drop_merged(self) -> None:
        if self._merged is not None:
            shutil.rmtree(self._merged, ignore_errors=True)
            self._merged = None

    def score(
        self, temperature: float, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        if not math.isclose(temperature, self.engine.temperature, rel_tol=0, abs_tol=1e-12):
            raise UserError(
                f"{self.description} scores at temperature {self.engine.temperature} but a batch was "
                f"sampled at {temperature}; recompute batches of other temperatures in a separate call"
            )
        return self.engine.score(sequences, starts)

    def close(self) -> None:
        self._drop_merged()
        self.engine.close()


def connect_remote(kind: str, urls: Sequence[str], temperatures: Iterable[float]) -> EngineScorer:
    """An ``EngineScorer`` over running vLLM or SGLang servers. The servers' weights are
    replaced by each checkpoint in turn: use servers dedicated to this recompute."""
    from sdp_cli.engine.remote import RemoteOptions

    if kind not in REMOTE_ENGINE_KINDS:
        raise UserError(f"--engine {kind!r} is not a server engine; use {' or '.join(REMOTE_ENGINE_KINDS)}")
    for url in urls:
        check_server_url(url)
    other = sorted({t for t in temperatures if t != 1.0})
    if other:
        # neither server temperature-scales prefill logprobs (docs/engines.md)
        raise UserError(
            f"a batch was sampled at temperature {other[0]}, but {kind} servers score at temperature 1 only; "
            "recompute it with --engine local"
        )
    from sdp_cli.engine.base import EngineUnavailable

    options = RemoteOptions(temperature=1.0)
    try:
        if kind == "vllm":
            from sdp_cli.engine.vllm import VLLMEngine

            engine: InferenceEngine = VLLMEngine(list(urls), options)
        else:
            from sdp_cli.engine.sglang import SGLangEngine

            engine = SGLangEngine(list(urls), options)
    except EngineUnavailable as err:
        # the engine's own fix names config keys of `sdp train`; keep the problem, give ours
        problem = str(err).split("; ")[0]
        raise UserError(f"{problem}; start the server (see docs/engines.md) or fix --server") from None
    try:
        return EngineScorer(engine, f"{kind} at {', '.join(urls)}")
    except BaseException:
        engine.close()
        raise
