"""``python -m trainer.data``: the training-data tools (convert, regenerate).

The command line lives here, apart from ``trainer.data`` itself, so that the data
module never imports what reads it (``trainer.data.regenerate`` builds on ``trainer.data``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from trainer.data.converter import convert
from trainer.data.records import DataError


def main(argv: Optional[list[str]] = None) -> int:
    from dflashctl.core.contract import EXIT_DATA_ERROR

    parser = argparse.ArgumentParser(prog="python -m trainer.data", description="Training data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="tokenize chat JSONL ({\"prompt\", \"response\"}) into training shards")
    c.add_argument("input", help="JSONL file, one {\"prompt\": ..., \"response\": ...[, \"system\": ...]} per line")
    c.add_argument("out_dir", help="directory for shard-NNNNN.jsonl and manifest.json")
    c.add_argument("--tokenizer", required=True, help="local tokenizer directory (never downloaded)")
    c.add_argument("--shard-size", type=int, default=10000, help="samples per shard (default 10000)")
    c.add_argument("--error-budget", type=int, default=10, help="bad input lines skipped before giving up (default 10)")
    r = sub.add_parser("regenerate", help="the target writes the responses of the prompts (trainer/data/regenerate.py)")
    r.add_argument("input", help="'synthetic' (the built-in task's prompts), trainer shards (directory or glob: the "
                                 "tokens before each first loss token are the prompt), or JSONL of ShareGPT "
                                 "{\"conversations\": [...]} (SpecForge), OpenAI {\"messages\": [...]} or "
                                 "{\"prompt\": ...}: detected from the first line and said")
    r.add_argument("out_dir", help="directory for shard-NNNNN.jsonl and manifest.json (kept shards are resumed)")
    r.add_argument("--model", required=True, help="the target: a preset name (tiny, qwen3-0.6b, ...) or a local "
                                                  "model directory (its tokenizer and chat template are used)")
    r.add_argument("--config", help="a trainer config (JSON/YAML) to take data.regenerate and model from; the "
                                    "options given here win")
    r.add_argument("--max-new-tokens", type=int, help="tokens per response at most (default 256)")
    r.add_argument("--temperature", type=float, help="0: greedy (default); > 0: sampled, seeded per shard")
    r.add_argument("--top-p", type=float, help="sampling: the smallest set of tokens whose probability reaches P "
                                               "(default 1.0: all)")
    r.add_argument("--top-k", type=int, help="sampling: the K most likely tokens (default 0: all)")
    r.add_argument("--seed", type=int, help="sampling seed (default 0)")
    r.add_argument("--batch-size", type=int, help="prompts decoded together (default 16)")
    r.add_argument("--shard-size", type=int, help="prompts per output shard, the unit of resuming (default 256)")
    r.add_argument("--samples", type=int, help="prompts taken from the input at most (default all)")
    r.add_argument("--thinking", choices=["on", "off"], help="chat templates with a thinking switch: enable_thinking "
                                                             "(default: the template's own)")
    r.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    r.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's; 1 is fastest for a tiny "
                                               "target on a busy machine)")
    args = parser.parse_args(argv)
    if args.command == "regenerate":
        return _regenerate_command(args)
    try:
        manifest = convert(args.input, args.out_dir, args.tokenizer, args.shard_size, args.error_budget)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA_ERROR
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA_ERROR
    print(json.dumps({k: manifest[k] for k in ("samples", "tokens", "loss_tokens", "bad_records", "shards")}))
    return 0


def target_choice(name: str) -> dict:
    """``--model``: a local model directory, or a preset name; a path that is not a
    directory is named as such (never taken for a preset)."""
    from trainer.config import PRESETS, ConfigError

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return {"path": path, "preset": None}
    if name in PRESETS:
        return {"preset": name, "path": None}
    if os.sep in name or name.startswith((".", "~")):
        raise ConfigError([f"--model {name}: no such model directory"])
    raise ConfigError([f"--model {name}: neither a model directory here nor a preset ({', '.join(PRESETS)})"])


def _regenerate_command(args) -> int:
    from dflashctl.core.contract import EXIT_CONFIG_ERROR, EXIT_DATA_ERROR
    from trainer import config as config_mod

    try:
        raw = config_mod.load(args.config).to_dict() if args.config else {}
        model = raw.setdefault("model", {})
        model.update(target_choice(args.model))
        data = raw.setdefault("data", {})
        data["shards"] = None
        regen = data.get("regenerate") or {}
        for key in ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "batch_size", "shard_size", "samples",
                    "threads"):
            if getattr(args, key) is not None:
                regen[key] = getattr(args, key)
        if args.thinking:
            regen["thinking"] = args.thinking == "on"
        regen.update(source=args.input, out=os.path.abspath(args.out_dir))
        data["regenerate"] = regen
        cfg = config_mod.from_dict(raw)
    except (config_mod.ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    import torch

    from trainer.data.regenerate import regenerate

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        manifest = regenerate(args.input, args.out_dir, cfg, device,
                              log=lambda line: print(line, file=sys.stderr, flush=True))
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DATA_ERROR
    except config_mod.ConfigError as e:
        print("error: " + "\nerror: ".join(e.problems), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps({k: manifest[k] for k in ("samples", "tokens", "loss_tokens", "shards", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
