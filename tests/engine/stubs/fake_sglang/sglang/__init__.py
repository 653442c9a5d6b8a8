"""A stand-in ``sglang`` package: ``python -m sglang.launch_server`` starts the stub server."""
