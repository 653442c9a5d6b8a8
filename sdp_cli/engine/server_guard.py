"""Runs a server that sdp launched (vLLM, SGLang) and ends it when sdp is gone.

``servers.ManagedServer`` starts ``python -I server_guard.py --parent-pid P --scratch DIR --
COMMAND...`` as the leader of a session of its own; this process starts COMMAND in that session
and waits for it. Such a server knows nothing of sdp, so without this a kill -9 of sdp (or the
out-of-memory killer) would leave it running, holding its port and its memory. Here:

- once sdp is gone (this process is re-parented), the session gets SIGTERM, and SIGKILL after
  ``--grace-s`` if the server is still there;
- SIGTERM or SIGINT sent to this process alone is passed on to the server (sdp's ``stop`` signals
  the whole session, which includes the server);
- DIR, the server's temporary directory, is removed once the server has ended;
- this process leaves with the server's exit status (the same signal if a signal ended it), so
  sdp reads the server's own status.

Run by path with sdp's interpreter, so it imports only the standard library.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

POLL_S = 0.5


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="run a server and stop it when sdp is gone")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--grace-s", type=float, default=20.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")

    try:
        server = subprocess.Popen(command)
    except OSError as exc:
        print(f"cannot start {command[0]}: {exc.strerror}", flush=True)
        shutil.rmtree(args.scratch, ignore_errors=True)
        sys.exit(127)

    def pass_on(signum: int, _frame: object) -> None:
        if server.poll() is None:
            server.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)

    while True:
        try:
            server.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != args.parent_pid:
            stop_session(server, args.scratch, args.grace_s)
            break

    shutil.rmtree(args.scratch, ignore_errors=True)
    code = server.returncode
    if code is not None and code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code is not None else 1)


def stop_session(server: subprocess.Popen, scratch: str, grace_s: float) -> None:
    """SIGTERM to the session (the server's workers too), SIGKILL after ``grace_s``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # this process stays to wait
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    shutil.rmtree(scratch, ignore_errors=True)  # SIGKILL below ends this process too
    os.killpg(group, signal.SIGKILL)


if __name__ == "__main__":
    main()
