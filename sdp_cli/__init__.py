"""sdp: asynchronous RL for language models with segment-wise decoupled PPO."""

__version__ = "0.1.0"
