"""The run: setup, start, resume checks, recovery, session end, checkpoints, reporting and
trackers. It drives the ``asyncloop`` and ``step`` wings below it."""
