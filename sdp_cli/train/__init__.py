"""Training, in three wings; each imports only the wings below it (docs/design.md §7):
``step`` (the PPO step), ``asyncloop`` (the async loop) and ``session`` (the run)."""
