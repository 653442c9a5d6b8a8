"""The async loop: trainer and producer threads, loop state, rewards, the group ledger and
multi-process coordination. Of ``sdp_cli.train`` it imports only ``step``."""
