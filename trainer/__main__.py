"""python -m trainer --config FILE [--run-dir DIR] [--resume auto|never] [--steps N] [--print-config]

and, on a checkpoint (or a run directory: its newest checkpoint):

    python -m trainer info CKPT [--json]              what it holds and what serving needs
    python -m trainer export CKPT OUT [--engine ...]   a directory an inference engine loads
    python -m trainer eval CKPT [--data SHARDS] ...    measured acceptance and speed-up
"""

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

from dflashctl.core import contract
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
        epilog=config_keys_help() + "\n\nexit codes: " + ", ".join(f"{c} {m}" for c, m in contract.EXIT_MEANINGS.items())
        + "\n\non a checkpoint: python -m trainer {info,export,eval} --help",
    )
    p.add_argument("--config", help="trainer config, JSON or YAML (default: RUN_DIR/config.json)")
    p.add_argument("--run-dir", help="run directory for status.json, metrics.jsonl, checkpoints/ (default: the config's run_dir)")
    p.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from the newest complete checkpoint in the run directory (default); never: start fresh")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (defaults filled in) and exit")
    p.add_argument("--standby", metavar="TOKEN", help="import everything, then wait until RUN_DIR/standby.TOKEN.go "
                   "appears and train from there (a restart that pays no import; trainer/standby.py)")
    return p.parse_args(argv)


def stand_by(args) -> int | None:
    """``--standby``: None once this process is to train, else its exit code (nothing to wait for)."""
    from trainer import standby

    run_dir = os.path.abspath(os.path.expanduser(args.run_dir or "."))
    try:
        cache_dir = config_mod.load(args.config or os.path.join(run_dir, contract.CONFIG_FILE)).compile.cache_dir
    except (config_mod.ConfigError, OSError, ValueError):
        cache_dir = None  # read again, and reported, when it trains
    if (code := refuse_shared_dirs(run_dir, cache_dir)) is not None:
        return code
    return None if standby.wait(run_dir, args.standby, cache_dir) else contract.EXIT_DONE


def refuse_shared_dirs(run_dir: str, cache_dir: str | None) -> int | None:
    """None once the run directory and the compile caches are this user's alone
    (``contract.private_dir``: created 0700, or refused when another user owns them
    or may write them: what such a user put there would run here); else
    EXIT_CONFIG_ERROR, having said which path, its owner and the fix."""
    try:
        contract.private_dir(run_dir, "run directory")
        for what, path in (("compile cache (compile.cache_dir)", cache_dir),
                           ("compile cache (TORCHINDUCTOR_CACHE_DIR)", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))):
            if path:
                contract.private_dir(path, what)
    except contract.UnsafeDirectory as e:
        print(f"error: UnsafeDirectory: {e}", file=sys.stderr, flush=True)
        return contract.EXIT_CONFIG_ERROR
    return None


# ---------------------------------------------------------------------------- checkpoint commands


def subcommand_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Commands on a trained checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    ckpt_help = "a checkpoint directory (RUN_DIR/checkpoints/step-N) or a run directory (its newest checkpoint)"

    info = sub.add_parser("info", help="what a checkpoint holds and what an inference engine needs to serve it")
    info.add_argument("checkpoint", help=ckpt_help)
    info.add_argument("--json", action="store_true", help="machine-readable output")

    ex = sub.add_parser("export", help="write the drafter as an engine-loadable directory (config.json + model.safetensors)")
    ex.add_argument("checkpoint", help=ckpt_help)
    ex.add_argument("out", help="output directory (created; refused when it exists and is not empty, unless --force)")
    ex.add_argument("--engine", choices=["vllm", "sglang", "zlab", "speculators"],
                    help="the engine that will run the drafter: picks the layout (speculators: vLLM speculators'; the "
                         "others: z-lab's DFlash layout), refuses a drafter that engine would run otherwise than trained "
                         "(with the reason and the setting that fits) and writes the causality keys it reads")
    ex.add_argument("--format", choices=["dflash", "speculators"],
                    help="the layout without naming an engine (default dflash, checked for vLLM and SGLang; "
                         "speculators checked for speculators)")
    ex.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                    help="tensor dtype; auto: the training compute dtype (bfloat16 on GPU runs, float32 on CPU runs)")
    ex.add_argument("--verifier", metavar="NAME_OR_PATH",
                    help="speculators: the verifier the config names, which speculators resolves from the directory "
                         "it runs in: a hub id (Qwen/Qwen3-8B) or a path (written absolute); required for a target "
                         "loaded from a directory")
    ex.add_argument("--eval", metavar="REPORT", dest="eval_report",
                    help="the eval report (python -m trainer eval --json --out FILE) whose tau the model card shows; "
                         "default: the run directory's eval.json when it measured this checkpoint")
    ex.add_argument("--target", metavar="PATH", help="the target model directory on this machine, when it moved since "
                                                      "training (speculators copies its embeddings and lm_head)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    ex.add_argument("--json", action="store_true", help="machine-readable output")

    ev = sub.add_parser("eval", help="speculative decoding with the frozen target: measured tau, tokens per target "
                                     "forward, speed-up over greedy, agreement with training")
    ev.add_argument("checkpoint", help=ckpt_help)
    ev.add_argument("--data", metavar="SHARDS", help="shards (directory or glob, trainer/data/ format); prompts are the "
                                                     "tokens before each sample's first loss token (default: the run's own data)")
    ev.add_argument("--prompts", type=int, default=20, help="number of prompts (default 20)")
    ev.add_argument("--max-new-tokens", type=int, default=256,
                    help="tokens generated per prompt, at most the sample's response length (default 256)")
    ev.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy verification (output identical to greedy decoding); > 0: sampling with the "
                         "speculative rejection rule (default 0)")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ev.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    ev.add_argument("--target", metavar="PATH", help="the target model directory on this machine, when it moved since training")
    ev.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's); 1 is fastest for small "
                                                "models on a busy machine")
    ev.add_argument("--timeout", type=float, metavar="SECONDS", help="begin no new prompt after this many seconds; "
                                                                     "the report holds the prompts measured")
    ev.add_argument("--no-greedy", action="store_true", help="skip plain greedy decoding (no speed-up, no identity check)")
    ev.add_argument("--no-reference", action="store_true", help="skip the drafter-against-data figures")
    ev.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE, after every prompt (complete: "
                                                  "false until the last): a timeout or Ctrl-C keeps what was measured")
    ev.add_argument("--json", action="store_true", help="print the JSON report instead of text")
    return p


def run_subcommand(argv: list[str]) -> int:
    args = subcommand_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from trainer.config import ConfigError

    hf_logging.disable_progress_bar()  # loading bars would bury the report

    try:
        if args.command == "info":
            from trainer import info

            result = info.describe(args.checkpoint)
            # A checkpoint is data someone else may have written: its text is shown, never obeyed.
            print(json.dumps(result, indent=2, sort_keys=True) if args.json else contract.printable(info.format_text(result)))
        elif args.command == "export":
            from trainer import export

            result = export.export(args.checkpoint, args.out, args.format, args.dtype, args.target, args.force,
                                   engine=args.engine, verifier=args.verifier,
                                   eval_report=args.eval_report)
            if args.json:
                print(json.dumps(result, indent=2, sort_keys=True))
            else:
                print(contract.printable(f"exported {result['checkpoint']} as {result['format']} for "
                                         f"{', '.join(result['engines'])} ({result['dtype']}, "
                                         f"{result['tensors']} tensors) to {result['out']}"))
                for line in result["warnings"]:
                    print(f"warning: {contract.printable(line)}", file=sys.stderr)
        else:
            import torch

            from trainer import eval as eval_mod

            device = args.device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if args.threads:
                torch.set_num_threads(args.threads)
            def log(line: str) -> None:  # progress on stderr: stdout is the report
                print(line, file=sys.stderr, flush=True)

            def keep(partial: dict) -> None:
                if args.out:
                    contract.atomic_write_text(args.out, eval_mod.report_json(partial) + "\n")

            # SIGTERM (a timeout, a stop) ends the eval as Ctrl-C does: with the report of what was measured.
            signal.signal(signal.SIGTERM, lambda signum, frame: signal.default_int_handler(signum, frame))
            report = eval_mod.run_eval(args.checkpoint, args.data, args.prompts, args.max_new_tokens, args.temperature,
                                       args.seed, device, args.target, greedy=not args.no_greedy,
                                       reference=not args.no_reference, log=log, timeout=args.timeout,
                                       on_prompt=keep)
            if args.out:
                contract.atomic_write_text(args.out, eval_mod.report_json(report) + "\n")
            print(eval_mod.report_json(report) if args.json else contract.printable(eval_mod.format_text(report)))
    except ConfigError as e:
        print(contract.printable("error: " + "\nerror: ".join(e.problems)), file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    except OSError as e:
        print(f"error: {contract.printable(e)}", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    except Exception as e:  # noqa: BLE001 - a message, not a traceback, unless asked for
        from trainer.data import DataError

        if os.environ.get("DFLASHCTL_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {contract.printable(e)}", file=sys.stderr)
        return contract.EXIT_DATA_ERROR if isinstance(e, DataError) else contract.EXIT_CRASH
    return contract.EXIT_DONE


SUBCOMMANDS = ("info", "export", "eval")


# ---------------------------------------------------------------------------- training


def own_run_dir(run_dir: str, standby_token) -> int | None:
    """Take the run directory's lock (trainer/rundir_lock.py): None once this process
    owns it, else EXIT_RUN_DIR_BUSY, having written nothing of the live trainer's. A
    standby woken beside a live trainer also takes back its went file, so its wrapper
    does not write an exit code for the run."""
    from trainer import distributed, rundir_lock

    try:
        rundir_lock.take(run_dir, distributed.env_rank())
    except rundir_lock.Busy as e:
        if standby_token:
            try:
                os.unlink(os.path.join(run_dir, contract.standby_went(standby_token)))
            except OSError:
                pass
        print(f"error: RunDirBusy: {e}", file=sys.stderr, flush=True)
        return contract.EXIT_RUN_DIR_BUSY
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv)
    args = parse_args(argv)
    if args.standby and (code := stand_by(args)) is not None:
        return code
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
    if (code := refuse_shared_dirs(run_dir, cfg.compile.cache_dir)) is not None:
        return code
    if (code := own_run_dir(run_dir, args.standby)) is not None:
        return code
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
