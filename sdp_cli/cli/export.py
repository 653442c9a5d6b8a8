"""`sdp export`: write a run's trained policy as a plain Hugging Face model directory. Parsing
and reporting only; ``sdp_cli.train.session.saved_policy`` finds and loads the policy,
``sdp_cli.models.export`` writes it."""

from __future__ import annotations

from pathlib import Path

import typer

from sdp_cli.errors import UserError

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

HELP = """Write a run's trained policy as a plain Hugging Face model directory (config.json, safetensors weights, tokenizer) that transformers' AutoModelForCausalLM and vLLM load.

SOURCE is a run directory (its newest complete checkpoint is exported), one of its checkpoints/step-NNNNNN, or one of its versions/vNNNNNN (train.keep_version_checkpoints=true). LoRA adapters are merged into their base: versions/base when the run kept it, else the base the run's config names, loaded as a resume loads it. OUT must not exist or be empty; it is written in a temporary sibling and renamed into place. See docs/real-models.md.

[bold]Examples[/bold]

  sdp export runs/my-run exported/my-model

  sdp export runs/my-run/checkpoints/step-000040 exported/step-40 --dtype bfloat16

  sdp export runs/my-run/versions/v000012 exported/v12
"""


@app.command("export", help=HELP)
def export_command(
    source: Path = typer.Argument(
        ..., metavar="SOURCE", help="A run directory, a checkpoint or a version directory of it.", show_default=False
    ),
    out: Path = typer.Argument(..., metavar="OUT", help="The new model directory.", show_default=False),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        metavar="|".join(DTYPE_CHOICES),
        help="Weight dtype of the export; auto keeps the saved one (float32 master weights, or a LoRA base's dtype).",
    ),
) -> None:
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}")
    from sdp_cli.models.export import check_export_target, export_policy
    from sdp_cli.models.precision import DTYPES
    from sdp_cli.train.session.saved_policy import find_saved_policy, held, load_saved_policy

    target = check_export_target(out)  # before any loading: a refused OUT costs nothing
    saved = find_saved_policy(source)
    with held(saved, near=target.parent) as loaded:  # a live run may prune the checkpoint meanwhile
        policy = load_saved_policy(loaded)
    target = export_policy(policy, target, dtype=DTYPES.get(dtype))
    count = sum(p.numel() for p in policy.model.parameters())
    written = next(p.dtype for p in policy.model.parameters()) if dtype == "auto" else DTYPES[dtype]
    typer.echo(
        f"exported {loaded.name} of {loaded.run.path} ({count / 1e6:.1f} M parameters, "
        f"{str(written).removeprefix('torch.')}) to {target}"
    )
