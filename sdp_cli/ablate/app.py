"""The Hydra app behind ``sdp ablate``: one job = one ``sdp train`` run of the sweep.

``python -m sdp_cli.ablate.app --multirun +ablate=default hydra.sweep.dir=DIR`` runs a
sweep with Hydra's launcher of choice; ``sdp ablate`` plans, validates and starts exactly this
command (see ``sdp_cli.ablate.sweep``). The composed config is the ordinary sdp run config;
the job itself re-composes it from its overrides, as ``sdp train`` would, so that every run
directory records a complete ``sdp train`` recipe.
"""

from __future__ import annotations

import signal
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from sdp_cli.ablate.sweep import run_job
from sdp_cli.config.compose import ConfigSource
from sdp_cli.config.schema import SdpConfig

ConfigStore.instance().store(name="sdp_schema", node=SdpConfig)


def _source(hydra_cfg: DictConfig) -> ConfigSource:
    """The user's --config-dir/--config-name this app was started with (``SweepPlan.command``)."""
    user = [s.path for s in hydra_cfg.runtime.config_sources if s.provider == "command-line"]
    if not user:
        return ConfigSource()
    return ConfigSource(user[0].removeprefix("file://"), hydra_cfg.job.config_name)


@hydra.main(version_base="1.3", config_path="pkg://sdp_cli.conf", config_name="config")
def main(cfg: DictConfig) -> str:
    """Run the job Hydra composed; the sweep directory is ``hydra.sweep.dir``."""
    hydra_cfg = HydraConfig.get()
    return run_job(Path(hydra_cfg.sweep.dir), list(hydra_cfg.overrides.task), _source(hydra_cfg))


if __name__ == "__main__":
    # `sdp ablate` forwards SIGINT and SIGTERM to this process group: each job stops its run at a
    # step boundary (``run_job``) while this process, the launcher, waits for every job to end
    # (docs/reliability.md, "Signals"). Pool workers inherit the setting until their job starts.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    main()
