"""``nodepoolctl watch nodes``: poll the node list and redraw it in place (Ctrl-C stops)."""

from __future__ import annotations

import time

import click
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .render import natural_width, table


@click.group()
def watch():
    """Watch objects change (polling, redrawn in place)."""


@watch.command("nodes")
@click.option("-l", "--selector", default=None, help="Label selector, as `get nodes -l`.")
@click.option("--pool", default=None)
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True, help="Seconds.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Stop after this many refreshes.")
@click.option("-o", "--output", type=click.Choice(["wide"]), default=None)
@click.pass_obj
def watch_nodes(obj, selector, pool, interval, count, output):
    """The node list, refreshed every --interval seconds."""
    console = Console(highlight=False)
    refreshes = 0

    def frame():
        nodes = obj.api.list("/nodes", pool=pool, label=selector)
        if pool and not nodes:
            obj.api.get(f"/pools/{pool}")  # an unknown pool is an error (404, rc 1), not an empty list forever
        stamp = Text(f"{time.strftime('%H:%M:%S')}  {len(nodes)} node(s), every {interval:g}s", style="dim")
        view = Group(stamp, table("node", nodes, wide=output == "wide"))
        if not console.is_terminal:
            # A pipe or a file gets whole cells, as `get` prints them; a terminal's redrawn frame
            # must fit its width, so there a long cell is cut short with an ellipsis (never folded).
            console.width = max(console.width, natural_width(console, view))
        return view

    try:
        with Live(frame(), console=console, auto_refresh=False) as live:
            refreshes = 1
            while count is None or refreshes < count:
                time.sleep(interval)
                live.update(frame(), refresh=True)
                refreshes += 1
    except KeyboardInterrupt:
        pass
