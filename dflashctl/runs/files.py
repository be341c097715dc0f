"""A run's files on its host: config.json, run.sh, rendezvous.key, standby.sh.

They are rendered here from the run's stored config, for one process of the run;
the callers write them (``deploy.write_run_files``) and start the session. A run
on its host is a directory (``<workdir>/runs/<run_id>/``: config.json, run.sh,
status.json, metrics.jsonl, trainer.log, exit_code) and a tmux session named after
the run running ``run.sh``.

``run.sh`` is the whole process contract on the host: it exports the environment
(PYTHONPATH = the bundle, TORCHINDUCTOR_CACHE_DIR = the persistent compile cache,
UTF-8 locale, unbuffered output, CUDA_VISIBLE_DEVICES when the run owns GPUs, the
host's and the playbook's env), removes the previous process's status.json and
exit_code, runs ``python -m trainer --config config.json --run-dir DIR --resume
auto`` with its output appended to trainer.log, and writes the exit status to
``exit_code`` when the trainer ends, whatever way it ends. A restart runs the
same script again in the same run directory: the trainer resumes from its last
checkpoint and the compile cache is still warm.

``standby.sh`` is run.sh for the next process, started early (``dflashctl.runs.standby``):
its trainer imports and waits, clears nothing when it starts and writes an exit code
only once its trainer has taken over.

A multi-host run (``Run.hosts``) is a run directory per host (``Run.parts``); each
host's run.sh exports that host's python and environment and the rendezvous
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and ``rendezvous.key`` holds the
start's secret.

When the run owns GPUs, CUDA_VISIBLE_DEVICES is set to exactly those (physical
indices, as nvidia-smi numbers them) and the placement written to config.json is
renumbered to match, so the trainer cannot touch (or create a stray CUDA context
on) another run's GPU. The store records the physical indices (``config["gpus"]``).
"""

from __future__ import annotations

import copy
import shlex
from typing import TYPE_CHECKING, Any

from dflashctl.core import contract
from dflashctl.hosts import deploy

if TYPE_CHECKING:
    from dflashctl.config import Host

RUN_SCRIPT = "run.sh"
STANDBY_SCRIPT = "standby.sh"
# The playbook's secrets (``Playbook.secret_env``), as ``export`` lines: written at
# launch, mode 0600 in the run's 0700 directory, read by run.sh; never stored.
SECRETS_FILE = "secrets.env"


def renumber_placement(trainer: dict[str, Any], gpus: list[int]) -> dict[str, Any]:
    """The trainer config as seen under CUDA_VISIBLE_DEVICES=gpus (indices become positions)."""
    out = copy.deepcopy(trainer)
    position = {g: i for i, g in enumerate(gpus)}
    for role in ("target", "drafter"):
        out["placement"][role] = [position[int(g)] for g in out["placement"][role]]
    return out


def _remote_path_expr(path: str) -> str:
    """A shell word for a host path: '~/x' expands to the host's $HOME, the rest is literal."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def run_environment(host: "Host", playbook_env: dict[str, str], bundle_dir: str,
                    gpus: list[int]) -> dict[str, str]:
    """The trainer's environment besides the compile cache (host env, then playbook env, win)."""
    env = {"LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    env.update(host.env or {})
    env.update(playbook_env or {})
    extra_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = bundle_dir + (f":{extra_path}" if extra_path else "")
    if gpus and "CUDA_VISIBLE_DEVICES" not in (playbook_env or {}):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def render_run_script(run_id: str, run_dir: str, python: str, env: dict[str, str],
                      compile_cache: str | None, session: str, socket: str, rank: int = 0,
                      standby: str | None = None, secret_names: list[str] = ()) -> str:
    """run.sh: see the module docstring. ``standby``: standby.sh instead, the trainer
    started with ``--standby TOKEN``, which clears nothing before it takes over and
    whose exit code is written only once it has (trainer/standby.py)."""
    lines = [
        "#!/bin/sh",
        _comment(f"dflashctl run {run_id}: runs in tmux session {session} (tmux -L {socket})."),
        "# Rewritten on every (re)start by dflashctl; edits here are lost.",
        # What the trainer writes (logs, checkpoints, its caches) is this user's alone.
        "umask 077",
        f"cd {shlex.quote(run_dir)} || exit 1",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if secret_names:
        lines.append(f". ./{SECRETS_FILE} || exit 1  # {' '.join(secret_names)}: written at launch, never here")
    if compile_cache:
        # Persistent and never cleared: a restart must find the compiled kernels.
        lines += [f"export TORCHINDUCTOR_CACHE_DIR={_remote_path_expr(compile_cache)}",
                  'mkdir -p "$TORCHINDUCTOR_CACHE_DIR"']
    trainer = shlex.join([*shlex.split(python), "-m", "trainer", "--config", contract.CONFIG_FILE,
                          "--run-dir", run_dir, "--resume", "auto", *(["--standby", standby] if standby else [])])
    ec, tmp = contract.EXIT_CODE_FILE, contract.EXIT_CODE_FILE + ".tmp"
    lines += [
        # The previous process's answers must not be read as this one's (a standby's
        # are cleared by the restart that wakes it).
        *([] if standby else [f"rm -f {ec} {contract.status_file(rank)}"]),
        "{",
        # Caught here (so the exit code is still written), reset to default for the
        # trainer, which handles SIGINT/SIGTERM itself (checkpoint, exit 4).
        "  trap : INT TERM HUP",
        f"  {trainer} 2>&1",
        f"  echo $? > {tmp} && mv -f {tmp} {ec}" if not standby else
        f"  code=$?; [ -f {shlex.quote(contract.standby_went(standby))} ] && echo $code > {tmp} && mv -f {tmp} {ec}",
        # tee -i: a Ctrl-C for the trainer must not kill the log writer first.
        f"}} | tee -i -a {contract.LOG_FILE}",
        "",
    ]
    return "\n".join(lines)


def _comment(text: str) -> str:
    """A shell comment line of ``text``: a control character in it (a newline would end
    the comment and make the rest a command) is written as its escape."""
    return "# " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def distributed_env(dist: dict[str, Any], rank: int) -> dict[str, str]:
    """The variables that make a trainer one process of a multi-host run: what torchrun
    sets for a static rendezvous with one process per host (env:// initialisation)."""
    world = len(dist["hosts"])
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank), "MASTER_ADDR": dist["address"], "MASTER_PORT": str(dist["port"]),
            contract.HOST_ENV: dist["hosts"][rank]["host"]}


def part_config(config: dict[str, Any], rank: int) -> dict[str, Any]:
    """A run's stored config as the process of ``rank`` is started with: its host's
    python, environment and workdir, and the rendezvous variables (a single-host run:
    the config as it is)."""
    dist = config.get("distributed")
    if not dist:
        return config
    own = dist["hosts"][rank]
    return {**config, "python": own["python"], "workdir": own["workdir"],
            "env": {**own["env"], **distributed_env(dist, rank)}}


def _artifact_generation() -> int:
    from dflashctl.runs.compile_cache import LocalCache

    return LocalCache().generation()


def run_files(run_id: str, run_dir: str, config: dict[str, Any], socket: str,
              serialized_warmup: bool | None = None, rank: int = 0, session: str | None = None,
              standby: str | None = None, rendezvous_key: str | None = None,
              secrets: dict[str, str] | None = None) -> dict[str, str]:
    """config.json and run.sh for a run (for the process of ``rank`` on its own host,
    in tmux session ``session``), from its stored config; for a multi-host run also
    ``rendezvous.key``, this start's secret (``rendezvous_key``, the same on every host;
    written mode 0600, never stored, never on a command line); at launch, ``secrets``
    (the playbook's secret environment, ``config["secret_env"]`` its names) as
    ``secrets.env``, mode 0600, which run.sh reads at every start."""
    config = part_config(config, rank)
    trainer = copy.deepcopy(config["trainer"])
    if serialized_warmup is not None:
        trainer["compile"]["serialized_warmup"] = serialized_warmup
    gpus = config.get("gpus") or []
    if gpus and "CUDA_VISIBLE_DEVICES" in config.get("env", {}) and \
            config["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus)):
        trainer = renumber_placement(trainer, gpus)
    env = {**config.get("env", {}), contract.ARTIFACT_GENERATION_ENV: str(_artifact_generation())}
    script = render_run_script(run_id, run_dir, config["python"], env,
                               config.get("compile_cache"), session or run_id, socket, rank, standby,
                               list(config.get("secret_env") or []))
    if standby:
        return {STANDBY_SCRIPT: script}
    files = {contract.CONFIG_FILE: deploy.config_json(trainer), RUN_SCRIPT: script}
    if secrets:
        files[SECRETS_FILE] = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(secrets.items()))
    if config.get("distributed") and rendezvous_key:
        files[contract.RENDEZVOUS_KEY_FILE] = rendezvous_key + "\n"
    return files


def new_rendezvous_key() -> str:
    """A fresh secret for one start of a multi-host run (a process of an earlier start
    cannot join this one)."""
    import secrets

    return secrets.token_hex(32)


def start_command(run_dir: str) -> str:
    return shlex.join(["sh", posixpath_join(run_dir, RUN_SCRIPT)])


def posixpath_join(*parts: str) -> str:
    import posixpath

    return posixpath.join(*parts)
