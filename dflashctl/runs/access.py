"""How the run modules reach a run's hosts: its transport, its tmux server, one probe.

Every step on a run's hosts goes through these, so they also hold what those steps
share: ``Progress`` (how a step is said), ``quiet`` (saying nothing), ``LaunchError``
(the run could not be started, read or evaluated) and the interval between looks.
A multi-host run is reached one process at a time (``Run.parts``), rank 0 first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dflashctl.core import contract
from dflashctl.core.errors import DflashError, TransportError
from dflashctl.hosts.tmux import Tmux, socket_name
from dflashctl.store import Run

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory
    from dflashctl.hosts.probe import ProbeResult
    from dflashctl.hosts.transport import Transport

POLL_SECONDS = 1.0  # between two looks at a run's host

Progress = Callable[[str, str], None]


def quiet(step: str, message: str) -> None:
    """The default ``Progress``: says nothing."""


class LaunchError(DflashError):
    """The run could not be started (nothing was left running)."""


class NotEveryHost(LaunchError):
    """Done on the hosts of the run that answer, not on the others (exit 3: partial)."""

    exit_code = 3


def host_transport(host_name: str, inventory: "Inventory") -> "Transport":
    """The run host's transport (jump hosts, container wrapper), connected."""
    from dflashctl.hosts.transport import connect

    return connect(host_name, inventory)


def local_host() -> "Host":
    """This machine, where supervisor sessions run."""
    from dflashctl.config import Host

    return Host(name="local", transport="local")


def probe_run(transport: "Transport", run: Run, *, offset: int = 0, inode: int | None = None,
              timeout: float | None = None) -> "ProbeResult":
    """One probe round trip for one run (no nvidia-smi)."""
    from dflashctl.hosts.probe import ProbeArgs, ProbeError, parse_probe_host, probe_command
    from dflashctl.hosts.transport import limits

    args = ProbeArgs(run_dir=run.run_dir, session=run.tmux_session, socket=run.tmux_socket or socket_name(),
                     metrics_offset=offset, metrics_inode=inode, nvidia_smi=False, pane_lines=40, rank=run.rank)
    result = transport.run(probe_command(transport.host.python, [args]), timeout=timeout or 30,
                           limit=limits.probe([args]))
    host = parse_probe_host(result.stdout)
    if isinstance(host, ProbeError):
        raise TransportError(transport.host.name, "probe", host.message, stderr_tail=host.output_tail)
    return host.runs[0]


def _started(probe: "ProbeResult") -> bool:
    return probe.status is not None and probe.status.phase in contract.PHASES


def _ended(probe: "ProbeResult") -> bool:
    return probe.exit_code is not None or probe.session_alive is False


def part_tmux(part: Run, inventory: "Inventory") -> Tmux:
    """The tmux server of a run's process on its host (``Run.parts``)."""
    return Tmux(inventory.get(part.host), inventory, part.tmux_socket or socket_name())


def _on_hosts(run: Run, inventory: "Inventory") -> list[tuple[Run, "Transport", Tmux]]:
    """(part, its host's transport, its tmux) for every process of the run, rank 0 first."""
    return [(p, host_transport(p.host, inventory), part_tmux(p, inventory)) for p in run.parts()]
