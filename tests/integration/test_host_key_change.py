"""A host key that changes during a run: the supervisor's next connection is refused,
and that is an error-level event and an alert at once (not a warning that waits
for ``escalate_after``), naming the host and the fix. The fake trainer runs on
`rekeyed` (the `direct` sshd under another name, with a known_hosts file of its
own); the key known for it is then replaced by another host's and its connections
are cut, as when the host is reinstalled or someone sits in between."""

from __future__ import annotations

import pytest
import yaml

from dflashctl.config import load_inventory, load_playbook
from dflashctl.store import Store
from dflashctl.supervise.supervisor import Supervisor
from tests.harness.fake_trainer import start_fake_run
from tests.harness.local import SOCKET, end_trainer, kill_tmux_servers, kinds, wait_for, write_playbook

pytestmark = pytest.mark.slow

INTERVAL = 0.5


@pytest.fixture
def rekeyed(ssh_env, tmp_path):
    """The inventory with `rekeyed` (direct's sshd) and its own known_hosts file."""
    known = tmp_path / "known_hosts"
    known.write_text(ssh_env.known_hosts.read_text())
    raw = yaml.safe_load(open(ssh_env.inventory_path))
    raw["hosts"]["rekeyed"] = {**raw["hosts"]["direct"], "known_hosts": str(known)}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_inventory(str(path)), known


def test_a_host_key_changed_during_a_run_is_an_error_and_an_alert_at_once(ssh_env, rekeyed, tmp_path, webhook):
    inventory, known = rekeyed
    playbooks = tmp_path / "playbooks"
    path = write_playbook(playbooks, "rekey", "rekeyed", {"train": {"steps": 100000, "log_every": 2}},
                          poll_interval=INTERVAL, expect={"stall_window": 600, "startup_budget": 60},
                          alerts={"webhook": webhook.url, "min_severity": "error"})
    pb = load_playbook(str(path), inventory=inventory)
    store = Store(str(tmp_path / "runs.db"))
    run_id = start_fake_run(store, inventory, "rekeyed", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET)
    run_dir = store.get_run(run_id).run_dir
    sup = Supervisor(store, inventory, interval=INTERVAL, playbooks_dir=str(playbooks))
    sup.attach(run_id)
    try:
        wait_for(lambda: store.get_run(run_id).state == "running", 60, "running", every=INTERVAL, tick=sup.tick)
        direct = ssh_env.server("direct")
        other = (ssh_env.server("jump").dir / "host_ed25519.pub").read_text().split()[:2]
        entry = f"[{direct.address}]:{direct.port}"
        known.write_text("".join(line + "\n" for line in known.read_text().splitlines()
                                 if not line.startswith(entry + " ")) + f"{entry} {' '.join(other)}\n")
        ssh_env.kill_connections("direct")  # the next poll connects again, and meets the other key
        said = wait_for(lambda: [e for e in kinds(store, run_id, "unreachable") if "host key CHANGED" in e.message],
                        30, "the changed key said", every=INTERVAL, tick=sup.tick)
        assert said[0].severity == "error", said[0]
        assert "host rekeyed unreachable" in said[0].message and "ssh-keygen" in said[0].message
        assert "dflashctl" in said[0].message and "trust rekeyed" in said[0].message
        assert (said[0].detail or {}).get("host_key") == "changed"
        [first] = [e for e in kinds(store, run_id, "unreachable")][:1]
        assert first.id == said[0].id  # the first word of the outage is the key's, not a warning before it
        sup.close()  # delivers what is queued
        alert = next(a for a in webhook.received if a.get("kind") == "unreachable")
        assert alert["severity"] == "error" and "host key CHANGED" in alert["message"]
        assert "trust rekeyed" in alert["message"]
    finally:
        sup.close()
        kill_tmux_servers([(inventory.get("direct"), inventory, SOCKET)])
        end_trainer(run_dir)
