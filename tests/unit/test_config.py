"""Inventory and playbook loading: shipped files, one test per bad fixture, resolution order."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from dflashctl import config
from dflashctl.config import (
    DEMO_PLAYBOOK_YAML,
    EMBEDDED,
    Host,
    Inventory,
    list_playbooks,
    load_inventory,
    load_playbook,
    parse_duration,
)
from dflashctl.core import paths
from dflashctl.core.errors import ConfigError
from tests import harness

REPO = harness.REPO
FIXTURES = REPO / "tests" / "fixtures" / "config"
SHIPPED_PLAYBOOKS = REPO / "playbooks"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test runs in an empty directory with its own DFLASHCTL_HOME and no DFLASHCTL_* overrides."""
    for var in ("DFLASHCTL_INVENTORY", "DFLASHCTL_PLAYBOOKS", "DFLASHCTL_STORE", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "dfhome"
    monkeypatch.setenv("DFLASHCTL_HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd, home


def uncomment_example(text: str) -> str:
    """The shipped inventory with its commented gpu1 example turned on, as a user would."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"\s*# --- end example", line):
            inside = False
        elif re.match(r"\s*# --- example", line):
            inside = True
        else:
            out.append(re.sub(r"^(\s*)# ?", r"\1", line) if inside else line)
    return "\n".join(out) + "\n"


@pytest.fixture
def gpu_inventory(tmp_path) -> Inventory:
    path = tmp_path / "inventory-with-gpu1.yaml"
    path.write_text(uncomment_example((REPO / "inventory.yaml").read_text()))
    return load_inventory(str(path))


def expected_problems(path: Path) -> list[str]:
    return re.findall(r"^# expect: (.*)$", path.read_text(), re.M)


# --------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("bad-*.yaml")), ids=lambda p: p.stem)
def test_bad_fixture(path):
    """Each bad file lists its exact problems in `# expect:` lines; nothing more, nothing less."""
    expected = expected_problems(path)
    assert expected, f"{path.name} has no '# expect:' line"
    lab = load_inventory(str(FIXTURES / "good-inventory-lab.yaml"))
    with pytest.raises(ConfigError) as info:
        if path.name.startswith("bad-inventory-"):
            load_inventory(str(path))
        else:
            load_playbook(str(path), inventory=lab)
    error = info.value
    assert sorted(error.problems) == sorted(expected)
    assert error.source == str(path)
    assert str(error).startswith(str(path))
    assert "pydantic" not in str(error) and "Input should" not in str(error)
    assert error.exit_code == 2


def test_unknown_host_error_says_how_to_fix(gpu_inventory):
    with pytest.raises(ConfigError) as info:
        load_playbook(str(FIXTURES / "bad-playbook-unknown-host.yaml"), inventory=gpu_inventory)
    assert "hosts in" in info.value.hint and "gpu1" in info.value.hint


# --------------------------------------------------------------------------- shipped files


def test_shipped_inventory_is_the_embedded_default():
    shipped = load_inventory(str(REPO / "inventory.yaml"))
    embedded = load_inventory()  # nothing in cwd or the config dir
    assert embedded.source == EMBEDDED
    assert list(shipped.hosts) == list(embedded.hosts) == ["local"]
    assert shipped.hosts["local"] == embedded.hosts["local"]


def test_local_host_defaults(isolated):
    _, home = isolated
    local = load_inventory().get("local")
    assert local.is_local
    assert local.workdir == os.path.join(str(home), "work")
    assert local.python == sys.executable  # the interpreter running dflashctl has the trainer's deps
    assert load_inventory().route("local") == [local]


def test_shipped_inventory_example_when_uncommented(gpu_inventory):
    gpu1 = gpu_inventory.get("gpu1")
    assert [h.name for h in gpu_inventory.route("gpu1")] == ["gateway", "gpu1"]
    assert gpu1.wrapper == ["pct", "exec", "200", "--"]
    assert gpu1.gpus == 8 and gpu1.user == "root"  # from defaults
    assert gpu1.identity_file == os.path.expanduser("~/.ssh/id_ed25519")
    assert gpu1.python == "/opt/dflash/venv/bin/python" and gpu1.workdir == "/root/dflash"
    assert gpu1.command_timeout == 300 and gpu1.connect_timeout == 15
    assert gpu_inventory.get("gateway").user == "alice"  # its own value wins over defaults


@pytest.mark.parametrize("name", sorted(p.stem for p in SHIPPED_PLAYBOOKS.glob("*.yaml")))
def test_shipped_playbooks_load(name, gpu_inventory):
    playbook = load_playbook(name, str(SHIPPED_PLAYBOOKS), inventory=gpu_inventory)
    assert playbook.name == name
    assert playbook.source == str(SHIPPED_PLAYBOOKS / f"{name}.yaml")
    assert playbook.description
    json.dumps(playbook.model_dump(mode="json"))  # the store keeps it as JSON


def test_shipped_playbook_names():
    assert {"demo", "smoke", "prod"} <= set(list_playbooks(str(SHIPPED_PLAYBOOKS)))


def test_prod_playbook(gpu_inventory):
    prod = load_playbook("prod", str(SHIPPED_PLAYBOOKS), inventory=gpu_inventory)
    t = prod.trainer
    assert prod.host == "gpu1"
    assert (t.placement.device, t.placement.target, t.placement.drafter) == ("cuda", [0, 1, 2, 3, 4], [5, 6, 7])
    assert t.model.path == "/models/Qwen3-8B" and t.model.preset is None
    assert t.data.buckets == [1024, 2048, 3072]
    # Its data written by its own target before training, as the docs say a run's must be.
    assert t.data.shards is None and t.data.regenerate.source == "/data/dflash/qwen3-8b/shards"
    assert t.data.regenerate.out.startswith("/data/") and prod.expect.learn_after_steps == 500
    assert t.optim.lr == pytest.approx(6e-4)  # YAML 1.1 would have read '6e-4' as text
    assert t.compile.enabled == "on"  # ... and `on` as true
    assert prod.expect.baseline_tok_s == 12800 and prod.expect.max_eta == 7 * 86400
    assert prod.restart.actions["fx_race"] == "restart_serialized"
    assert prod.alerts.webhook is None and prod.alerts.command is None  # examples stay commented


def test_demo_playbook_runs_on_cpu_locally():
    demo = load_playbook("demo", inventory=load_inventory())
    assert demo.host == "local" and demo.source == "<embedded demo playbook>"
    t = demo.trainer
    assert (t.model.preset, t.placement.device, t.data.buckets) == ("tiny-cycle", "cpu", [256])
    assert t.data.regenerate.source == "synthetic" and t.data.holdout > 0  # data written by its own target
    assert demo.eval.after_done and demo.eval.timeout <= 300  # measured at the end, within the demo's budget
    assert t.train.steps <= 300 and t.data.batch_size <= 2


@pytest.mark.parametrize("name", ["smoke", "prod"])
def test_gpu_playbooks_need_the_gpu1_entry(name):
    with pytest.raises(ConfigError) as info:
        load_playbook(name, str(SHIPPED_PLAYBOOKS), inventory=load_inventory(str(REPO / "inventory.yaml")))
    assert info.value.problems == ["host: unknown host 'gpu1'"]


def test_embedded_demo_is_playbooks_demo_yaml():
    assert (SHIPPED_PLAYBOOKS / "demo.yaml").read_text() == DEMO_PLAYBOOK_YAML


# --------------------------------------------------------------------------- good fixtures


def test_lab_inventory():
    inv = load_inventory(str(FIXTURES / "good-inventory-lab.yaml"))
    assert [h.name for h in inv.route("gpu2")] == ["gateway", "inner", "gpu2"]
    assert [h.name for h in inv.route("gateway")] == ["gateway"]
    gpu1, gpu2 = inv.get("gpu1"), inv.get("gpu2")
    assert gpu1.user == "root" and gpu2.user == "ops"  # defaults, overridden per host
    assert gpu2.identity_file == str(FIXTURES / "keys" / "lab_ed25519")  # relative to the inventory file
    assert gpu1.env == {"LANG": "C.UTF-8", "OMP_NUM_THREADS": "4"}  # merged per key; numbers become text
    assert gpu2.wrapper == ["docker", "exec", "-i", "trainer box"]
    assert (gpu2.connect_timeout, gpu2.command_timeout) == (30.0, 120.0)
    assert inv.get("local").user is None  # defaults apply to ssh hosts only
    assert inv.get("gateway").port == 2222 and inv.get("inner").port == 22


def test_unknown_host_lookup_suggests():
    inv = load_inventory(str(FIXTURES / "good-inventory-lab.yaml"))
    with pytest.raises(ConfigError, match=r"unknown host 'gpu-1' \(did you mean 'gpu1'\?\)"):
        inv.route("gpu-1")


def test_route_refuses_a_cycle_built_in_code():
    # model_construct skips validation on purpose: route() must still never loop forever.
    a = Host(name="a", address="10.0.0.1", jump=None).model_copy(update={"jump": "b"})
    b = Host(name="b", address="10.0.0.2", jump="a")
    inv = Inventory.model_construct(hosts={"a": a, "b": b}, source="code")
    with pytest.raises(ConfigError, match=r"jump cycle"):
        inv.route("a")


def test_inventory_built_in_code_is_checked():
    with pytest.raises(ValueError, match="unknown host 'gatway'"):
        Inventory(hosts={"gpu1": Host(name="gpu1", address="10.0.0.1", jump="gatway")})


def test_empty_sections_mean_defaults(gpu_inventory):
    playbook = load_playbook(str(FIXTURES / "good-playbook-empty-sections.yaml"), inventory=gpu_inventory)
    assert playbook.expect == config.Expect() and playbook.restart == config.RestartPolicy()
    assert playbook.signatures == [] and playbook.env == {}
    assert playbook.trainer.optim.lr == pytest.approx(6e-4) and playbook.trainer.compile.enabled == "on"


def test_minimal_playbook_gets_defaults():
    playbook = load_playbook(str(FIXTURES / "good-playbook-minimal.yaml"))  # no inventory: host unchecked
    assert playbook.name == "good-playbook-minimal"
    assert playbook.expect.stall_window == 300 and playbook.restart.window == 6 * 3600
    assert playbook.compile_cache == "~/.cache/dflashctl/compile" and playbook.poll_interval == 15


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    "value, seconds",
    [(45, 45.0), (2.5, 2.5), ("45s", 45.0), ("30m", 1800.0), ("36h", 129600.0), ("7d", 604800.0),
     ("1h30m", 5400.0), ("1.5h", 5400.0), ("90", 90.0), (" 10 m ", 600.0), ("0", 0.0)],
)  # fmt: skip
def test_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["7 days", "7w", "-5m", "m", "", "1h-30m", -1, True, None, [1], float("inf")])
def test_bad_duration(value):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)


# --------------------------------------------------------------------------- resolution order


def write_inventory(path: Path, host: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"hosts:\n  {host}:\n    address: 127.0.0.1\n")
    return path


def test_inventory_resolution_order(isolated, tmp_path, monkeypatch):
    cwd, home = isolated
    assert load_inventory().source == EMBEDDED
    user = write_inventory(home / "inventory.yaml", "from-config-dir")
    assert list(load_inventory().hosts) == ["from-config-dir"] and load_inventory().source == str(user)
    write_inventory(cwd / "inventory.yaml", "from-cwd")
    assert list(load_inventory().hosts) == ["from-cwd"]
    env = write_inventory(tmp_path / "env.yaml", "from-env")
    monkeypatch.setenv("DFLASHCTL_INVENTORY", str(env))
    assert list(load_inventory().hosts) == ["from-env"]
    explicit = write_inventory(tmp_path / "explicit.yaml", "from-argument")
    assert list(load_inventory(str(explicit)).hosts) == ["from-argument"]


def test_missing_explicit_inventory_names_the_path():
    with pytest.raises(ConfigError) as info:
        load_inventory("nowhere/inventory.yaml")
    assert "inventory file not found: nowhere/inventory.yaml (given)" in info.value.problems
    assert os.path.abspath("nowhere/inventory.yaml") in str(info.value)
    assert "--inventory" in info.value.hint


def test_missing_env_inventory_names_the_variable(monkeypatch, isolated):
    cwd, _ = isolated
    write_inventory(cwd / "inventory.yaml", "from-cwd")  # not silently used instead
    monkeypatch.setenv("DFLASHCTL_INVENTORY", "/nonexistent/inv.yaml")
    with pytest.raises(ConfigError, match="named by DFLASHCTL_INVENTORY"):
        load_inventory()


def write_playbook(directory: Path, name: str, description: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(f"description: {description}\nhost: local\n")
    return path


def test_playbook_resolution_order(isolated, tmp_path, monkeypatch):
    cwd, home = isolated
    assert load_playbook("demo").source == "<embedded demo playbook>"
    write_playbook(home / "playbooks", "demo", "config dir")
    assert load_playbook("demo").description == "config dir"
    write_playbook(cwd / "playbooks", "demo", "cwd")
    assert load_playbook("demo").description == "cwd"
    assert load_playbook("demo").source == os.path.join("playbooks", "demo.yaml")
    write_playbook(tmp_path / "env", "demo", "env")
    monkeypatch.setenv("DFLASHCTL_PLAYBOOKS", str(tmp_path / "env"))
    assert load_playbook("demo").description == "env"
    write_playbook(tmp_path / "explicit", "demo", "argument")
    assert load_playbook("demo", str(tmp_path / "explicit")).description == "argument"
    by_path = write_playbook(tmp_path / "elsewhere", "night", "by path")
    assert load_playbook(str(by_path)).name == "night"


def test_playbooks_in_cwd_and_config_dir_both_count(isolated):
    cwd, home = isolated
    write_playbook(home / "playbooks", "nightly", "config dir")
    write_playbook(cwd / "playbooks", "smoke", "cwd")
    assert load_playbook("nightly").description == "config dir"
    assert list_playbooks() == ["demo", "nightly", "smoke"]


def test_embedded_demo_when_the_given_directory_lacks_it(tmp_path):
    write_playbook(tmp_path / "mine", "prod", "mine")
    assert list_playbooks(str(tmp_path / "mine")) == ["demo", "prod"]
    assert load_playbook("demo", str(tmp_path / "mine")).source == "<embedded demo playbook>"


def test_missing_playbook_names_the_paths_searched(isolated):
    cwd, home = isolated
    write_playbook(cwd / "playbooks", "prod", "cwd")
    with pytest.raises(ConfigError) as info:
        load_playbook("prdo")
    problems = info.value.problems
    assert problems[0] == "playbook 'prdo' not found (did you mean 'prod'?)"
    assert str(cwd / "playbooks" / "prdo.yaml") in problems[1]
    assert str(home / "playbooks" / "prdo.yaml") in problems[1]
    assert "DFLASHCTL_PLAYBOOKS" in info.value.hint and "demo, prod" in info.value.hint


def test_missing_playbook_file_and_directory(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="playbook file not found: nope/prod.yaml"):
        load_playbook("nope/prod.yaml")
    with pytest.raises(ConfigError, match="playbooks directory not found"):
        load_playbook("prod", str(tmp_path / "absent"))
    monkeypatch.setenv("DFLASHCTL_PLAYBOOKS", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="named by DFLASHCTL_PLAYBOOKS"):
        list_playbooks()


# --------------------------------------------------------------------------- paths


def test_paths_under_dflashctl_home(isolated, monkeypatch, tmp_path):
    _, home = isolated
    assert paths.config_dir() == paths.data_dir() == str(home)
    assert paths.store_path() == str(home / "runs.db")
    monkeypatch.setenv("DFLASHCTL_STORE", str(tmp_path / "elsewhere.db"))
    assert paths.store_path() == str(tmp_path / "elsewhere.db")


def test_paths_default_to_the_user_directories(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASHCTL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.config_dir() == str(tmp_path / ".config" / "dflashctl")
    assert paths.data_dir() == str(tmp_path / ".local" / "share" / "dflashctl")
    assert paths.store_path() == str(tmp_path / ".local" / "share" / "dflashctl" / "runs.db")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert paths.config_dir() == str(tmp_path / "xdg" / "dflashctl")
