"""A run's config as recorded at launch, against its playbook as the file says now.

A restart reuses the recorded config (``runs.config``): the checkpoint was trained
with it. ``restart`` says when the playbook's trainer section has changed since
(``trainer_changes``), and ``restart --reload`` takes it again (``reloaded``):
validated as a playbook, and refused when it changes what the checkpoint's shapes
depend on (the ``model`` section but its dtype) or the GPUs claimed at launch
(``placement``). The rest (steps, learning rate, data, logging, checkpointing,
compile options) is taken as the playbook says; env, hosts and placement stay as
launched.

Pure but ``prepare``, which loads the playbook and records the change; it never
reaches a host.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any, Callable

from dflashctl.core.errors import ConfigError, DflashError, first_line

if TYPE_CHECKING:
    from dflashctl.config import Inventory, Playbook
    from dflashctl.store import Run, Store

# Set by the launch, not the playbook: never a change.
_LAUNCH_SET = ("run_dir", "compile.cache_dir")
# What a checkpoint's tensors and their meaning depend on (model.dtype is a compute choice).
_SHAPES = "model."
_KEPT = ("model.dtype",)
_CLAIMED = "placement."


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to values; an empty section is as if absent."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flat(sub, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def trainer_changes(recorded: dict[str, Any], playbook: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, recorded value, playbook value)`` for each trainer setting that
    differs, in key order; what the launch itself set is left out."""
    old, new = _flat(recorded or {}), _flat(playbook or {})
    return [(key, old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys())
            if key not in _LAUNCH_SET and old.get(key) != new.get(key)]


def describe(changes: list[tuple[str, Any, Any]], limit: int = 4) -> str:
    shown = [f"trainer.{k}: {old!r} -> {new!r}" for k, old, new in changes[:limit]]
    more = len(changes) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def reloaded(config: dict[str, Any], playbook: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, Any]]]:
    """The run's config with the playbook's trainer section taken again, and the
    changes; ConfigError when a change would not fit the checkpoint or the GPUs."""
    changes = trainer_changes(config.get("trainer") or {}, playbook)
    shapes = [c for c in changes if c[0].startswith(_SHAPES) and c[0] not in _KEPT]
    claimed = [c for c in changes if c[0].startswith(_CLAIMED)]
    problems = []
    if shapes:
        problems.append(f"{describe(shapes)}: the run's checkpoint was trained with the recorded model shapes and "
                        "would not load")
    if claimed:
        problems.append(f"{describe(claimed)}: the run's GPUs were claimed at launch")
    if problems:
        raise ConfigError(problems, hint="keep those as they were launched, or launch a new run with the new "
                                          "playbook (`dflashctl launch PLAYBOOK`)")
    trainer = copy.deepcopy(playbook)
    recorded = config.get("trainer") or {}
    trainer["run_dir"] = recorded.get("run_dir")
    cache_dir = (recorded.get("compile") or {}).get("cache_dir")
    if cache_dir and not (trainer.get("compile") or {}).get("cache_dir"):
        trainer.setdefault("compile", {})["cache_dir"] = cache_dir
    return {**config, "trainer": trainer}, changes


def thresholds_of(pb: "Playbook | None") -> dict[str, Any]:
    """The playbook's expectations and restart limits as plain numbers: what launch
    records (``runs.config.thresholds``) and the console shows. None: the defaults,
    as the playbook models declare them (the one place they are written)."""
    if pb is None:
        from dflashctl.config import Expect, Playbook, RestartPolicy

        e, r, poll = Expect(), RestartPolicy(), Playbook.model_fields["poll_interval"].default
    else:
        e, r, poll = pb.expect, pb.restart, pb.poll_interval
    return {"baseline_tok_s": e.baseline_tok_s, "regression_fraction": e.regression_fraction,
            "regression_windows": e.regression_windows, "max_eta_s": e.max_eta, "stall_window_s": e.stall_window,
            "compile_budget_s": e.compile_budget, "startup_budget_s": e.startup_budget,
            "poll_interval_s": float(poll), "max_restarts": r.max_restarts,
            "restart_window_s": r.window, "crash_loop_k": r.crash_loop_k}


def playbook_now(run: "Run", inventory: "Inventory", playbooks_dir: str | None) -> tuple["Playbook | None", str]:
    """The run's playbook as it loads now (the file it was launched from, else by
    name), or None and why not. The one lookup of a run's playbook: the supervisor's
    policy, the console's thresholds and a restart's config all start here."""
    from dflashctl.config import load_playbook

    source = (run.config or {}).get("playbook_source")
    error = "not found"
    for ref in [s for s in (source if source and os.path.isfile(source) else None, run.playbook) if s]:
        try:
            return load_playbook(ref, playbooks_dir, inventory), ref
        except DflashError as e:
            error = first_line(e)
    return None, error


def prepare(run: "Run", store: "Store", inventory: "Inventory", playbooks_dir: str | None, reload: bool,
            say: Callable[[str, str], None], now: float) -> dict[str, str] | None:
    """Before a restart: say whether it reuses the recorded config while the playbook
    changed; with ``reload``, record the playbook's trainer section as the run's
    config (validated; refused as ``reloaded`` says), say what changed, and read the
    playbook's secrets again (returned, for the restart to write; a secret that
    cannot be read refuses the restart before anything is stopped). None without
    ``reload``, or when the playbook has no secrets and the run had none: nothing to
    write, and the restart may wake the run's standby."""
    pb, where = playbook_now(run, inventory, playbooks_dir)
    if pb is None:
        if reload:
            raise ConfigError(f"--reload: the playbook of run {run.id} does not load: {where}",
                              hint="fix the playbook, or restart without --reload (the recorded config)")
        return None
    if not reload:
        changes = trainer_changes((run.config or {}).get("trainer") or {}, pb.trainer.to_dict())
        if changes:
            say("restart", f"{where} changed since the launch ({describe(changes)}); this restart reuses the config "
                           f"recorded at launch; `dflashctl restart {run.id} --reload` takes the playbook again")
        return None
    secrets = pb.secret_values()
    config, changes = reloaded(run.config or {}, pb.trainer.to_dict())
    names = sorted(pb.secret_env)
    renamed = names != sorted((run.config or {}).get("secret_env") or [])
    if renamed:
        config = {**config, "secret_env": names}
    if secrets:
        say("reload", f"secrets read again: {', '.join(names)} (written with the new process, never stored)")
    written = secrets if secrets or renamed else None  # {}: the run's secrets.env goes
    if not changes and not renamed:
        say("reload", f"{where}: the trainer section is as recorded; nothing to take again")
        return written
    store.update_run(run.id, config=config)
    said = describe(changes, limit=20) if changes else "the trainer section as recorded"
    store.add_event(run.id, "config", f"restart --reload took {where} again: {said}"
                    + (f"; secret names now {', '.join(names) or 'none'}" if renamed else ""), now,
                    detail={"changes": [{"key": k, "from": old, "to": new} for k, old, new in changes],
                            **({"secret_env": names} if renamed else {})})
    if changes:
        say("reload", f"took {where} again: {describe(changes)}")
    return written
