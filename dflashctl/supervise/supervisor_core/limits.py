"""The core's fixed numbers: the sample window, retries, settle and repeat times, clock margins.

They hold for every run, whatever its playbook says; the playbook's own numbers
are in ``run_policy``.
"""

from dflashctl.core import contract, logtext

WINDOW = 256  # samples kept per run for the detectors
LOST_AFTER_POLLS = 2  # one failed poll can be a blip; two in a row mark the host's runs lost
RESTART_TRIES = 3  # restarts that could not be issued (host gone) before the run is failed
SETTLE_S = 3.0  # a process found gone: wait this long for run.sh to write its exit code
# Phases that come back every few minutes of a healthy run: written as events only
# once one lasts longer than ROUTINE_PHASE_S (a checkpoint that slow is news).
ROUTINE_PHASES = (contract.PHASE_CHECKPOINTING,)
ROUTINE_PHASE_S = 120.0
REPEAT_FINDING_S = 600.0  # a lasting finding is written (and alerted) again this often
# A host timestamp (metrics line, status.json) is believed when, on the local clock
# (host time - measured skew), it lies after the run was created (less this margin)
# and before the answer arrived (plus this margin and two poll intervals).
CLOCK_PAST_MARGIN_S = 600.0
CLOCK_FUTURE_MARGIN_S = 120.0
# A line's own account of when its process began training (time - elapsed_s) may
# be this much before the restart that began it (rounding, the skew's error).
ATTEMPT_SLACK_S = 1.0
RESTART_MARKER = logtext.RESTART_MARKER  # the trainer.log line written before each restart
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0  # the trainer's distributed.timeout when a run's config has none
ROW_ERROR_CHARS = 500  # of a host's probe errors kept in its run_hosts row (host text: bounded)
