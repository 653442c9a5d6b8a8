"""Read back what each experiment tracker stored, offline, for the tracker tests: TensorBoard
event files, a W&B offline run file, an MLflow file store."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

#: W&B's run file is a LevelDB-style log: a 7-byte file header (":W&B", magic, version), then
#: 32 KiB blocks of records, each with a 7-byte header (crc32, length, type); a protobuf
#: ``Record`` may span several records (types FIRST=2, MIDDLE=3, LAST=4; FULL=1 is whole)
_WANDB_BLOCK = 32 * 1024
_WANDB_HEADER = struct.Struct("<4sHB")
_WANDB_RECORD = struct.Struct("<IHB")


def wandb_records(path: Path) -> list[Any]:
    """Every protobuf Record of a W&B ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _, _ = _WANDB_HEADER.unpack_from(data)
    assert ident == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", _WANDB_HEADER.size
    while pos + _WANDB_RECORD.size <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < _WANDB_RECORD.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = _WANDB_RECORD.unpack_from(data, pos)
        pos += _WANDB_RECORD.size
        if length == 0 and kind == 0:
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_offline(run_root: Path) -> tuple[dict[int, dict[str, float]], dict[str, Any], list[str]]:
    """(step → scalars, config, run ids) of every offline W&B run under ``run_root/wandb``."""
    history: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    ids = []
    for path in sorted(run_root.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "_step" in items:
                    step = int(items["_step"])
                    history.setdefault(step, {}).update(
                        {k: v for k, v in items.items() if not k.startswith("_")}
                    )
    return history, config, ids


def tensorboard_scalars(directory: Path) -> tuple[dict[int, dict[str, float]], str]:
    """(step → scalars, the config text) of TensorBoard event files in ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            scalars.setdefault(event.step, {})[tag] = event.value
    texts = [
        event.tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
        if tag.startswith("config")
        for event in acc.Tensors(tag)
    ]
    return scalars, "\n".join(texts)


def mlflow_run(tracking_uri: str, run_name: str) -> tuple[dict[int, dict[str, float]], dict[str, str], str, str]:
    """(step → scalars, params, the config.yaml artifact's text, run id) of the MLflow run
    named ``run_name`` (exactly one) in experiment ``sdp``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("sdp")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, f"expected one MLflow run named {run_name}, found {len(runs)}"
    run = runs[0]
    scalars: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            scalars.setdefault(metric.step, {})[key] = metric.value
    config_path = client.download_artifacts(run.info.run_id, "config.yaml")
    return scalars, dict(run.data.params), Path(config_path).read_text(), run.info.run_id
