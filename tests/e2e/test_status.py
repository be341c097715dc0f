"""`status` and `runs` as processes start without the heavy imports: `--help` loads
no store, no pydantic, no Textual; `status --once` no Textual; the data code no UI
and no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness.scenes import build


def test_help_and_runs_start_without_the_heavy_imports(tmp_path):
    """Defect: every command took 330-430 ms: numpy through sqlite_utils, pydantic
    through typer, Markdown help rendering. `--help` now loads none of them and no
    store; `runs` no pydantic, no Textual."""
    store = build("healthy", tmp_path)
    probe = ("import sys, runpy; sys.argv = ['dflashctl', *{args!r}]\n"
             "try:\n    runpy.run_module('dflashctl', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('rich.markdown', 'markdown_it', 'pydantic', 'sqlite_utils', 'textual', "
             "'numpy', 'rich.console') if m in sys.modules))")
    for args, allowed in ((["--help"], []), (["runs"], ["numpy", "rich.console", "sqlite_utils"])):
        done = subprocess.run([sys.executable, "-c", probe.format(args=args)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "DFLASHCTL_STORE": store.path})
        loaded = json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))
        assert set(loaded) <= set(allowed), (args, loaded, done.stderr[-2000:])


def test_data_code_imports_no_ui_and_no_torch():
    code = ("import sys, dflashctl.commands, dflashctl.status.model, dflashctl.tui.text, dflashctl.envaudit; "
            "print(sorted({'textual', 'torch'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_once_imports_no_textual_and_no_config_for_healthy_runs(tmp_path):
    """`status --once` stays fast: no Textual; pydantic (the playbook models) only
    when a run needs its playbook's thresholds."""
    store = build("empty", tmp_path)
    code = ("import sys; sys.argv = ['dflashctl', 'status', '--once']; from dflashctl.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted({'textual', 'pydantic', 'torch'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DFLASHCTL_STORE": store.path})
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr
