"""`sdp ablate`: plan and run a staleness × mode sweep (``sweep``, ``app``), then aggregate it
(``report``, ``plots``). Orchestration of many ``sdp train`` runs, kept apart from the analysis
of one batch or one run (``sdp_cli.analysis``)."""
