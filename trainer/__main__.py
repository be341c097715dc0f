"""python -m trainer --config FILE [--run-dir DIR] [--resume auto|never] [--steps N] [--print-config]"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import faulthandler
import inspect
import json
import os
import signal
import sys
import typing

from dflashctl import contract
from trainer import config as config_mod


def config_keys_help() -> str:
    """Every config key with its default and docstring (read from trainer/config.py)."""
    docs: dict[tuple[str, str], str] = {}
    for node in ast.parse(inspect.getsource(config_mod)).body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[(node.name, a.target.id)] = " ".join(str(b.value.value).split())
    lines = ["config keys (JSON or YAML; a playbook's 'trainer:' section has the same shape):"]
    hints = typing.get_type_hints(config_mod.TrainerConfig)
    for section in dataclasses.fields(config_mod.TrainerConfig):
        cls = hints[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        defaults = cls()
        for f in dataclasses.fields(cls):
            doc = docs.get((cls.__name__, f.name))
            lines.append(f"  {section.name}.{f.name} = {json.dumps(getattr(defaults, f.name))}" + (f"\n      {doc}" if doc else ""))
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m trainer", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a DFlash drafter (threaded: target threads feed drafter replica threads).",
        epilog=config_keys_help() + "\n\nexit codes: " + ", ".join(f"{c} {m}" for c, m in contract.EXIT_MEANINGS.items()),
    )
    p.add_argument("--config", help="trainer config, JSON or YAML (default: RUN_DIR/config.json)")
    p.add_argument("--run-dir", help="run directory for status.json, metrics.jsonl, checkpoints/ (default: the config's run_dir)")
    p.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from the newest complete checkpoint in the run directory (default); never: start fresh")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (defaults filled in) and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = args.config or (os.path.join(args.run_dir, contract.CONFIG_FILE) if args.run_dir else None)
    try:
        if not path:
            raise config_mod.ConfigError(["--config: no config file given (and no --run-dir holding config.json)"])
        cfg = config_mod.load(path)
        if args.steps is not None:
            cfg.train.steps = args.steps
            cfg.check()
    except (config_mod.ConfigError, OSError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    run_dir = os.path.abspath(os.path.expanduser(args.run_dir or cfg.run_dir))
    cfg.run_dir = run_dir
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
        return contract.EXIT_DONE
    os.makedirs(run_dir, exist_ok=True)
    if not os.path.exists(os.path.join(run_dir, contract.CONFIG_FILE)):
        config_mod.save(cfg, os.path.join(run_dir, contract.CONFIG_FILE))

    # `kill -USR1 PID` prints every thread's stack into the log without stopping the
    # run: the first thing to look at when a run hangs (the supervisor asks for it on a stall).
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    from trainer.train import run  # imports torch: after the cheap checks

    return run(cfg, run_dir, args.resume)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: interpreter teardown with a worker thread still inside a torch
    # kernel can abort ("terminate called without an active exception") and replace
    # the exit code the controller reads.
    os._exit(code)
