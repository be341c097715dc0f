"""What callers use: the pooled transport for a host, its host key, fan-out.

Every entry point goes through ``default_pool``, so each host has one
connection however many callers ask for it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Union

from dflashctl.core.errors import TransportError
from dflashctl.hosts.transport.base import Transport
from dflashctl.hosts.transport.hostkeys import HostKey
from dflashctl.hosts.transport.ssh import SSHTransport, default_pool

if TYPE_CHECKING:
    from dflashctl.config import Host, Inventory


def connect(host_or_name: Union["Host", str], inventory: "Inventory") -> Transport:
    """The pooled transport for a host (connections open lazily, on first run)."""
    return default_pool.get(host_or_name, inventory)


def host_key(host_or_name: Union["Host", str], inventory: "Inventory") -> HostKey:
    """The SSH host key a host presents, fetched through its route (its jump hosts
    must be trusted already: trust a route outermost hop first), with its status."""
    transport = connect(host_or_name, inventory)
    if not isinstance(transport, SSHTransport):
        raise TransportError(transport.name, "trust", "a local host is reached without SSH: it has no host key")
    return transport.host_key()


def fanout(
    transports_or_names: Iterable[Union[Transport, str]],
    fn: Callable[[Transport], Any],
    max_workers: int | None = None,
    inventory: "Inventory | None" = None,
) -> dict[str, Any]:
    """Call ``fn(transport)`` for every host at once: {name: return value or the
    Exception it raised}. Names need ``inventory``. A failing host is a value in
    the answer, never an exception that loses the others."""
    items = list(transports_or_names)
    if not items:
        return {}

    def one(item: Union[Transport, str]) -> Any:
        try:
            transport = item if isinstance(item, Transport) else connect(item, _need(inventory))
            return fn(transport)
        except Exception as e:  # noqa: BLE001  (a dead host is a finding, not a crash)
            return e

    names = [item.name if isinstance(item, Transport) else item for item in items]
    with ThreadPoolExecutor(max_workers or min(32, len(items)), thread_name_prefix="fanout") as ex:
        return dict(zip(names, ex.map(one, items)))


def _need(inventory: "Inventory | None") -> "Inventory":
    if inventory is None:
        raise ValueError("fanout over host names needs inventory=")
    return inventory
