"""`sdp ARGV` run in this process through the real entry point, as the CLI tests call it."""

from __future__ import annotations

from sdp_cli.cli.main import main


def run_main(argv, capsys) -> tuple[int | str | None, str, str]:
    """(exit code, stdout, stderr) of `sdp ARGV`; arguments may be paths (they are passed as
    strings) and the exit code is 0 when main returns without raising SystemExit."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err
