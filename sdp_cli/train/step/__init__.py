"""The PPO step: the trainer, its forward and state, the batches it trains on, FSDP sharding.
Imports no other wing of ``sdp_cli.train``."""
