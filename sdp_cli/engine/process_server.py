"""The local engine's process: a ``LocalEngine`` behind a small HTTP API on loopback.

``python -m sdp_cli.engine.process_server --model DIR --port P ...`` is what ``engine=local``
starts (``sdp_cli/engine/process.py``, docs/engines.md "The local engine's process"). The
trainer's process speaks to it as to any remote engine (``RemoteEngine``), in batches: one
request carries every segment of a round, and the engine decodes them as one batch.

Routes (JSON; all but ``/health`` need ``Authorization: Bearer $SDP_ENGINE_TOKEN``):

- ``GET /health``: 200 once the model is loaded;
- ``POST /generate`` ``{"requests": [{request_id, input_ids, max_new_tokens, stop_token_ids,
  seed, prefill_from}]}`` → ``{"segments": [{token_ids, logprobs, finish_reason,
  weight_versions, prefill_logprobs, prefill_version}]}``: each request continues its input by
  at most ``max_new_tokens`` tokens; ``finish_reason`` ``abort`` when ``/abort`` ended it.
  With ``prefill_from = k``, input tokens k.. are the sample's tokens of the previous version:
  they are re-prefilled as the engine's own output and get π_prox_t from that forward exactly as
  in sdp's process (docs/design.md §2 step 4), returned as ``prefill_logprobs``;
- ``POST /score`` ``{"sequences", "starts"}`` → ``{"logprobs", "weight_version"}``;
- ``POST /abort`` ``{"request_ids": [...] | null}``: end those requests (null: all) at the next
  token boundary, unfinished;
- ``POST /load_weights`` ``{"path", "label"}``: abort everything, load the safetensors directory
  ``path``, label the weights; ``GET|POST /weight_version``: read or set the label.

Labels: the engine's own version counts loads and relabels; each count maps to the label sdp
gave it, and every token is answered with the label of the version that sampled it. A fresh
process reports ``default``, a label sdp never sets, so a restarted process is recognised and
gets the current weights again (docs/reliability.md "Engine faults").

The process leaves when its parent (sdp) has gone, removing the scratch directory sdp wrote
weights into (a killed sdp cannot).
"""

from __future__ import annotations

import argparse
import gc
import hmac
import json
import os
import re
import shutil
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

#: the label of a fresh process's start-up weights
START_LABEL = "default"
#: the environment variable that holds the token a client must send
TOKEN_ENV = "SDP_ENGINE_TOKEN"


class BadRequest(ValueError):
    """A request this server cannot take (answered with 400 and the message)."""


class EngineService:
    """The routes' work on one ``LocalEngine`` (see the module docstring)."""

    def __init__(self, engine: Any):
        from sdp_cli.engine.base import SamplingParams, WeightUpdate
        from sdp_cli.rollout.records import RolloutSample

        self._sampling, self._update, self._sample = SamplingParams, WeightUpdate, RolloutSample
        self.engine = engine
        self._lock = threading.Lock()
        # Versions start at 1, so that re-prefilled tokens can be tagged version − 1 >= 0.
        engine.set_version(1)
        self._labels = {1: START_LABEL}
        self._requests: dict[str, Any] = {}  # request id → its sample, while its batch runs
        self._aborted: set[str] = set()

    # ------------------------------------------------------------------ labels
    def label(self) -> str:
        with self._lock:
            return self._labels[self.engine.get_version()]

    def set_label(self, label: str) -> None:
        with self._lock:
            version = self.engine.get_version() + 1
            self.engine.set_version(version)
            self._labels[version] = label

    def load_weights(self, path: str, label: str) -> None:
        self.engine.pause()
        try:
            self.abort(None)
            with self._lock:
                version = self.engine.get_version() + 1
                self.engine.update_weights(self._update(version=version, path=Path(path)))
                self._labels[version] = label
        finally:
            self.engine.resume()

    # ------------------------------------------------------------------ work
    def abort(self, request_ids: list[str] | None) -> None:
        with self._lock:
            ids = list(self._requests) if request_ids is None else [r for r in request_ids if r in self._requests]
            self._aborted.update(ids)
            samples = [self._requests[r].sample_id for r in ids]
        self.engine.abort(samples)

    def score(self, sequences: list[list[int]], starts: list[int]) -> dict[str, Any]:
        label = self.label()
        return {"logprobs": self.engine.score(sequences, starts), "weight_version": label}

    def generate(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            version = self.engine.get_version()
            runs = [self._admit(request, version) for request in requests]
        try:
            groups: dict[tuple[tuple[int, ...], int | None], list[tuple[Any, int]]] = {}
            for request, (sample, pre) in zip(requests, runs):
                key = (tuple(request["stop_token_ids"]), request["seed"])
                groups.setdefault(key, []).append((sample, pre + request["max_new_tokens"]))
            # one engine call per sampling setting (in training: one call for the whole batch)
            for (stop, seed), items in groups.items():
                with self._lock:
                    items = [(s, n) for s, n in items if s.meta["request_id"] not in self._aborted]
                if items:
                    params = self._sampling(max_new_tokens=max(n for _, n in items), stop_token_ids=stop, seed=seed)
                    self.engine.generate([s for s, _ in items], params, limits=[n for _, n in items])
        finally:
            with self._lock:
                for request in requests:
                    self._requests.pop(request["request_id"], None)
                    self._aborted.discard(request["request_id"])
        with self._lock:
            return {"segments": [self._segment(sample, pre) for sample, pre in runs]}

    def _admit(self, request: dict[str, Any], version: int) -> tuple[Any, int]:
        """The sample of a request (lock held) and the number of input tokens re-prefilled as its
        output (tagged version − 1, so that the engine's prefill gives their π_prox_t)."""
        ids, k = request["input_ids"], request["prefill_from"]
        k = len(ids) if k is None else k
        sample = self._sample(prompt_ids=list(ids[:k]), meta={"request_id": request["request_id"]})
        if k < len(ids):
            sample.append_tokens(ids[k:], [0.0] * (len(ids) - k), version - 1)
        self._requests[request["request_id"]] = sample
        return sample, len(ids) - k

    def _segment(self, sample: Any, pre: int) -> dict[str, Any]:
        """The answer for one request: its new tokens with their labels, its prefill (lock held)."""
        versions = sample.versions[pre:]
        spans: list[dict[str, Any]] = []
        for t, v in enumerate(versions):
            if spans and spans[-1]["version"] == self._labels[v]:
                spans[-1]["end"] = t + 1
            else:
                spans.append({"version": self._labels[v], "start": t, "end": t + 1})
        prefilled = pre and all(pv == v + 1 for v, pv in zip(sample.versions[:pre], sample.proximal_t_versions[:pre]))
        return {
            "token_ids": sample.output_ids[pre:],
            "logprobs": sample.old_logprobs[pre:],
            "finish_reason": sample.finish_reason or "abort",
            "weight_versions": spans,
            "prefill_logprobs": sample.proximal_logprobs_t[:pre] if prefilled else None,
            "prefill_version": self._labels[sample.proximal_t_versions[0]] if prefilled else None,
        }


def _requests(body: Any) -> list[dict[str, Any]]:
    """The checked ``requests`` of a /generate body."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list):
        raise BadRequest("expected {'requests': [...]}")
    out = []
    for r in body["requests"]:
        if not isinstance(r, dict) or not isinstance(r.get("request_id"), str):
            raise BadRequest(f"a request without a request_id: {str(r)[:80]}")
        ids = r.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest(f"request {r['request_id']}: input_ids is not a list of token ids")
        k = r.get("prefill_from")
        if k is not None and not (isinstance(k, int) and 1 <= k <= len(ids)):
            raise BadRequest(f"request {r['request_id']}: prefill_from {k!r} outside [1, {len(ids)}]")
        n, stop, seed = r.get("max_new_tokens"), r.get("stop_token_ids", []), r.get("seed")
        if not isinstance(n, int) or n < 1 or not isinstance(stop, list) or not (seed is None or isinstance(seed, int)):
            raise BadRequest(f"request {r['request_id']}: bad max_new_tokens, stop_token_ids or seed")
        out.append({
            "request_id": r["request_id"], "input_ids": ids, "max_new_tokens": n,
            "stop_token_ids": [int(t) for t in stop], "seed": seed, "prefill_from": k,
        })  # fmt: skip
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client thread
    # TCP_NODELAY: an answer leaves at once instead of waiting for the client's delayed ACK
    # (Nagle's algorithm held small answers back 40 ms each)
    disable_nagle_algorithm = True
    # a buffered writer: an answer's headers and body leave in one send (http.server flushes it
    # after each request), not two; the two sends were 11 % of the engine's busy time (py-spy,
    # segment-wise at η = 4)
    wbufsize = -1

    @property
    def _owner(self) -> "_Server":
        """The server that made this handler (http.server types it as its base class)."""
        return cast("_Server", self.server)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # one line per request would flood the log

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._answer(HTTPStatus.OK, {"ok": True})
        elif self._authorised():
            if self.path == "/weight_version":
                self._answer(HTTPStatus.OK, {"weight_version": self._owner.service.label()})
            else:
                self._answer(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if not self._authorised():
            return
        service = self._owner.service
        assert service is not None, "requests are served once the model is loaded"
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise BadRequest("expected a JSON object")
            if self.path == "/generate":
                result: Any = service.generate(_requests(body))
            elif self.path == "/score":
                result = service.score(body["sequences"], body["starts"])
            elif self.path == "/abort":
                service.abort(body.get("request_ids"))
                result = {}
            elif self.path == "/load_weights":
                service.load_weights(str(body["path"]), str(body["label"]))
                result = {}
            elif self.path == "/weight_version":
                service.set_label(str(body["label"]))
                result = {}
            else:
                self._answer(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
                return
        except (BadRequest, ValueError, KeyError, TypeError) as exc:
            self._answer(HTTPStatus.BAD_REQUEST, {"error": " ".join(str(exc).split())})
            return
        except Exception as exc:  # an engine failure: the client reports it and retries
            self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
            return
        self._answer(HTTPStatus.OK, result)

    def _authorised(self) -> bool:
        given = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if hmac.compare_digest(given.encode(), self._owner.token.encode()):
            return True
        self._answer(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong token"})
        return False

    def _answer(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restarted process binds the port of the one that died

    def __init__(self, address: tuple[str, int], token: str, service: EngineService | None = None):
        super().__init__(address, _Handler)
        #: set once the model is loaded; requests are served only from then on
        self.service = service
        self.token = token

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that left before its answer (sdp's readiness probe gives up on connections
        # queued while the process imports) is no error of the engine: no traceback in its log.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def leave_with_parent(parent_pid: int, scratch: Path | None) -> None:
    """Exit once the parent has gone (re-parented: ``getppid`` changed), whatever the process's
    other threads are doing, removing the engine's scratch directory first: the parent that
    would have removed it cannot any more (this process for sdp; the rollout process, which
    may have stopped the engine's process already, for sdp's rollout side). Run on a daemon
    thread."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sdp's local engine in its own process (started by sdp train)")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eos", type=int, nargs="+", required=True)
    parser.add_argument("--pad", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn-implementation", default=None)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--scratch", type=Path, default=None)
    args = parser.parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        parser.error(f"${TOKEN_ENV} is empty: the server would take requests from anyone")
    threading.Thread(target=leave_with_parent, args=(args.parent_pid, args.scratch), daemon=True).start()
    # Bind first: the port sdp picked is then ours before the seconds of imports below (until
    # it serves, connections wait in the backlog and sdp's readiness probe waits for /health).
    server = _Server((args.host, args.port), token)

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from sdp_cli.engine.local import LocalEngine
    from sdp_cli.models.precision import DTYPES

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    extra = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True, use_safetensors=True, **extra)
    engine = LocalEngine(
        model,
        temperature=args.temperature,
        eos_token_id=args.eos,
        pad_token_id=args.pad,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        device=args.device,
        dtype=DTYPES[args.dtype],
    )
    server.service = EngineService(engine)
    # the imports and the model live as long as the process: out of the collector's full passes,
    # which walked them with the GIL held between decode steps
    gc.collect()
    gc.freeze()
    print(
        f"sdp local engine: pid {os.getpid()}, {torch.get_num_threads()} thread(s), cores "
        f"{','.join(map(str, sorted(os.sched_getaffinity(0))))}, model loaded in "
        f"{time.perf_counter() - started:.2f} s, serving on {args.host}:{args.port}, scratch {args.scratch}",
        flush=True,
    )
    server.serve_forever()


def await_launch(argv: list[str] | None = None) -> None:
    """``--await-launch``: the process started ahead of its launch (``process.WarmProcess``). It
    imports what ``main`` serves with (and the model code of ``--model-type``), then reads its
    launch from stdin — one JSON line: ``main``'s arguments, the variables the launch adds (the
    token), its log and its cores — and runs ``main`` on it. End of input: it leaves."""
    parser = argparse.ArgumentParser(description="sdp's local engine, started ahead of its launch")
    parser.add_argument("--await-launch", action="store_true", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--model-type", default=None)
    args = parser.parse_args(argv)
    threading.Thread(target=leave_with_parent, args=(args.parent_pid, args.scratch), daemon=True).start()
    import importlib

    # what main imports, imported while sdp loads the policy
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import sdp_cli.engine.local  # noqa: F401
    import sdp_cli.models.precision  # noqa: F401

    if args.model_type and re.fullmatch(r"[a-z0-9_]+", args.model_type):
        try:  # a hint: transformers imports a model's code on first use, seconds on a small CPU
            importlib.import_module(f"transformers.models.{args.model_type}.modeling_{args.model_type}")
        except ImportError:
            pass
    line = sys.stdin.readline()
    if not line:
        return
    launch = json.loads(line)
    os.environ.update(launch["env"])
    from sdp_cli.fileio import redirect_output
    from sdp_cli.processes import pin_process

    pin_process(launch["cores"])  # every thread, on the launching process's cores
    redirect_output(Path(launch["log"]))
    main(launch["argv"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--await-launch"]:
        await_launch()
    else:
        main()
