"""A trainer-like process for supervisor tests and benchmarks: the run-directory
contract of the real trainer (status.json, metrics.jsonl, a checkpoint to resume
from, exit codes, SIGTERM -> stopped) and its fault injection, without torch, so
it starts in a fraction of a second instead of ten.

It accepts the real trainer's command line, so the launcher's own run.sh can run
it: with ``python`` set to ``<python> fake_trainer.py`` in a run's stored config,
run.sh executes ``<python> fake_trainer.py -m trainer --config config.json
--run-dir DIR --resume auto`` (standby.sh adds ``--standby TOKEN``: it waits as the
real trainer's standby does); ``start_fake_run`` sets a run up that way (and the
launcher's restart then restarts it for real). From config.json it reads ``train.steps``,
``train.log_every``, ``train.checkpoint_every`` and ``fault`` (kind exit | hang |
slow, after_steps, message, exit_code, factor, once) with the real trainer's
meaning; a write that finds the disk full ends it with the real trainer's exit
code for that (``contract.EXIT_DISK_FULL``). ``-m trainer eval`` answers as the
real eval does (``fake_eval``). The environment sets its pace: FAKE_TRAINER_STEP_S (seconds per step,
default 0.05) and FAKE_TRAINER_TOKENS (tokens per step, default 256).
FAKE_TRAINER_COMPILE_CACHE (hit | miss | mismatch:<field>) is the compile_cache
outcome its metrics lines report; unless it is ``hit`` it saves a fake compile
artifact (FAKE_TRAINER_ARTIFACT_BYTES bytes, default 65536) in its run directory
the way the real trainer does (trainer.compile_cache.write), keyed by its real
config digest and bundle hash, GPU FAKE_TRAINER_GPU (default cpu).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

from dflashctl.core import contract

CHECKPOINT = os.path.join(contract.CHECKPOINT_DIR, "fake-step")
FAULT_MARKER = "fault_fired.json"


FAKE_EVAL = "fake_eval.json"  # in the run directory: how the next ``-m trainer eval`` behaves


def fake_eval(argv: list[str]) -> int:
    """``python -m trainer eval RUN_DIR --out FILE --prompts N --max-new-tokens T``
    as the real one answers, without torch: after ``delay_s`` (a late start) one
    prompt every ``prompt_s`` seconds, the report rewritten after each (complete:
    false until the last), exit 0. ``fake_eval.json`` in the run directory sets
    ``delay_s``, ``prompt_s``, ``tau`` and ``speedup``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args, _ = parser.parse_known_args(argv)
    try:
        with open(os.path.join(args.run_dir, FAKE_EVAL), encoding="utf-8") as f:
            how = json.load(f)
    except FileNotFoundError:
        how = {}
    time.sleep(float(how.get("delay_s", 0.0)))
    tau, speedup, prompt_s = float(how.get("tau", 5.0)), float(how.get("speedup", 2.0)), float(how.get("prompt_s", 0.1))
    rows: list[dict] = []
    for i in range(args.prompts):
        time.sleep(prompt_s)
        forwards = max(1, round(args.max_new_tokens / tau))
        rows.append({"index": i, "prompt_tokens": 16, "new_tokens": args.max_new_tokens, "tau": tau,
                     "accepted": args.max_new_tokens - forwards, "target_forwards": forwards,
                     "tokens_per_forward": args.max_new_tokens / forwards, "seconds": prompt_s,
                     "greedy_seconds": prompt_s * speedup, "identical": True})
        spec_s = prompt_s * len(rows)
        report = {"format": 1, "step": 10, "prompts": len(rows), "prompts_planned": args.prompts,
                  "complete": len(rows) == args.prompts, "stopped": None,
                  "new_tokens": args.max_new_tokens * len(rows), "tau": tau, "tau_mean": tau,
                  "tau_per_prompt": [r["tau"] for r in rows], "greedy_identical": True,
                  "tokens_per_target_forward": rows[0]["tokens_per_forward"],
                  "speed": {"speculative_s": spec_s, "greedy_s": spec_s * speedup, "speedup": speedup},
                  "training": None, "per_prompt": rows}
        contract.atomic_write_text(os.path.join(args.run_dir, args.out), json.dumps(report) + "\n")
        print(f"prompt {i + 1}/{args.prompts}: tau {tau:.2f}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:3] == ["-m", "trainer", "eval"]:
        return fake_eval(argv[3:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config")
    parser.add_argument("--standby")
    args, _ = parser.parse_known_args(argv)
    run_dir = os.path.abspath(args.run_dir)
    if args.standby:  # as the real trainer's (trainer/standby.py), with nothing to import
        from trainer import standby

        if not standby.wait_for_go(run_dir, args.standby, 0.0):
            return contract.EXIT_DONE
    os.makedirs(os.path.join(run_dir, contract.CHECKPOINT_DIR), exist_ok=True)
    try:
        with open(args.config or os.path.join(run_dir, contract.CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    train = config.get("train", {})
    total = int(train.get("steps", 1_000_000))
    log_every = max(1, int(train.get("log_every", 1)))
    checkpoint_every = int(train.get("checkpoint_every", 5))
    fault = dict(config.get("fault") or {})
    step_s = float(os.environ.get("FAKE_TRAINER_STEP_S", "0.05"))
    tokens = int(os.environ.get("FAKE_TRAINER_TOKENS", "256"))

    cache_outcome = os.environ.get("FAKE_TRAINER_COMPILE_CACHE")
    if cache_outcome and cache_outcome != "hit":
        save_fake_artifact(run_dir, config, int(os.environ.get("FAKE_TRAINER_ARTIFACT_BYTES", "65536")))
    rank = int(os.environ.get("RANK", "0"))  # a multi-host run's process: its own status and metrics files
    status_name, metrics_name = contract.status_file(rank), contract.metrics_file(rank)

    def write_status(status: contract.Status) -> None:
        status.updated = time.time()
        contract.atomic_write_text(os.path.join(run_dir, status_name), status.to_json())

    status = contract.Status(phase=contract.PHASE_STARTING, pid=os.getpid(), started=time.time())
    write_status(status)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as the real trainer: stacks into the log
    if os.environ.get("FAKE_TRAINER_IGNORE_HUP"):  # like a process stuck in a driver call: outlives its session
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    step = 0
    try:
        with open(os.path.join(run_dir, CHECKPOINT), encoding="utf-8") as f:
            step = int(f.read().strip() or 0)
        print(f"resumed from {CHECKPOINT}: step {step}", flush=True)
    except FileNotFoundError:
        pass
    armed = fault.get("kind") and not (fault.get("once", True) and os.path.exists(os.path.join(run_dir, FAULT_MARKER)))
    factor = 1.0
    status.phase, status.step = contract.PHASE_TRAINING, step
    write_status(status)
    window_start = time.time()
    while step < total:
        if armed and step >= int(fault.get("after_steps", 0)):
            armed = False
            contract.atomic_write_text(os.path.join(run_dir, FAULT_MARKER), json.dumps({"step": step}))
            kind = fault["kind"]
            if kind == "exit":
                message = fault.get("message", "injected fault")
                print(message, file=sys.stderr, flush=True)
                # As the real trainer reports a failure (trainer/train.py report_failure): the
                # signature (numbers blanked) for grouping, its whole words in detail.message.
                status.phase, status.error = contract.PHASE_FAILED, contract.error_signature("InjectedFault", message)
                status.detail = {**status.detail, "message": message[:500], "exit_code": int(fault.get("exit_code", 1))}
                write_status(status)
                os._exit(int(fault.get("exit_code", 1)))
            if kind == "hang":
                print(f"fault: hanging before step {step + 1}", flush=True)
                while stop["signal"] is None:
                    time.sleep(0.05)
            if kind == "slow":
                factor = float(fault.get("factor", 3.0))
        if stop["signal"] is not None:
            break
        time.sleep(step_s * factor)
        step += 1
        if step % log_every == 0 or step == total:
            now = time.time()
            tok_s = tokens * log_every / max(1e-6, now - window_start)
            m = contract.Metrics(time=now, step=step, total_steps=total, tokens=step * tokens, tok_s=tok_s,
                                 loss=1.0 / step, eta_s=(total - step) * tokens / tok_s,
                                 extra={"compile_cache": cache_outcome} if cache_outcome else {})
            with open(os.path.join(run_dir, metrics_name), "a", encoding="utf-8") as f:
                f.write(m.to_line() + "\n")
            print(f"step {step}/{total} tok/s {tok_s:.0f}", flush=True)
            status.step = step
            write_status(status)
            window_start = now
        if checkpoint_every and step % checkpoint_every == 0:
            contract.atomic_write_text(os.path.join(run_dir, CHECKPOINT), str(step))
    contract.atomic_write_text(os.path.join(run_dir, CHECKPOINT), str(step))
    if stop["signal"] is not None:
        status.phase = contract.PHASE_STOPPED
        write_status(status)
        print(f"stopped at step {step} ({stop['signal']})", flush=True)
        return contract.EXIT_STOPPED
    status.phase = contract.PHASE_DONE
    write_status(status)
    print(f"done: {step} steps", flush=True)
    return contract.EXIT_DONE


def save_fake_artifact(run_dir: str, config: dict, size: int) -> dict:
    """A compile artifact as the real trainer saves one (its manifest written last),
    with fake torch/triton/CUDA fields and deterministic bytes."""
    import platform

    from trainer import compile_cache
    from trainer import config as trainer_config

    cfg = trainer_config.from_dict(config)
    fields = {"torch": "fake", "triton": "fake", "cuda": "fake", "gpu": os.environ.get("FAKE_TRAINER_GPU", "cpu"),
              "python": platform.python_version(), "bundle": compile_cache.bundle_hash(),
              "config": compile_cache.config_digest(cfg)}
    data = (b"fake compiled artifact\n" * (size // 23 + 1))[:size]
    return compile_cache.write(run_dir, fields, cfg, data, {"fake": 1})


def start_fake_run(store, inventory, host: str, trainer: dict, *, playbook: str = "fake",
                   playbook_source: str | None = None, socket: str | None = None, step_s: float = 0.05,
                   tokens: int = 256, bundle=None, env: dict[str, str] | None = None) -> str:
    """Record a run and start this fake trainer for it in tmux on ``host``, as the
    launcher starts the real one (bundle deployed, config.json and run.sh written,
    run.sh in a session named after the run). Returns the run id (state launching)."""
    from dflashctl.hosts import deploy
    from dflashctl.hosts.bundle import build_bundle
    from dflashctl.hosts.tmux import Tmux, socket_name
    from dflashctl.hosts.transport import connect
    from dflashctl.runs.runhost import run_files, start_command
    from dflashctl.store import new_run_id

    socket = socket or socket_name()
    transport = connect(host, inventory)
    deployed = deploy.deploy_bundle(transport, bundle or build_bundle(), inventory.get(host).workdir)
    now = time.time()
    run_id = new_run_id(playbook, now)
    run_dir = deploy.run_dir(deployed.workdir, run_id)
    config = {
        "trainer": trainer,
        "gpus": [],
        "env": {"PYTHONPATH": deployed.bundle_dir, "FAKE_TRAINER_STEP_S": str(step_s), "FAKE_TRAINER_TOKENS": str(tokens),
                **(env or {})},
        "compile_cache": None,
        "python": f"{sys.executable} {os.path.abspath(__file__)}",
        "workdir": deployed.workdir,
        "playbook_source": playbook_source,
    }
    store.create_run(playbook, host, config, now, run_id=run_id, bundle_hash=deployed.bundle_hash, run_dir=run_dir,
                     tmux_session=run_id, tmux_socket=socket)
    deploy.write_run_files(transport, run_dir, run_files(run_id, run_dir, config, socket))
    Tmux(inventory.get(host), inventory, socket).start(run_id, start_command(run_dir))
    return run_id


def start_fake_pair(store, inventory, hosts: list[str], trainer: dict, *, playbook: str = "fake-pair",
                    playbook_source: str | None = None, socket: str | None = None, step_s: float = 0.05,
                    port: int = 29500) -> str:
    """Record a run over ``hosts`` (rank r on hosts[r]) and start this fake trainer
    for each rank in tmux on its host, as the launcher starts a multi-host run's
    processes (a run directory and a session per host, ``<run id>-r<rank>`` past
    rank 0; RANK in each one's environment, so it writes its rank's status and
    metrics files). The processes never meet: stopping, probing and recording are
    what a test of the controller looks at. Returns the run id (state launching)."""
    from dflashctl.hosts import deploy
    from dflashctl.hosts.bundle import build_bundle
    from dflashctl.hosts.tmux import Tmux, socket_name
    from dflashctl.hosts.transport import connect
    from dflashctl.runs.runhost import run_files, start_command
    from dflashctl.store import new_run_id

    socket = socket or socket_name()
    bundle = build_bundle()
    now = time.time()
    run_id = new_run_id(playbook, now)
    python = f"{sys.executable} {os.path.abspath(__file__)}"
    sites = []
    for rank, host in enumerate(hosts):
        transport = connect(host, inventory)
        deployed = deploy.deploy_bundle(transport, bundle, inventory.get(host).workdir)
        sites.append({"rank": rank, "host": host, "python": python, "workdir": deployed.workdir,
                      "env": {"PYTHONPATH": deployed.bundle_dir, "FAKE_TRAINER_STEP_S": str(step_s)},
                      "run_dir": deploy.run_dir(deployed.workdir, run_id),
                      "session": run_id if rank == 0 else f"{run_id}-r{rank}", "transport": transport})
    config = {"trainer": trainer, "gpus": [], "env": {}, "compile_cache": None, "python": python,
              "workdir": sites[0]["workdir"], "playbook_source": playbook_source,
              "distributed": {"address": "127.0.0.1", "port": port,
                              "hosts": [{k: site[k] for k in ("rank", "host", "python", "workdir", "env")}
                                        for site in sites]}}
    store.create_run(playbook, hosts[0], config, now, run_id=run_id, bundle_hash=bundle.hash,
                     run_dir=sites[0]["run_dir"], tmux_session=run_id, tmux_socket=socket,
                     hosts=[{"rank": site["rank"], "host": site["host"], "run_dir": site["run_dir"],
                             "tmux_session": site["session"]} for site in sites])
    for site in sites:
        files = run_files(run_id, site["run_dir"], config, socket, rank=site["rank"], session=site["session"],
                          rendezvous_key="0" * 64)
        deploy.write_run_files(site["transport"], site["run_dir"], files)
        Tmux(inventory.get(site["host"]), inventory, socket).start(site["session"], start_command(site["run_dir"]))
    return run_id


def run(argv: list[str]) -> int:
    """``main``, ending as the real trainer does when a write finds the disk full
    (``contract.EXIT_DISK_FULL``, its message on stderr, status.json if it can)."""
    try:
        return main(argv)
    except OSError as e:
        if not contract.disk_full_error(e):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return contract.EXIT_DISK_FULL


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
