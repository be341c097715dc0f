"""The playbook's models: one run's hosts, trainer settings, expectations, restarts and alerts.

The trainer section is checked by the trainer's own config code (``trainer.config``,
torch-free). Crash signatures are ``signatures.PlaybookSignature`` models, checked
before the built-in table that they extend.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, InstanceOf, field_validator, model_validator

from dflashctl.config.fields import _ENV_NAME, ENV_NAME_PROBLEM, Duration, EnvMap, _none_is_empty
from dflashctl.config.problems import _Problems
from dflashctl.core.contract import did_you_mean
from dflashctl.core.signatures import Action, PlaybookSignature, Severity, signature_names
from dflashctl.core.units import describe, number_text
from trainer import config as trainer_config
from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from dflashctl.config.inventory import Inventory

_PLAYBOOK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

# A name like these in ``env:`` holds a secret even when not marked so.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE)
_SECRET_KEYS = ("value", "from_env", "from_file")


def _split_secrets(raw: Any) -> Any:
    """``env:`` entries that are secrets move to ``secret_env`` (name -> (source,
    reference)): a mapping (``{from_env: NAME}``, ``{from_file: PATH}``, ``{value: X,
    secret: true}``), or a plain value whose name looks like a secret (SECRET_NAME)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("env"), dict):
        return raw
    env, secrets, bad = {}, {}, []
    for name, value in raw["env"].items():
        if not _ENV_NAME.fullmatch(str(name)):  # it would break run.sh or secrets.env
            bad.append((f"env.{name}", ENV_NAME_PROBLEM))
            continue
        if not isinstance(value, dict):
            if isinstance(value, str) and SECRET_NAME.search(str(name)):
                secrets[name] = ("value", value)
            else:
                env[name] = value
            continue
        given = [k for k in _SECRET_KEYS if k in value]
        unknown = set(value) - {*_SECRET_KEYS, "secret"}
        if unknown or len(given) != 1 or not isinstance(value[given[0]], str):
            bad.append((f"env.{name}", "a secret is one of {from_env: VARIABLE}, {from_file: PATH} or "
                        "{value: TEXT, secret: true}" + (f" (unknown: {', '.join(sorted(map(str, unknown)))})"
                                                         if unknown else "")))
        elif given == ["value"] and value.get("secret") is False and not SECRET_NAME.search(str(name)):
            env[name] = value["value"]
        else:
            secrets[name] = (given[0], value[given[0]])
    if bad:
        raise _Problems(bad)
    return {**raw, "env": env, "secret_env": {**secrets, **(raw.get("secret_env") or {})}}


class Expect(BaseModel):
    """What a healthy run looks like; the detectors compare against it."""

    model_config = ConfigDict(extra="forbid")

    baseline_tok_s: Optional[float] = Field(None, gt=0)
    """Healthy tokens/s; None: the median of earlier healthy runs of this playbook."""
    regression_fraction: float = Field(0.6, gt=0, le=1)
    """Below this fraction of the baseline a window counts as slow."""
    regression_windows: int = Field(3, ge=1)
    """Slow windows in a row before a regression is found."""
    regression_hold: Duration = Field(120.0, ge=0)
    """A regression is reported once it has lasted this long (short slow spells of a
    busy host are not news)."""
    regression_clear: Duration = Field(120.0, ge=0)
    """A reported regression is cleared once it has been gone this long (a pace that
    flaps around the threshold stays one finding)."""
    learn_after_steps: int = Field(100, ge=0)
    """Warm-up steps; after them a loss that stays flat with accuracy 0 is a run that
    learns nothing (a warning)."""
    max_eta: Optional[Duration] = Field(None, gt=0)
    stall_window: Duration = Field(300.0, gt=0)
    """No new step for this long while training is a stall."""
    compile_budget: Duration = Field(1800.0, gt=0)
    """Longest the `compiling` phase may take."""
    startup_budget: Duration = Field(600.0, gt=0)
    """Longest from launch to the first status (imports, model load)."""
    compile_cache_after: Duration = Field(300.0, ge=0)
    """Training this long before the compile artifacts a cold start saved are copied
    back into the controller's cache store (``dflashctl cache ls``)."""


class Retention(BaseModel):
    """How much of a run's history the store keeps at each resolution (store/history.py).
    The defaults keep a 30-day run on 8 GPUs, polled every 5 s, under 64 MiB."""

    model_config = ConfigDict(extra="forbid")

    full: Duration = Field(6 * 3600.0, gt=0)
    """Every sample (metrics line), for this long before the newest."""
    readings: Duration = Field(3600.0, gt=0)
    """Every poll's readings of the run's hosts (GPUs, CPU, memory), for this long before the newest."""
    fine: Duration = Field(7 * 86400.0, gt=0)
    """One-minute rollups (min, mean, max) for this long; 15-minute ones for the run's life."""

    @model_validator(mode="after")
    def _fine_covers_full(self) -> "Retention":
        if self.fine < max(self.full, self.readings):
            raise ValueError(f"fine ({self.fine:g} s) must be at least full and readings "
                             f"({max(self.full, self.readings):g} s)")
        return self


class RestartPolicy(BaseModel):
    """When and how a crashed run is restarted (the policy module applies it)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_restarts: int = Field(5, ge=0)
    """At most this many restarts that made no progress within ``window``; then the run
    is stopped. A restart made progress when the attempt it started got past the step
    where the attempt before it failed; such restarts are not counted, so a long run
    that crashes now and then is never given up on."""
    window: Duration = Field(6 * 3600.0, gt=0)
    backoff_initial: Duration = Field(10.0, ge=0)
    backoff_max: Duration = Field(600.0, ge=0)
    backoff_factor: float = Field(2.0, ge=1)
    jitter: float = Field(0.2, ge=0, le=1)
    """Each backoff is scaled by a random factor in [1 - jitter, 1 + jitter]."""
    healthy_after: Duration = Field(900.0, ge=0)
    """Sustained healthy training for this long resets the restart count."""
    crash_loop_k: int = Field(3, ge=1)
    """Stop after this many restarts in a row without step progress."""
    actions: Annotated[dict[str, Action], _none_is_empty(dict)] = {}
    """Per crash-signature name: what to do instead of the signature's own action."""
    standby: bool = True
    """Once a process trains, start the next one's standby beside it (imports done,
    waiting; no GPU touched): a restart then pays no import of torch and transformers."""

    @model_validator(mode="after")
    def _backoff_order(self) -> "RestartPolicy":
        if self.backoff_max < self.backoff_initial:
            low, high = number_text(self.backoff_max), number_text(self.backoff_initial)
            raise _Problems([("backoff_max", f"{low}s is less than backoff_initial ({high}s)")])
        return self


class Alerts(BaseModel):
    """Where events at or above ``min_severity`` go (as JSON)."""

    model_config = ConfigDict(extra="forbid")

    min_severity: Severity = "error"
    command: Union[str, list[str], None] = None
    """Run with the event JSON on stdin: a shell command line, or an argument list."""
    webhook: Optional[str] = None
    """URL receiving an HTTP POST of the event JSON."""
    min_interval: Duration = Field(60.0, ge=0)
    """At most one alert per this interval for the same run and kind."""
    timeout: Duration = Field(30.0, gt=0)
    """Longest one hook may take for one alert, all told: then a command's process
    group is killed and a webhook request abandoned, and the failure reported."""
    connect_timeout: Duration = Field(10.0, gt=0)
    """Longest a webhook may take to accept the connection (within ``timeout``)."""

    @field_validator("command", mode="before")
    @classmethod
    def _command_shape(cls, value: Any) -> Any:
        ok = value is None or (isinstance(value, str) and value.strip())
        ok = ok or (isinstance(value, list) and value and all(isinstance(a, str) for a in value))
        if not ok:
            raise ValueError(f"expected a command line or a non-empty list of arguments, got {describe(value)}")
        return value

    @field_validator("webhook")
    @classmethod
    def _url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.match(r"https?://[^\s/]+", value):
            raise ValueError(f"'{value}' is not an http:// or https:// URL")
        return value


def _trainer_from_raw(value: Any) -> Any:
    """The trainer section is validated by the trainer's own config code (torch-free)."""
    if value is None:
        value = {}
    if isinstance(value, TrainerConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {describe(value)}")
    try:
        return trainer_config.from_dict(value, prefix="trainer")
    except trainer_config.ConfigError as e:
        items = []
        for line in e.problems:
            path, sep, msg = line.partition(": ")
            if not sep:
                path, msg = "", line
            items.append((re.sub(r"^trainer\.?", "", path), msg))
        raise _Problems(items) from None


class EvalSettings(BaseModel):
    """Speculative decoding with the trained drafter once the run ends ``done``
    (``python -m trainer eval`` on the run host, its GPUs): measured acceptance
    length tau, tokens per target forward and the speed-up over greedy decoding,
    stored with the run (``dflashctl runs``, ``dflashctl evals RUN``)."""

    model_config = ConfigDict(extra="forbid")

    after_done: bool = False
    """Run it by itself when the run ends done (else only ``dflashctl eval RUN``)."""
    data: Optional[str] = None
    """Shards on the run host (directory or glob); default: the run's own data."""
    prompts: int = Field(20, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0: greedy verification; > 0: sampling with the speculative rejection rule."""
    threads: Optional[int] = Field(None, ge=1)
    """CPU threads for a CPU eval (1 is fastest for tiny models on a busy machine)."""
    timeout: Duration = Field(1800.0, gt=0)


class Rendezvous(BaseModel):
    """Where the processes of a multi-host run meet (torch.distributed, env://): rank 0's host."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(29500, ge=1024, le=65535)
    """TCP port on rank 0's host; checked free before the start."""
    address: Optional[str] = None
    """How the other hosts reach rank 0's host (default: its inventory ``address``;
    a local host: 127.0.0.1). How long the processes wait for each other, at the start
    and in every collective, is the trainer's ``distributed.timeout``."""


class Playbook(BaseModel):
    """One run profile: which host, trainer settings, expectations, restart and alert policy."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """From the file name (prod.yaml -> prod)."""
    description: str = ""
    host: Optional[str] = None
    """The run host (or ``hosts``)."""
    hosts: Annotated[list[str], _none_is_empty(list)] = []
    """Several hosts (names or inventory groups): one torch.distributed process on each,
    rank 0 on the first. ``host`` is then the first of them."""
    rendezvous: Annotated[Rendezvous, _none_is_empty(dict)] = Field(default_factory=Rendezvous)
    trainer: Annotated[InstanceOf[TrainerConfig], BeforeValidator(_trainer_from_raw)] = Field(
        default_factory=TrainerConfig
    )
    env: EnvMap = {}
    """Extra environment of the trainer process on the run host."""
    secret_env: dict[str, tuple[str, str]] = Field(default_factory=dict, repr=False, exclude=True)
    """The secrets of ``env:`` (name -> (value | from_env | from_file, its text)): read at
    launch (``secret_values``), written on the host only to the run's private
    ``secrets.env``, never stored (docs/playbooks.md#secrets)."""
    compile_cache: Optional[str] = "~/.cache/dflashctl/compile"
    """Persistent compile cache on the run host; kept across restarts, never cleared."""
    poll_interval: Duration = Field(15.0, gt=0)
    expect: Annotated[Expect, _none_is_empty(dict)] = Field(default_factory=Expect)
    restart: Annotated[RestartPolicy, _none_is_empty(dict)] = Field(default_factory=RestartPolicy)
    signatures: Annotated[list[PlaybookSignature], _none_is_empty(list)] = []
    """Checked before the built-in signature table."""
    alerts: Annotated[Alerts, _none_is_empty(dict)] = Field(default_factory=Alerts)
    eval: Annotated[EvalSettings, _none_is_empty(dict)] = Field(default_factory=EvalSettings)
    retention: Annotated[Retention, _none_is_empty(dict)] = Field(default_factory=Retention)
    """What the store keeps of the run's history, at which resolution."""
    env_audit: Annotated[dict, _none_is_empty(dict)] = {}
    """Environment-audit policy (free-form for now)."""
    source: str = ""
    """The file it came from, or '<embedded demo playbook>'."""

    @model_validator(mode="before")
    @classmethod
    def _secrets_apart(cls, raw: Any) -> Any:
        return _split_secrets(raw)

    def secret_values(self) -> dict[str, str]:
        """The secrets of ``env:`` read now: from the controller's environment or a
        file (first line, ``~`` expanded). ConfigError naming ``env.NAME`` and the fix."""
        import os

        from dflashctl.core.errors import ConfigError

        out = {}
        for name, (source, ref) in self.secret_env.items():
            if source == "value":
                out[name] = ref
            elif source == "from_env":
                if ref not in os.environ:
                    raise ConfigError(f"env.{name}: ${ref} is not set in this environment", source=self.source,
                                      hint=f"export {ref}=... before the launch, or read it from_file")
                out[name] = os.environ[ref]
            else:
                try:
                    with open(os.path.expanduser(ref), encoding="utf-8") as f:
                        out[name] = f.readline().rstrip("\r\n")
                except (OSError, UnicodeDecodeError) as e:
                    raise ConfigError(f"env.{name}: cannot read {ref}: {getattr(e, 'strerror', None) or e}",
                                      source=self.source, hint="give a readable file holding the value") from None
        return out

    @field_validator("name")
    @classmethod
    def _name_ok(cls, name: str) -> str:
        if not _PLAYBOOK_NAME.fullmatch(name):
            raise ValueError(f"playbook name '{name}' (from the file name): use letters, digits, '_' or '-'")
        return name

    @model_validator(mode="after")
    def _one_place(self) -> "Playbook":
        if self.hosts and self.host is not None and self.host != self.hosts[0]:
            raise _Problems([("host", f"give host or hosts, not both (hosts: {self.hosts})")])
        if len(set(self.hosts)) != len(self.hosts):
            raise _Problems([("hosts", "a host is listed twice")])
        if self.host is None and not self.hosts:
            raise _Problems([("host", "required: the run host (or hosts: a list of them)")])
        if self.host is None:
            self.host = self.hosts[0]
        return self

    def host_names(self, inventory: "Inventory") -> list[str]:
        """The run's hosts in rank order (groups expanded); one for a single-host run."""
        return inventory.expand(self.hosts or [self.host])

    @model_validator(mode="after")
    def _signature_names(self) -> "Playbook":
        seen, problems = set(), []
        for i, sig in enumerate(self.signatures):
            if sig.name in seen:
                problems.append((f"signatures[{i}].name", f"duplicate signature name '{sig.name}'"))
            seen.add(sig.name)
        known = signature_names(self.signatures)  # this playbook's, then the built-in table
        for key in self.restart.actions:
            if key not in known:
                problems.append((f"restart.actions.{key}", f"unknown crash signature{did_you_mean(key, known)}"))
        if problems:
            raise _Problems(problems)
        return self


