"""Reaching a run host and reading what it says: the transport (local or SSH through
jumps and container wrappers), tmux, the trainer bundle and its deploy, the probe,
host facts, the parsers of host output, and the stdlib-only scripts run on a host
(``remote/``). Nothing here knows about runs, the store or the supervisor."""
