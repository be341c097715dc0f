"""Inventory (where: hosts and how to reach them) and playbooks (what: a run).

Both are YAML validated at load into typed pydantic models. Unknown keys are
errors. A bad file raises ONE ``ConfigError`` whose problems are one line each,
naming the YAML path and the closest valid name, for example

    hosts.gpu1.jump: unknown host 'gatway' (did you mean 'gateway'?)
    expect.stall_windw: unknown key (did you mean 'stall_window'?)

Where files are found (first hit wins):
    explicit argument > DFLASHCTL_INVENTORY / DFLASHCTL_PLAYBOOKS
    > ./inventory.yaml, ./playbooks/ > config_dir() (~/.config/dflashctl/)
    > embedded defaults (an inventory with only the ``local`` host; the ``demo`` playbook).

A host may be described by the user's ssh config instead: ``ssh: ALIAS`` (or
a name the inventory lacks but ``~/.ssh/config`` knows) takes HostName, User,
Port, IdentityFile, ProxyJump, ServerAliveInterval, ConnectTimeout and
UserKnownHostsFile from the files fabric loads (``~/.ssh/config``, then
``/etc/ssh/ssh_config``), once, when the host is read. What the host's own entry
says wins over the ssh config, which wins over ``defaults:``. ProxyJump hops that
the inventory does not name become hosts of their own (``Inventory.route``), so
every hop is a pooled connection whose host key is checked.

A playbook's crash signatures are ``signatures.PlaybookSignature`` models (with
the signature table they extend). This package only reads and validates files
(the inventory, playbooks, the user's ssh config): it never reaches a host or
the store, never imports torch (the trainer section is
checked by ``trainer.config``, torch-free), and never imports controller modules
above it (transport, launch, supervisor): they all depend on it.

Its modules, bottom to top: ``problems`` (errors in the user's terms),
``sshconfig`` (the OpenSSH config), ``fields`` (value types the models share),
``inventory`` and ``playbook`` (the models), ``load`` (YAML, where files are
found, the embedded defaults).
"""

from dflashctl.config.fields import Duration, EnvMap
from dflashctl.config.inventory import EMBEDDED, Host, Inventory, no_control_characters
from dflashctl.config.load import (
    DEFAULT_INVENTORY_YAML,
    DEMO_PLAYBOOK_YAML,
    find_inventory,
    list_playbooks,
    load_inventory,
    load_playbook,
    playbook_dirs,
)
from dflashctl.config.playbook import Alerts, EvalSettings, Expect, Playbook, Rendezvous, RestartPolicy, Retention
from dflashctl.config.sshconfig import (
    SSH_CONFIG_FILES,
    SSH_CONFIG_OPTIONS,
    proxy_jump_hops,
    ssh_config,
    ssh_config_knows,
    ssh_config_lookup,
    ssh_config_origin,
)
from dflashctl.core.units import parse_duration

__all__ = [
    "Alerts",
    "DEFAULT_INVENTORY_YAML",
    "DEMO_PLAYBOOK_YAML",
    "Duration",
    "EMBEDDED",
    "EnvMap",
    "EvalSettings",
    "Expect",
    "Host",
    "Inventory",
    "Playbook",
    "Rendezvous",
    "RestartPolicy",
    "Retention",
    "SSH_CONFIG_FILES",
    "SSH_CONFIG_OPTIONS",
    "find_inventory",
    "list_playbooks",
    "load_inventory",
    "load_playbook",
    "no_control_characters",
    "parse_duration",
    "playbook_dirs",
    "proxy_jump_hops",
    "ssh_config",
    "ssh_config_knows",
    "ssh_config_lookup",
    "ssh_config_origin",
]
