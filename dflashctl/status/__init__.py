"""Pure views of the store for people and scripts: what ``status --once/--json``,
``runs`` and the console show. Never imports textual."""
