"""`dflashctl advise RUN`: the target:drafter GPU split a run's measurements call for
(``dflashctl.supervise.placement``). Reads the run's metrics on its host; never changes a run."""

from __future__ import annotations

import json
from typing import Optional

import typer

from dflashctl.commands._app import G, app, out, printable


@app.command("advise")
def advise_command(
    run: str = typer.Argument(..., help="Run id (or an unambiguous prefix) of a calibration or running run."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=2, help="GPUs to split (default: the run's count)."),
    lines: int = typer.Option(50, "--lines", min=1, help="Newest metrics lines to take the medians of."),
    as_json: bool = typer.Option(False, "--json", help="Print the advice as JSON."),
) -> None:
    """Say where a host's GPUs should run the target and the drafter.

    From the run's newest metrics lines: how many sequence tokens per second one
    target GPU makes when always busy, and one drafter GPU takes when it never
    waits; what every GPU running both (shared) and the best split would make, and
    whether a target and a drafter fit one GPU's memory (rule in
    dflashctl/supervise/placement.py). Run a short calibration (a few log intervals of
    training), then advise on it."""
    from dflashctl.config import load_inventory
    from dflashctl.core.errors import ConfigError
    from dflashctl.core.paths import store_path
    from dflashctl.runs.logs import metrics_tail
    from dflashctl.store import Store
    from dflashctl.supervise.placement import PlacementError, advise

    store = Store(store_path())
    record = store.get_run(run)
    try:
        advice = advise(metrics_tail(record.id, store, load_inventory(G.inventory), lines), gpus)
    except PlacementError as e:
        raise ConfigError(f"no advice for {record.id}: {e}") from None
    if as_json:
        print(json.dumps(advice.to_dict(), indent=2))
        return
    head = (f"share all {advice.total} GPUs (a target and a drafter on each)" if advice.mode == "shared"
            else f"{advice.targets} target + {advice.drafters} drafter GPUs")
    out.print(printable(f"{record.id}: {head}"), markup=False)
    out.print(printable(f"playbook trainer placement: target {advice.placement['target']}, "
                        f"drafter {advice.placement['drafter']}"), markup=False)
    out.print(printable(advice.reason), markup=False, soft_wrap=True)
