"""The ``status --json`` document's name and version, and its JSON schema."""

from __future__ import annotations

from typing import Any

SCHEMA = "dflashctl.status/1"  # the --json document's name and version (JSON_SCHEMA below)

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA,
    "description": "dflashctl status --json: every run, its freshness and phase, the GPUs of hosts with active runs. "
                   "Times are unix seconds on the operator's clock unless named otherwise.",
    "type": "object",
    "required": ["schema", "now", "store", "selected", "supervisors", "runs", "events", "hosts", "gpus", "notices"],
    "properties": {
        "schema": {"const": SCHEMA},
        "now": {"type": "number"},
        "store": {"type": "string", "description": "the run store file"},
        "selected": _STR,
        "supervisors": {"type": "integer", "description": "supervisors ticking now"},
        "runs": {"type": "array", "items": {
            "type": "object",
            "required": ["id", "playbook", "host", "state", "display_state", "active", "freshness", "phase", "step",
                         "total_steps", "progress_pct", "tok_s", "baseline_pct", "eta_s", "loss", "accept_len",
                         "tau_est", "tau",
                         "restarts", "last_event", "hosts"],
            "properties": {
                "id": {"type": "string"}, "playbook": {"type": "string"}, "host": {"type": "string"},
                "state": {"type": "string", "description": "as stored: launching, running, stalled, restarting, "
                                                           "lost, stopped, done, failed"},
                "display_state": {"type": "string", "description": "state, or unsupervised / unreachable / stale "
                                                                   "when what is stored is not live"},
                "active": {"type": "boolean"},
                "freshness": {"type": "object", "required": ["supervised", "live", "note", "fix", "data_age_s"],
                              "description": "dflashctl.status.freshness.Freshness: supervised, live, unsupervised_since, "
                                             "host_down_since, data_age_s, note, fix (the command that fixes it), "
                                             "stale_after_s (an answer older than this is not live)"},
                "phase": {"type": "object", "required": ["name", "since", "budget_s", "elapsed_s", "over_budget"]},
                "step": {"type": ["integer", "null"]}, "total_steps": {"type": ["integer", "null"]},
                "progress_pct": _NUM,
                "tok_s": {**_NUM, "description": "mean over window_s of the newest training samples"},
                "tok_s_last": _NUM, "window_s": {"type": "number"}, "baseline_tok_s": _NUM, "baseline_pct": _NUM,
                "eta_s": {**_NUM, "description": "from the step rate over window_s; null when the data is not live"},
                "loss": _NUM, "acc": _NUM,
                "accept_len": {**_NUM, "description": "the trainer's expected run of correct drafter slots at the "
                                                      "training anchors (tau_est - 1)"},
                "tau_est": {**_NUM, "description": "τ est: the training-time tau, accept_len + 1"},
                "tau": {**_NUM, "description": "τ: measured tau (accepted draft tokens + 1 per target forward) "
                                               "of the run's largest complete dflashctl eval (else its largest)"},
                "tau_eval": {"type": ["object", "null"], "description": "that eval: id, attempt, time, step, tau, "
                                                                        "speedup, prompts, new_tokens, complete "
                                                                        "(false: stopped early), tau_sd, "
                                                                        "speedup_range, evals (with a tau), newer "
                                                                        "(evals after it, passed over: smaller)"},
                "tau_note": {**_STR, "description": "why tau is more than contract.TAU_GAP_MARGIN below tau_est"},
                "mfu": {**_NUM, "description": "model FLOPs utilisation against the GPU's nominal dense peak"},
                "mfu_measured": {**_NUM, "description": "the same against the rate a large matmul measured there"},
                "samples_s": {**_NUM, "description": "the newest line's samples (sequences) per second"},
                "restarts": {"type": "integer"}, "exit_reason": _STR,
                "attention": {**_STR, "description": "why it sorts first: failed (within a day), crash loop, "
                                                     "stalled, regressed; null: nothing needs the operator"},
                "last_event": {"type": ["object", "null"]}, "tok_s_history": {"type": "array"},
                "gpus": {"type": "array"}, "roles": {"type": "object"},
                "hosts": {"type": "array", "description": "a run on several hosts: one per host, by rank, as the "
                                                          "supervisor last saw its process; [] for a run on one host",
                          "items": {"type": "object", "required": [
                              "rank", "host", "phase", "step", "alive", "exit_code", "exit_reason", "error", "seen",
                              "age_s", "stale"], "properties": {
                              "rank": {"type": "integer"}, "host": {"type": "string"}, "phase": _STR,
                              "step": {"type": ["integer", "null"]}, "alive": {"type": ["boolean", "null"]},
                              "exit_code": {"type": ["integer", "null"], "description": "the process ended"},
                              "exit_reason": {**_STR, "description": "the exit code in words"},
                              "error": {**_STR, "description": "what the probe could not read, or why the host "
                                                               "did not answer"},
                              "seen": {**_NUM, "description": "when its host last answered for this run"},
                              "age_s": {**_NUM, "description": "now - seen; null: never answered"},
                              "stale": {"type": "boolean", "description": "age_s over freshness.stale_after_s "
                                                                          "(an active run only)"}}}},
            }}},
        "events": {"type": "array", "description": "the selected run's recent events, oldest first"},
        "hosts": {"type": "array", "items": {"type": "object", "required": ["host", "runs", "last_answer",
                                                                             "down_since", "error", "supervised"],
                                             "properties": {"load": {
                                                 "type": ["object", "null"],
                                                 "description": "the host's CPU and memory from the newest poll that "
                                                                "read them (null: none did): time, cpus, load1, "
                                                                "busy_pct, mem_total_kib, mem_available_kib, "
                                                                "stale_after_s, mem_cgroup (1: the memory is a "
                                                                "container's cgroup limit and what is left under "
                                                                "it), cpu_cgroup (its CPU quota in CPUs, when "
                                                                "busy_pct is the share of it used); an unknown "
                                                                "field is null"}}}},
        "gpus": {"type": "array", "items": {"type": "object", "required": [
            "host", "index", "name", "role", "run_id", "utilization_pct", "memory_used_mib", "memory_total_mib",
            "temperature_c", "power_draw_w", "utilization_history"]}},
        "notices": {"type": "array", "items": {"type": "object", "required": ["severity", "text", "fix", "run_id"]}},
    },
}
