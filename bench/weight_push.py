"""What a weight push to the local engine's process costs the trainer's thread, and the file write.

Every step of a run on the local engine's process writes the trainer's weights as a safetensors
file on tmpfs, which the engine's process loads (``sdp_cli/engine/weight_file.py``). From sdp's
process, with the rollout side in its own (docs/training.md "Three processes"), the trainer's
thread packs them straight into a mapped slot file (``WeightSlots``); a ``ProcessEngine`` given
a state dict packs them into a buffer and writes that. This bench times the parts on a model's
state dict, one torch thread as the trainer has at η > 0:

  pack, fresh    ``PackedWeights`` into a newly allocated buffer (every page faulted in again);
  pack, reused   into the buffer of the previous push (``spare=``, what ``ProcessEngine`` does);
  write          that buffer's file to tmpfs (``/dev/shm`` when writable), removed after each write;
  slot           ``WeightSlots.write`` into a slot written before (its mapping kept): the whole
                 push of the trainer's thread in a run with a rollout process.

Shapes: the tiny model of ``sdp train``'s default, and SmolLM2-135M's (its config, random weights:
the real small model this project runs on a CPU). Each is packed as float32 (a float32 engine)
and as bfloat16 (``engine.dtype=bfloat16``). The parts alternate within each repeat; medians.
Prints a table, writes bench/results/weight_push.json with the load average before and after.

    python bench/weight_push.py                       # both shapes, 7 repeats
    python bench/weight_push.py --shapes tiny --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _results import write_results

from sdp_cli.processes import scratch_root
from sdp_cli.engine.weight_file import PackedWeights, WeightSlots

#: SmolLM2-135M-Instruct's shape (its config.json): a Llama of 30 layers, 576 wide, tied embeddings
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
)  # fmt: skip


def state_dict(shape: str) -> dict[str, torch.Tensor]:
    """The float32 weights of a model of ``shape``, randomly initialised."""
    if shape == "tiny":
        from sdp_cli.models.tiny import build_tiny_model

        model = build_tiny_model(64)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(
    weights: dict[str, torch.Tensor], dtype: torch.dtype, repeats: int, scratch: Path
) -> tuple[dict[str, list[float]], int]:
    """Seconds of each part, ``repeats`` times, the parts alternating (after one warm-up round);
    and the pack's size in bytes."""
    times: dict[str, list[float]] = {"pack_fresh": [], "pack_reused": [], "write": [], "slot": []}
    spare = PackedWeights(weights, dtype).release()
    path = scratch / "model.safetensors"
    slots = WeightSlots(scratch / "slots", "model.safetensors")
    try:
        for i in range(repeats + 1):
            fresh = timed(lambda: PackedWeights(weights, dtype))
            packed: list[PackedWeights] = []
            reused = timed(lambda: packed.append(PackedWeights(weights, dtype, spare=spare)))
            write = timed(lambda: packed[0].write(path))
            path.unlink()
            spare = packed[0].release()
            slots.write(0, weights, dtype)  # the slot as a run finds it: written three pushes before
            slot = timed(lambda: slots.write(WeightSlots.SLOTS, weights, dtype))
            if i:  # the first round warms the allocator and the page cache
                times["pack_fresh"].append(fresh)
                times["pack_reused"].append(reused)
                times["write"].append(write)
                times["slot"].append(slot)
    finally:
        slots.close()
    return times, spare.numel()  # the first pack's buffer, made to measure and reused since


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,smollm2-135m", help="comma-separated: tiny, smollm2-135m")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "weight_push.json")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - {"tiny", "smollm2-135m"})
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; choose from tiny, smollm2-135m")
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)  # the trainer's share at η > 0 on 2 cores
    rows = []
    print(f"{'shape':<14} {'dtype':<9} {'MB':>7} {'pack fresh ms':>14} {'pack reused ms':>15} {'write ms':>9} {'slot ms':>8}")
    with tempfile.TemporaryDirectory(prefix="sdp-bench-push-", dir=scratch_root()) as scratch:
        for shape in shapes:
            weights = state_dict(shape)
            for dtype in (torch.float32, torch.bfloat16):
                times, size = measure(weights, dtype, args.repeats, Path(scratch))
                medians = {part: 1000 * statistics.median(values) for part, values in times.items()}
                rows.append({
                    "shape": shape, "dtype": str(dtype).removeprefix("torch."), "parameters": sum(t.numel() for t in weights.values()),
                    "bytes": size, **{f"{part}_ms_median": ms for part, ms in medians.items()},
                    **{f"{part}_ms_all": [1000 * s for s in values] for part, values in times.items()},
                })  # fmt: skip
                print(
                    f"{shape:<14} {rows[-1]['dtype']:<9} {size / 1e6:7.1f} {medians['pack_fresh']:14.2f} "
                    f"{medians['pack_reused']:15.2f} {medians['write']:9.2f} {medians['slot']:8.2f}"
                )
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; tmpfs: {scratch_root()}")
    write_results(
        args.out, "weight_push", repeats=args.repeats, torch_threads=1, scratch=str(scratch_root()),
        load_average_before=load_before, load_average_after=load_after, rows=rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
