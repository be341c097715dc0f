"""``python -m trainer eval CKPT``: measured acceptance of a trained drafter.

For each prompt of the data (the tokens before a sample's first loss token; by
default the run's ``data.holdout`` samples, which it never trained on), the
frozen target and the drafter decode with real speculative decoding
(trainer/speculative.py), and the target alone decodes greedily as the reference
and the speed baseline. The report (``run_eval``, a JSON-able dict) holds:

- ``tau``: accepted draft tokens + 1 per verification step, pooled over prompts
  (``tau_mean``: the mean of the per-prompt taus), and ``accept_len_hist``, the
  distribution of accepted draft tokens per step (index k = k accepted, tau k + 1);
- ``tokens_per_target_forward``: new tokens / target forwards (prefill included);
- ``speed``: wall-clock tokens/s of both decoders on this hardware and the speed-up;
- ``greedy_identical``: at temperature 0, whether every prompt's output equals
  plain greedy decoding token for token (it must);
- ``training``: the trainer's own figure at the checkpoint's step (metrics.jsonl):
  accept_len and accept_len + 1 of the last line, and their mean over the last
  lines (one line covers only a few sequences);
- ``reference``: the drafter verified against the data instead of the target
  (teacher forced), pooled over the prompts: ``anchor_tau`` (mean over every
  response anchor of run + 1: the training estimator), ``harmonic_tau`` (1 / mean
  of 1 / (run + 1): what decoding measures when it lands on a position in
  proportion to 1 / its tau), ``chain_tau`` (following the data as decoding
  follows the target), and ``target_agreement`` (how often the target's greedy
  choice is the data's next token). They tell why tau and accept_len + 1 differ
  (trainer/SERVING_EXPORT.md).

``target_data`` writes synthetic shards whose responses the target itself wrote
(greedy), the data on which measured and training figures must agree.

Tau is accepted draft tokens + 1 per verification step, as published; the trainer's
``accept_len`` + 1 is its training-time estimate ("τ est", dflashctl.core.contract).

The report is handed over after every prompt (``on_prompt``; ``--out`` is rewritten
each time) with ``complete`` false until the last; past ``timeout`` no prompt is
begun and a Ctrl-C or SIGTERM ends the one in progress: ``stopped`` says which, and
the figures are those of the prompts measured.

Evaluation never changes a checkpoint or its run directory; the report goes where
the caller says (``--out``).
"""

from __future__ import annotations

import json
import os
import random
from typing import Callable, Optional

from trainer.config import ConfigError

EVAL_FORMAT = 1


# ---------------------------------------------------------------------------- data


def split_prompt(ids: list[int], loss_mask: list[int]) -> Optional[int]:
    """Index of the first response (loss) token, or None when there is no prompt
    before it or no response."""
    first = next((i for i, m in enumerate(loss_mask) if m), None)
    return first if first else None


def load_samples(cfg, data: Optional[str], vocab_size: int, mask_token_id: int, count: int,
                 log: Callable[[str], None] = print, run_dir: Optional[str] = None,
                 ) -> tuple[list[tuple[list[int], list[int]]], str]:
    """The first ``count`` usable samples of ``data`` (shards), or of the checkpoint's own
    data when ``data`` is None: its ``data.holdout`` samples, which it never trained on,
    when it held some out, else its training data (its shards, regenerated shards, or
    its synthetic task). Returns (samples, what they are, in words)."""
    import copy

    from trainer.data import build_source

    cfg = copy.deepcopy(cfg)
    if data:
        cfg.data.shards = data
        cfg.data.holdout = 0
    if run_dir:
        cfg.run_dir = run_dir
    source = build_source(cfg, vocab_size, mask_token_id, log)
    held = source.holdout if not data and source.holdout is not None else None
    dataset = held if held is not None else source.dataset
    where = data or (cfg.data.shards or ("regenerated" if cfg.data.regenerate else "synthetic"))
    what = f"{where} (the {len(held)} held-out samples)" if held is not None else \
        (where if data else f"{where} (training data: the run held none out, data.holdout)")
    out = []
    for i in range(len(dataset)):
        ids, mask = dataset.get(i)
        if split_prompt(ids, mask):
            out.append((list(ids), list(mask)))
        if len(out) == count:
            break
    if not out:
        raise ConfigError([f"--data: no sample with a prompt and a response in {where}"])
    return out, what


def target_data(target, out_dir: str, samples: int, prompt_len: int, new_tokens: int, warmup_tokens: int = 0,
                seed: int = 0, reserved: tuple[int, ...] = (), batch: int = 32) -> str:
    """Write shard-00000.jsonl: random prompts of ``prompt_len`` tokens, each followed
    by the target's greedy continuation of ``warmup_tokens + new_tokens`` tokens; the
    first ``warmup_tokens`` of it stay in the prompt (loss mask 0), the rest is the
    response. Responses written by the target itself are what the drafter must
    learn in the real recipe. Returns ``out_dir``."""
    import torch

    from dflashctl.core.contract import atomic_write_text

    rng = random.Random(f"target-data-{seed}")
    skip = set(reserved) | {0}
    usable = [t for t in range(target.vocab_size) if t not in skip]
    lines = []
    for begin in range(0, samples, batch):
        n = min(batch, samples - begin)
        prompts = torch.tensor([[rng.choice(usable) for _ in range(prompt_len)] for _ in range(n)], dtype=torch.long)
        full = target.greedy_generate(prompts, warmup_tokens + new_tokens).cpu().tolist()
        for ids in full:
            head = prompt_len + warmup_tokens
            lines.append(json.dumps({"input_ids": ids, "loss_mask": [0] * head + [1] * (len(ids) - head)},
                                    separators=(",", ":")) + "\n")
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_text(os.path.join(out_dir, "shard-00000.jsonl"), "".join(lines))
    return out_dir


# ---------------------------------------------------------------------------- training figure


def training_figure(ckpt: str, step: int, recent: int = 5) -> Optional[dict]:
    """The trainer's accept_len at ``step`` (the last metrics line at or before it) and
    its mean over the last ``recent`` lines: one line covers only log_every steps of
    a few sequences, and varies from line to line. Read from the run directory that
    holds the checkpoint; None when it has no metrics."""
    from dflashctl.core import contract

    run_dir = os.path.dirname(os.path.dirname(ckpt))
    by_step: dict[int, float] = {}
    try:
        with open(os.path.join(run_dir, contract.METRICS_FILE), encoding="utf-8") as f:
            for line in f:
                try:
                    m = json.loads(line)
                except ValueError:
                    continue
                if isinstance(m, dict) and isinstance(m.get("step"), int) and m.get("accept_len") is not None \
                        and m["step"] <= step:
                    by_step[m["step"]] = m["accept_len"]  # a resumed run's repeat of a step wins
    except OSError:
        return None
    if not by_step:
        return None
    steps = sorted(by_step)
    last = by_step[steps[-1]]
    window = [by_step[s] for s in steps[-recent:]]
    mean = sum(window) / len(window)
    return {"step": steps[-1], "accept_len": last, "tau_estimate": last + 1,
            "accept_len_recent": mean, "tau_estimate_recent": mean + 1, "recent_from_step": steps[-len(window)]}


# ---------------------------------------------------------------------------- the evaluation


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def reference_figures(target, drafter, ids: list[int], mask: list[int], start: int) -> dict:
    """The drafter against the data itself (module docstring: ``reference``), for one
    sample; the ``_sum`` and ``_count`` fields let run_eval pool samples."""
    import torch

    from trainer.speculative import anchor_runs, chain_steps

    runs = anchor_runs(target, drafter, ids, mask)
    taus = [r + 1 for r in runs.values()]
    chain = chain_steps(runs, start)
    choice = target.greedy_next(torch.tensor([ids]))[0].tolist()
    scored = [j for j in range(start, len(ids)) if mask[j]]
    agree = sum(choice[j - 1] == ids[j] for j in scored)
    return {
        "anchors": len(taus),
        "anchor_tau": _mean(taus),
        "harmonic_tau": len(taus) / sum(1 / t for t in taus) if taus else None,
        "chain_tau": _mean(chain),
        "target_agreement": agree / len(scored) if scored else None,
        "_sums": {"anchor": sum(taus), "inverse": sum(1 / t for t in taus), "chain": sum(chain),
                  "chain_steps": len(chain), "agree": agree, "scored": len(scored)},
    }


def pooled_reference(rows: list[dict]) -> dict:
    """The reference figures over all samples at once (every anchor, step and token
    counts once, as ``tau`` pools verification steps)."""
    total = {k: sum(r["_sums"][k] for r in rows) for k in rows[0]["_sums"]}
    anchors = sum(r["anchors"] for r in rows)
    return {
        "anchors": anchors,
        "anchor_tau": total["anchor"] / anchors if anchors else None,
        "harmonic_tau": anchors / total["inverse"] if total["inverse"] else None,
        "chain_tau": total["chain"] / total["chain_steps"] if total["chain_steps"] else None,
        "target_agreement": total["agree"] / total["scored"] if total["scored"] else None,
    }


class EvalProgress:
    """What has been measured so far; ``report()`` is the report of those prompts
    (a partial one until every prompt is done)."""

    def __init__(self, loaded, data: Optional[str], planned: int, temperature: float, seed: int, greedy: bool,
                 reference: bool, source: str):
        self.loaded, self.data, self.planned, self.source = loaded, data, planned, source
        self.temperature, self.seed, self.greedy, self.reference = temperature, seed, greedy, reference
        self.block = loaded.drafter.block_size
        self.per_prompt: list[dict] = []
        self.hist = [0] * self.block
        self.spec_s = self.greedy_s = 0.0
        self.new_total = self.forwards_total = 0
        self.mismatched: list[int] = []
        self.stopped: Optional[str] = None  # None, "timeout" or "interrupted"

    def add(self, row: dict) -> None:
        for a in row["accepted"]:
            self.hist[a] += 1
        self.spec_s += row["seconds"]
        self.greedy_s += row.get("greedy_seconds") or 0.0
        self.new_total += row["new_tokens"]
        self.forwards_total += row["target_forwards"]
        if row.get("identical") is False:
            self.mismatched.append(row["index"])
        self.per_prompt.append(row)

    def report(self) -> dict:
        target, drafter, meta = self.loaded.target, self.loaded.drafter, self.loaded.meta
        hist, per_prompt, greedy = self.hist, self.per_prompt, self.greedy
        steps = sum(hist)
        spec_s, greedy_s, new_total = self.spec_s, self.greedy_s, self.new_total
        report = {
            "format": EVAL_FORMAT,
            "checkpoint": self.loaded.path,
            "step": meta.get("step"),
            "device": str(target.device),
            "dtype": str(target.dtype).replace("torch.", ""),
            "data": self.source,
            "temperature": self.temperature,
            "seed": self.seed,
            "block_size": self.block,
            "mask_token_id": drafter.mask_token_id,
            "prompts": len(per_prompt),
            "prompts_planned": self.planned,
            "complete": len(per_prompt) == self.planned,
            "stopped": self.stopped,
            "new_tokens": new_total,
            "steps": steps,
            "tau": sum((k + 1) * c for k, c in enumerate(hist)) / steps if steps else None,
            "tau_mean": _mean([r["tau"] for r in per_prompt]),
            "tau_per_prompt": [r["tau"] for r in per_prompt],
            "accept_len_hist": list(hist),
            "tokens_per_target_forward": new_total / self.forwards_total if self.forwards_total else None,
            "greedy_identical": (not self.mismatched) if greedy and self.temperature == 0 and per_prompt else None,
            "mismatched_prompts": list(self.mismatched),
            "speed": {
                "speculative_s": spec_s,
                "speculative_tok_s": new_total / spec_s if spec_s else None,
                "greedy_s": greedy_s if greedy else None,
                "greedy_tok_s": new_total / greedy_s if greedy and greedy_s else None,
                "speedup": greedy_s / spec_s if greedy and spec_s else None,
            },
            "training": training_figure(self.loaded.path, int(meta.get("step") or 0)),
            "reference": None,
            "per_prompt": [{k: v for k, v in r.items() if k != "reference"} for r in per_prompt],
        }
        if self.reference and per_prompt:
            report["reference"] = pooled_reference([r["reference"] for r in per_prompt])
            for out, row in zip(report["per_prompt"], per_prompt):
                out["reference"] = {k: v for k, v in row["reference"].items() if k != "_sums"}
        return report


def run_eval(path: str, data: Optional[str] = None, prompts: int = 20, max_new_tokens: int = 256,
             temperature: float = 0.0, seed: int = 0, device: str = "cpu", target_path: Optional[str] = None,
             greedy: bool = True, reference: bool = True, log: Callable[[str], None] = lambda line: None,
             timeout: Optional[float] = None, on_prompt: Callable[[dict], None] = lambda report: None,
             clock: Callable[[], float] = None) -> dict:
    """Evaluate checkpoint (or run directory) ``path``; returns the report (module docstring).

    After each prompt ``on_prompt`` gets the report so far (``complete`` false), and
    ``log`` one progress line. Past ``timeout`` seconds no new prompt is begun, and a
    KeyboardInterrupt (Ctrl-C, or SIGTERM as the command maps it) ends the prompt in
    progress: either way the report holds what was measured, with ``stopped`` saying
    why it is short."""
    import time

    import torch

    from trainer import restore
    from trainer.speculative import greedy_generate, speculative_generate

    clock = clock or time.monotonic
    began = clock()
    loaded = restore.load(path, device, target_path=target_path)
    target, drafter = loaded.target, loaded.drafter
    if target.device.type == "cuda":
        drafter.to(target.dtype)  # an engine runs the drafter in the target's precision
    block = drafter.block_size
    samples, source = load_samples(loaded.cfg, data, target.vocab_size, drafter.mask_token_id, prompts, log,
                                   run_dir=os.path.dirname(os.path.dirname(loaded.path)))
    generator = torch.Generator(device=target.device).manual_seed(seed)
    log(f"eval {loaded.path}: {len(samples)} prompts of {source}, block {block}, temperature {temperature}, "
        f"{target.device}" + (f", budget {timeout:.0f}s" if timeout else ""))
    progress = EvalProgress(loaded, data, len(samples), temperature, seed, greedy, reference, source)

    try:
        # ---- warm-up (first calls pay for lazy initialisation and kernel selection), not timed
        ids0, mask0 = samples[0]
        p0 = split_prompt(ids0, mask0)
        speculative_generate(target, drafter, ids0[:p0], min(2 * block, 16), temperature, generator)
        greedy_generate(target, ids0[:p0], 4)

        for index, (ids, mask) in enumerate(samples):
            if timeout is not None and clock() - began > timeout:
                progress.stopped = "timeout"
                log(f"eval: the budget of {timeout:.0f}s is spent after {index} of {len(samples)} prompts; "
                    "reporting those")
                break
            start = split_prompt(ids, mask)
            prompt, n_new = ids[:start], min(max_new_tokens, len(ids) - start)
            spec = speculative_generate(target, drafter, prompt, n_new, temperature, generator)
            row = {"index": index, "prompt_tokens": len(prompt), "new_tokens": len(spec.tokens), "tau": spec.tau,
                   "accepted": spec.accepted, "target_forwards": spec.target_forwards,
                   "tokens_per_forward": spec.tokens_per_forward, "seconds": spec.seconds}
            if greedy:
                base = greedy_generate(target, prompt, n_new)
                row["greedy_seconds"] = base.seconds
                if temperature == 0:
                    row["identical"] = base.tokens == spec.tokens
            if reference:
                row["reference"] = reference_figures(target, drafter, ids, mask, start)
            progress.add(row)
            report = progress.report()
            on_prompt(report)
            log(f"prompt {index + 1}/{len(samples)}: tau {spec.tau or 0:.2f}, {len(spec.tokens)} tokens in "
                f"{spec.target_forwards} target forwards; so far tau {_fmt(report['tau'])}"
                + (f", {report['speed']['speedup']:.2f}x greedy" if report["speed"]["speedup"] else "")
                + f" ({clock() - began:.0f}s)")
    except KeyboardInterrupt:
        progress.stopped = "interrupted"
        log(f"eval: interrupted after {len(progress.per_prompt)} of {len(samples)} prompts; reporting those")
    return progress.report()


# ---------------------------------------------------------------------------- text


def _fmt(value, spec=".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_text(report: dict) -> str:
    """The report for people: the figures, then what explains a gap."""
    sp, tr, ref = report["speed"], report.get("training"), report.get("reference")
    lines = [
        f"checkpoint  {report['checkpoint']} (step {report['step']})",
        f"decoding    {report['prompts']} prompts, {report['new_tokens']} new tokens, block {report['block_size']}, "
        f"temperature {report['temperature']}, {report['device']} {report['dtype']}",
        f"tau         {_fmt(report['tau'])} per verification step (mean over prompts {_fmt(report['tau_mean'])}); "
        f"{_fmt(report['tokens_per_target_forward'])} tokens per target forward",
        "accepted    " + "  ".join(f"{k}:{c}" for k, c in enumerate(report["accept_len_hist"]) if c)
        + "   (draft tokens accepted per step: count)",
        f"speed       speculative {_fmt(sp['speculative_tok_s'], '.1f')} tok/s, greedy {_fmt(sp['greedy_tok_s'], '.1f')} "
        f"tok/s, speed-up {_fmt(sp['speedup'])}x",
    ]
    if not report.get("complete", True):
        lines.append(f"partial     {report['prompts']} of {report['prompts_planned']} prompts measured "
                     f"(stopped: {report.get('stopped') or 'unknown'})")
    if report["greedy_identical"] is not None:
        lines.append("greedy      " + ("identical to plain greedy decoding on every prompt" if report["greedy_identical"]
                                       else f"DIFFERS from plain greedy decoding on prompts {report['mismatched_prompts']}"))
    if tr:
        lines.append(f"training    τ est {_fmt(tr['tau_estimate'])} (accept_len {_fmt(tr['accept_len'])} + 1) at step "
                     f"{tr['step']} ({_fmt(tr['tau_estimate_recent'])} over the lines since step "
                     f"{tr['recent_from_step']})")
        from dflashctl.core.contract import tau_gap

        gap = tau_gap(tr["tau_estimate"], report["tau"])
        if gap:
            lines.append("            " + gap)
    if ref:
        lines.append(f"reference   drafter against the data: anchor tau {_fmt(ref['anchor_tau'])}, harmonic "
                     f"{_fmt(ref['harmonic_tau'])}, chain {_fmt(ref['chain_tau'])}; the target's greedy choice is the "
                     f"data's next token {_fmt(100 * ref['target_agreement'] if ref['target_agreement'] is not None else None, '.0f')}% of the time")
        if ref["target_agreement"] is not None and ref["target_agreement"] < 0.9:
            lines.append("            the data was not written by this target: the drafter learned the data, the "
                         "target decodes otherwise, so tau stays low whatever accept_len says")
    return "\n".join(lines)


def report_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True)
