"""``tiered-cache`` command line: the node agent and the admin commands.

Errors are one line on stderr with a non-zero exit code, never a traceback. This module
holds the ``main`` group; the commands live in its submodules.
"""

from __future__ import annotations

import logging

import click

from tiered_cache.cli.events import events
from tiered_cache.cli.ops import evict, flush, ls_cmd, models_cmd, nodes, stats
from tiered_cache.cli.pins import pin
from tiered_cache.cli.plan import plan
from tiered_cache.cli.services import agent, dashboard, router, simulate

__all__ = ["main"]

# Long-running commands log at INFO; admin commands only print their result or a one-line
# error (library warnings, e.g. "Redis unavailable", would add lines), unless -v.
_SERVICES = ("agent", "router", "dashboard", "simulate")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """tiered-cache: a tiered KV cache (DRAM -> NVMe -> S3) for vLLM."""
    quiet = ctx.invoked_subcommand not in _SERVICES
    logging.basicConfig(
        level=logging.DEBUG if verbose else (logging.CRITICAL if quiet else logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


for _cmd in (
    agent,
    pin,
    models_cmd,
    ls_cmd,
    evict,
    flush,
    nodes,
    stats,
    dashboard,
    router,
    simulate,
    events,
    plan,
):
    main.add_command(_cmd)
