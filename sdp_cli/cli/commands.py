"""Imports every command module so that it registers itself on the root app."""

from sdp_cli.cli import train  # noqa: F401
from sdp_cli.cli import recompute  # noqa: F401
from sdp_cli.cli import inspect_weights  # noqa: F401
from sdp_cli.cli import ablate  # noqa: F401
