"""A run's drafter evaluated on its host: speculative decoding, measured prompt by prompt.

``eval_run`` starts ``python -m trainer eval`` in a tmux session beside the run's
(``<session>-eval``), reads its report as it grows, stores it with the run after
every prompt and says each one. A timeout or Ctrl-C keeps what was measured.

Each eval is one attempt with its own id (``new_attempt``): its report, log and exit
status are files named by it (``eval_files``), so a reader never takes another
attempt's file, whatever is left in the run directory and however late the eval's
shell starts. The store keeps every attempt with its id.
"""

from __future__ import annotations

import secrets
import shlex
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from dflashctl.core import contract
from dflashctl.core.units import fmt_bytes
from dflashctl.hosts.transport.limits import EVAL_LOG, EVAL_REPORT
from dflashctl.runs.access import LaunchError, Progress, host_transport, part_tmux, quiet
from dflashctl.runs.files import SECRETS_FILE, posixpath_join
from dflashctl.store import Run, Store

if TYPE_CHECKING:
    from dflashctl.config import EvalSettings, Inventory
    from dflashctl.hosts.transport import Transport

EVAL_POLL_SECONDS = 2.0


class EvalFiles(NamedTuple):
    """One attempt's files in the run directory."""

    report: str  # the trainer's report, rewritten after every prompt (complete: false until the last)
    log: str  # its progress lines and errors
    exit: str  # its exit status, once it has ended


def new_attempt(now: float) -> str:
    """An eval attempt's id: its UTC start and 6 random hex digits (sortable, and
    safe in a file name and a shell word)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)


def eval_files(attempt: str) -> EvalFiles:
    return EvalFiles(f"eval-{attempt}.json", f"eval-{attempt}.log", f"eval-{attempt}.exit")


def eval_session(run: Run) -> str:
    return f"{run.tmux_session or run.id}-eval"


def eval_argv(run: Run, settings: "EvalSettings", python: str, attempt: str) -> list[str]:
    """argv running ``python -m trainer eval`` in the run directory on its host, with
    the run's own environment (bundle on PYTHONPATH, its GPUs): the report goes to
    the attempt's report file (after every prompt), progress to its log, the exit
    status to its exit file (``eval_files``)."""
    files = eval_files(attempt)
    env = [f"{k}={v}" for k, v in (run.config.get("env") or {}).items()]
    trainer = [*shlex.split(python), "-m", "trainer", "eval", run.run_dir, "--json", "--out", files.report,
               "--prompts", str(settings.prompts), "--max-new-tokens", str(settings.max_new_tokens),
               "--temperature", repr(float(settings.temperature)),
               # The trainer stops itself in time, with the report of the prompts it measured.
               "--timeout", repr(eval_budget(float(settings.timeout)))]
    if settings.data:
        trainer += ["--data", settings.data]
    if settings.threads:
        trainer += ["--threads", str(settings.threads)]
    # The playbook's secrets come from the run's own secrets.env, never the command line.
    script = (f'cd "$1" && shift && {{ if [ -f {SECRETS_FILE} ]; then . ./{SECRETS_FILE}; fi; '
              f'env "$@" > /dev/null 2> {files.log}; echo $? > {files.exit}.tmp && mv -f {files.exit}.tmp {files.exit}; }}')
    return ["sh", "-c", script, "dflashctl-eval", run.run_dir, *env, *trainer]


def eval_budget(timeout: float) -> float:
    """The trainer's own budget inside the controller's ``timeout``: room left for its
    last prompt (it begins none past its budget) and for loading the models."""
    return max(1.0, 0.8 * timeout - 5.0)


EVAL_REPORT_BYTES = 4 << 20  # a report of a few hundred prompts is some KiB; larger is not read

# One round trip: the exit status (or '-'), then the report's size, then the report
# so far (or nothing; nothing either when it is larger than $2 bytes). $3: the
# attempt's exit file, $4: its report: never another attempt's.
_READ_EVAL = ('cd "$1" && { c=$(head -c 32 "$3" 2>/dev/null | tr -dc 0-9-); echo "${c:--}"; '
              's=$(wc -c < "$4" 2>/dev/null || echo 0); s=$(echo $s); echo "$s"; '
              '[ "$s" -gt "$2" ] || cat "$4" 2>/dev/null; }; exit 0')


def _read_eval(transport: "Transport", run: Run, attempt: str) -> tuple[int | None, dict[str, Any] | None]:
    """(the attempt's exit status, None while it runs; the report it wrote last, if any).
    LaunchError when the report is larger than EVAL_REPORT_BYTES."""
    files = eval_files(attempt)
    answer = transport.run(["sh", "-c", _READ_EVAL, "dflashctl-eval", run.run_dir, str(EVAL_REPORT_BYTES),
                            files.exit, files.report], timeout=30, check=False, limit=EVAL_REPORT)
    head, size, text = (answer.stdout.split("\n", 2) + ["", ""])[:3]
    code = int(head) if head.strip().lstrip("-").isdigit() else None
    if size.strip().isdigit() and int(size) > EVAL_REPORT_BYTES:
        raise LaunchError(f"{files.report} on {run.host} is {fmt_bytes(int(size))}; at most "
                          f"{fmt_bytes(EVAL_REPORT_BYTES)} of an evaluation report is read",
                          hint=f"look at {posixpath_join(run.run_dir, files.report)} on {run.host}: the trainer's "
                          "report is a few KiB")
    report = _json_report(text)
    if report is not None:
        try:
            check_report(report, block_size_of(run))
        except contract.ContractError as e:
            raise LaunchError(f"the evaluation report {posixpath_join(run.run_dir, files.report)} on {run.host} is "
                              f"refused: {e.reason}; nothing of it is stored",
                              hint="the trainer's eval writes a tau between 1 and the block size: look at the file, "
                                   "and at what else writes into the run directory") from None
    return code, report


def _prompt_line(report: dict[str, Any], row: dict[str, Any]) -> str:
    speed = (report.get("speed") or {}).get("speedup")
    return (f"prompt {row.get('index', 0) + 1}/{report.get('prompts_planned')}: tau {_two(row.get('tau'))}, "
            f"{row.get('new_tokens')} tokens in {row.get('target_forwards')} target forwards; so far tau "
            f"{_two(report.get('tau'))}" + (f", {speed:.2f}x greedy" if isinstance(speed, (int, float)) else ""))


def eval_run(run_id: str, store: Store, inventory: "Inventory", settings: "EvalSettings",
             progress: Progress | None = None, *, clock: Callable[[], float] = time.time,
             poll: float = EVAL_POLL_SECONDS) -> dict[str, Any]:
    """Evaluate the run's drafter (its newest checkpoint) with real speculative decoding
    on its host, in a tmux session beside the run's: each prompt is said as it is
    measured and the report so far stored with the run, so a timeout or Ctrl-C keeps
    what was measured. Returns the report (``complete`` false when it ended early)."""
    say = progress or quiet
    run = store.get_run(run_id)
    transport = host_transport(run.host, inventory)
    tmux = part_tmux(run, inventory)
    python = run.config.get("python") or transport.host.python
    session = eval_session(run)
    attempt = new_attempt(clock())
    files = eval_files(attempt)
    say("eval", f"speculative decoding with {run.id}'s drafter on {run.host} ({settings.prompts} prompts, "
        f"{settings.max_new_tokens} new tokens each, budget {settings.timeout:.0f}s; eval {attempt}, tmux session "
        f"{session})")
    tmux.kill(session)
    tmux.start(session, shlex.join(eval_argv(run, settings, python, attempt)))
    deadline = time.monotonic() + float(settings.timeout) + 10.0
    row: int | None = None
    report: dict[str, Any] | None = None
    seen, code, stopped = 0, None, None

    def keep(latest: dict[str, Any] | None, tell: Progress) -> None:
        """Store a newer report, then say its new prompts (stored first: a Ctrl-C may
        come while they are said)."""
        nonlocal row, report, seen
        if not latest or not latest.get("prompts") or latest == report:
            return
        new = (latest.get("per_prompt") or [])[seen:]
        report, seen = latest, int(latest.get("prompts") or 0)
        if row is None:
            row = store.add_eval(run.id, clock(), report=report, attempt=attempt)
        else:
            store.update_eval(row, clock(), report=report)
        for measured in new:
            tell("eval", _prompt_line(latest, measured))

    try:
        while True:
            code, latest = _read_eval(transport, run, attempt)
            keep(latest, say)
            if code is not None:
                break
            if time.monotonic() > deadline:
                stopped = "timeout"
                break
            if not tmux.has_session(session):  # ended without writing its exit status: killed
                code, latest = _read_eval(transport, run, attempt)
                keep(latest, say)
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        stopped = "interrupted"
    except LaunchError as e:  # a report refused: said, recorded, and its session ended
        tmux.kill(session)
        store.add_eval(run.id, clock(), error=str(e), attempt=attempt)
        store.add_event(run.id, "eval", str(e), clock(), "warning")
        raise
    if code is None:
        tmux.kill(session)
        keep(_read_eval(transport, run, attempt)[1], say if stopped != "interrupted" else quiet)  # written since the last look
    if stopped or code is None or code != 0 or not (report or {}).get("complete", False):
        if report and report.get("prompts"):
            report = {**report, "complete": False, "stopped": report.get("stopped") or stopped or f"exit {code}"}
            store.update_eval(row, clock(), report=report)
        else:
            tail = _eval_log_tail(transport, run, files.log)
            error = (f"the evaluation {'failed (exit ' + str(code) + ')' if code else stopped or 'ended'} before its "
                     f"first prompt: {tail.splitlines()[-1] if tail else 'no output'}")
            store.add_eval(run.id, clock(), error=error, attempt=attempt)
            store.add_event(run.id, "eval", error, clock(), "warning", {"stderr_tail": tail, "attempt": attempt})
            if stopped == "interrupted":
                raise KeyboardInterrupt
            raise LaunchError(error, hint=f"its log: {posixpath_join(run.run_dir, files.log)} on {run.host}; by hand: "
                              f"cd {shlex.quote(run.run_dir)} && "
                              f"{shlex.join([*shlex.split(python), '-m', 'trainer', 'eval', run.run_dir])}")
    speed = report.get("speed") or {}
    partial = "" if report.get("complete", True) else \
        f" (partial: {report.get('prompts')} of {report.get('prompts_planned')} prompts, {report.get('stopped')})"
    tau, tau_est = report.get("tau"), contract.tau_estimate((report.get("training") or {}).get("accept_len"))
    summary = (f"measured tau {_two(tau)} (τ est {_two(tau_est)}, accept_len + 1) at step {report.get('step')}{partial}"
               + (f", {speed['speedup']:.2f}x greedy decoding" if isinstance(speed.get("speedup"), (int, float))
                  else "")
               + (", output identical to greedy" if report.get("greedy_identical") else ""))
    gap = contract.tau_gap(tau_est, tau if isinstance(tau, (int, float)) else None)
    if gap:
        summary += f"; {gap}"
    store.add_event(run.id, "eval", summary, clock(), "info" if report.get("complete", True) else "warning",
                    {"attempt": attempt, **{k: report.get(k) for k in (
                        "tau", "step", "tokens_per_target_forward", "greedy_identical", "prompts", "prompts_planned",
                        "new_tokens", "stopped")}})
    say("eval", summary)
    if stopped == "interrupted":
        raise KeyboardInterrupt
    return report


def _eval_log_tail(transport: "Transport", run: Run, log: str) -> str:
    answer = transport.run(["sh", "-c", 'tail -c 65536 "$1" | tail -n 20', "dflashctl-eval-log",
                            posixpath_join(run.run_dir, log)], timeout=30, check=False, limit=EVAL_LOG)
    return answer.stdout.strip()[-500:]


def _two(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "n/a"


def check_report(report: dict[str, Any], block_size: int) -> dict[str, Any]:
    """``report`` when every field the controller reads, says or stores has its type
    and range (a host may write anything in eval.json): a tau, the run's or a
    prompt's, in [1, block_size] (a verification step accepts at most the block);
    counts non-negative integers. ``contract.ContractError`` naming the first that
    does not."""
    c = contract

    def tau(value: Any, name: str) -> None:
        if value is not None:
            c.check_float(value, name, 1.0, float(block_size))

    for name in ("prompts", "prompts_planned", "step"):
        if report.get(name) is not None:
            c.check_int(report[name], name)
    tau(report.get("tau"), "tau")
    if not isinstance(report.get("complete", False), bool):
        raise c.ContractError(f"complete is not true or false ({str(report.get('complete'))[:40]!r})")
    for name in ("speed", "training"):
        if not isinstance(report.get(name) or {}, dict):
            raise c.ContractError(f"{name} is not an object")
    if (report.get("speed") or {}).get("speedup") is not None:
        c.check_float(report["speed"]["speedup"], "speed.speedup", 0.0)
    if (report.get("training") or {}).get("accept_len") is not None:
        c.check_float(report["training"]["accept_len"], "training.accept_len", 0.0, float(block_size))
    if report.get("stopped") is not None:
        c.check_text(report["stopped"], "stopped", 200)
    rows = report.get("per_prompt") or []
    if not isinstance(rows, list):
        raise c.ContractError("per_prompt is not a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise c.ContractError(f"per_prompt[{i}] is not an object")
        for name in ("index", "new_tokens", "target_forwards"):
            c.check_int(row.get(name, 0), f"per_prompt[{i}].{name}")
        tau(row.get("tau"), f"per_prompt[{i}].tau")
    return report


def block_size_of(run: Run) -> int:
    """The drafter's block as the run was launched with it (the trainer's default when not given)."""
    from trainer.config import TrainerConfig

    given = ((run.config or {}).get("trainer") or {}).get("model", {}).get("block_size")
    return given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else \
        TrainerConfig().model.block_size


def _json_report(text: str) -> dict[str, Any] | None:
    try:
        value = contract.load_json_object(text, "the evaluation report")
    except contract.ContractError:
        return None
    return value
