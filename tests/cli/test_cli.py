"""The CLI layer: help, config printing, one-line errors, no heavy imports on the help path."""

import subprocess
import sys

import pytest

from sdp_cli.cli.main import main

from .run_main import run_main


def test_root_help_lists_train(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert "train" in out


def test_version(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out.startswith("sdp ")


def test_train_help_has_an_example(capsys):
    code, out, _ = run_main(["train", "--help"], capsys)
    assert code == 0
    assert "sdp train +preset=segment_wise" in out


def test_print_config_shows_the_preset(capsys):
    code, out, _ = run_main(["train", "+preset=segment_wise", "rollout.max_head_offpolicyness=8", "--print-config"], capsys)
    assert code == 0
    assert "mode: segment_wise" in out
    assert "max_head_offpolicyness: 8" in out


def test_help_config_lists_keys(capsys):
    code, out, _ = run_main(["train", "--help-config"], capsys)
    assert code == 0
    assert "rollout.max_head_offpolicyness" in out


def test_help_config_says_what_the_opening_of_a_meaning_means(capsys):
    code, out, _ = run_main(["train", "--help-config"], capsys)
    assert code == 0
    tail = " ".join(out.split()[-60:])
    assert "A meaning that opens with tiny:, hf:, LoRA:, local engine:, remote engines:" in tail
    assert "names the runs that read the key; set on the command line for another run, the key is refused." in tail


def test_unknown_key_is_one_line_and_exit_2(capsys):
    code, out, err = run_main(["train", "nope.key=1"], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown config key")
    assert "Traceback" not in err


def test_unknown_command_is_a_usage_error(capsys):
    code, _, err = run_main(["no-such-command"], capsys)
    assert code == 2
    assert "No such command" in err


def test_help_path_imports_no_heavy_libraries():
    # `sdp --help` must stay fast: the CLI modules may not import torch, transformers or httpx.
    code = (
        "import sys; from sdp_cli.cli.main import _register_commands; _register_commands();"
        "heavy = sorted(m for m in ('torch', 'transformers', 'httpx', 'matplotlib', 'safetensors') if m in sys.modules);"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_help_config_keeps_square_brackets(capsys):
    # "[floor, cap]" must not be swallowed as rich markup
    code, out, _ = run_main(["train", "--help-config"], capsys)
    assert code == 0
    assert "(clamp into [floor," in out  # the table may wrap after the comma


@pytest.mark.parametrize("argv, expected", [(["--version"], 0), (["train", "rollout.group_size=0"], 2)])
def test_a_torchrun_process_leaves_without_the_interpreter_teardown(argv, expected, monkeypatch, capsys):
    # In a process of a torchrun job (a process group is up) every exit goes through os._exit
    # after flushing stdio: the teardown could destroy gloo's threads while joinable (SIGABRT,
    # and torchrun reports a finished run as failed). Without a process group, sys.exit.
    import torch.distributed as dist

    class Left(BaseException):
        pass

    codes = []

    def fake_exit(code):
        codes.append(code)
        raise Left

    monkeypatch.setattr("sdp_cli.cli.main.os._exit", fake_exit)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(Left):
        main(argv)
    assert codes == [expected]
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert run_main(argv, capsys)[0] == expected and codes == [expected]


def _import_cut_by_ctrl_c():
    """What transformers' lazy import raises when a Ctrl-C lands inside it."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as cut:
        raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from cut


def test_a_ctrl_c_that_cut_an_import_is_one_line_and_exit_130(monkeypatch, capsys):
    """Any command: the import's own error (with its traceback) was what a user saw."""
    import sdp_cli.cli.main as cli_main

    class CutApp:
        registered_groups = True  # the commands are registered already

        def __call__(self, **_kwargs):
            _import_cut_by_ctrl_c()

    monkeypatch.setattr(cli_main, "app", CutApp())
    code, _, err = run_main(["inspect-weights", "batch.safetensors"], capsys)
    assert (code, err.strip()) == (130, "error: interrupted (SIGINT)")
