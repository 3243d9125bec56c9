"""``kvreuse scenarios``: the named simulator scenarios, one line each."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from kvreuse.cli.tables import make_console
from kvreuse.sim.scenarios import SCENARIOS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "scenarios", help="list the fleet simulator's named scenarios"
    )
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="also list each scenario's parameters"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = make_console()
    table = Table(title="kvreuse simulate --scenario NAME")
    table.add_column("scenario", style="bold")
    table.add_column("compares")
    table.add_column("runs", justify="right")
    for scenario in SCENARIOS.values():
        table.add_row(scenario.name, scenario.summary, str(len(scenario.runs)))
    console.print(table)
    if args.verbose:
        for scenario in SCENARIOS.values():
            console.print(f"\n[bold]{scenario.name}[/bold]")
            for param in scenario.params:
                console.print(f"  {param.name} = {param.value}  [dim]{param.source}[/dim]")
    return 0
