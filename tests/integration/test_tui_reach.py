"""The status console's reach: ``a`` attaches to a run's tmux session (on this
machine, and through a jump host into a ``pct exec`` container: the real OpenSSH
servers of tests/harness), ``w`` starts a real supervisor for a run nobody
watches, and the log view pauses on scroll-up, wraps, finds lines and reads
earlier ones in bounded chunks. Driven headless (Textual's Pilot) over real
SQLite stores, real tmux servers on sockets private to this test process, and
real logs on disk.

Every tmux server and process started here is ended by its pid.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from dflashctl.core import contract
from dflashctl.hosts.tmux import SOCKET_ENV, Tmux
from dflashctl.store import Store
from tests.harness import environ
from tests.harness.local import wait_for
from tests.harness.scenes import DEMO, utc
from tests.harness.tui import app_for, loaded, log_open, run, run_with_log, screen_text, until

SOCKET = f"dflash-reach-{os.getpid()}"


@pytest.fixture(autouse=True)
def _utc():
    utc()


def tmux(socket: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, check=check)


def capture(socket: str, target: str) -> str:
    return tmux(socket, "capture-pane", "-p", "-t", target, check=False).stdout


def end_server(socket: str) -> None:
    """Stop the tmux server on ``socket`` (this machine) by its pid, and wait until it
    is gone: the next test makes sessions of the same names on the same socket."""
    done = tmux(socket, "display-message", "-p", "#{pid}", check=False)
    if done.returncode == 0 and done.stdout.strip().isdigit():
        pid = int(done.stdout.strip())
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 10, f"tmux server {pid} to end",
                 every=0.02)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")


# --------------------------------------------------------------------------- a: the attach command


def test_the_attach_command_of_a_jump_and_pct_host_is_ssh_through_the_jump_into_the_container(ssh_env):
    from dflashctl.tui.actions import attach_argv

    inventory = ssh_env.inventory
    target, jump = inventory.get("target"), inventory.get("jump")
    argv = attach_argv(inventory.route("target"), "prod-7", "dflash")
    assert argv[:2] == ["ssh", "-t"]
    assert argv[-2] == f"{target.user}@{target.address}"
    assert shlex.split(argv[-1]) == ["pct", "exec", "200", "--", "tmux", "-L", "dflash", "attach-session", "-t",
                                     "=prod-7"]
    proxy = next(a for a in argv if a.startswith("ProxyCommand="))
    hop = shlex.split(proxy.removeprefix("ProxyCommand="))
    assert hop[0] == "ssh" and hop[-3:] == ["-W", "%h:%p", f"{jump.user}@{jump.address}"]
    assert ["-p", str(jump.port)] == hop[1:3] and os.path.expanduser(jump.identity_file) in hop
    # Two jumps: the inner hop's %h:%p is left for the ssh that runs it.
    two = attach_argv(inventory.route("target2"), "s", "dflash")
    outer = shlex.split(next(a for a in two if a.startswith("ProxyCommand=")).removeprefix("ProxyCommand="))
    inner = shlex.split(next(a for a in outer if a.startswith("ProxyCommand=")).removeprefix("ProxyCommand="))
    assert outer[-3:-1] == ["-W", "%h:%p"] and inner[-3:] == ["-W", "%%h:%%p", f"{jump.user}@{jump.address}"]


def test_a_attaches_to_a_session_in_a_pct_container_behind_a_jump(ssh_env, tmp_path, monkeypatch):
    """``a`` on a run on `target` (jump -> target, `pct exec 200 --`): the command the
    console hands the terminal, run in a real terminal (a tmux pane here), shows the
    run's own session inside the container (hostname ct200)."""
    monkeypatch.delenv("TMUX", raising=False)  # outside tmux: the console hands its terminal over
    inventory = ssh_env.inventory
    remote = Tmux(inventory.get("target"), inventory, SOCKET)
    session = "reach-remote"
    remote.start(session, "sh -c 'echo RUN-SESSION-$(hostname); exec sleep 600'")
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("demo", "target", {}, time.time() - 60, run_id=DEMO, run_dir="/nonexistent",
                     tmux_session=session, tmux_socket=SOCKET)
    local = f"{SOCKET}-term"
    handed: list[list[str]] = []
    try:
        async def scenario():
            # The hand-over of the terminal (App.suspend) needs a real terminal, which a
            # headless Pilot has none of: the command is run in a tmux pane instead.
            app = app_for(store, tmp_path, inventory_path=str(ssh_env.inventory_path),
                          attach=lambda argv: handed.append(argv) or 0)
            async with app.run_test(size=(120, 40)) as pilot:
                await loaded(pilot, app)
                await pilot.press("a")
                await until(pilot, lambda: handed, "the attach command")

        run(scenario())
        argv = handed[0]
        assert argv[0] == "ssh" and "pct exec 200 --" in argv[-1]
        tmux(local, "new-session", "-d", "-s", "term", "-x", "120", "-y", "30", shlex.join(argv))
        shown = wait_for(lambda: "RUN-SESSION-ct200" in capture(local, "term") and capture(local, "term"),
                         what="the run's session, attached through jump and pct")
        assert "RUN-SESSION-ct200" in shown
    finally:
        end_server(local)
        pid = remote.server_pid()
        remote.kill_server()
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def test_a_on_a_run_on_two_hosts_asks_which_rank_and_attaches_to_that_process(tmp_path, monkeypatch):
    """A run on two hosts has a session on each: ``a`` asks which process; ``1`` attaches
    to rank 1's own session (run here in a real terminal pane, it shows that process),
    Esc attaches to none, and a digit that is no rank is ignored."""
    monkeypatch.delenv("TMUX", raising=False)
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local"},
                                                        "local2": {"transport": "local"}}}))
    for rank in (0, 1):
        tmux(SOCKET, "new-session", "-d", "-s", f"{DEMO}-{rank}", "-x", "100", "-y", "20",
             f"echo RANK-{rank}-OUTPUT; exec sleep 600")
    store = Store(str(tmp_path / "runs.db"))
    store.create_run("demo", "local", {}, time.time() - 60, run_id=DEMO, run_dir=str(tmp_path),
                     tmux_session=f"{DEMO}-0", tmux_socket=SOCKET,
                     hosts=[{"rank": r, "host": h, "run_dir": str(tmp_path), "tmux_session": f"{DEMO}-{r}"}
                            for r, h in ((0, "local"), (1, "local2"))])
    handed: list[list[str]] = []
    local = f"{SOCKET}-term"
    try:
        async def scenario():
            app = app_for(store, tmp_path, inventory_path=str(inventory_path),
                          attach=lambda argv: handed.append(argv) or 0)
            async with app.run_test(size=(120, 40)) as pilot:
                await loaded(pilot, app)
                await pilot.press("a")
                await until(pilot, lambda: "Attach to which process" in screen_text(app), "the question")
                assert "rank 1 on local2" in screen_text(app)
                await pilot.press("escape")
                await pilot.pause(0.3)
                assert handed == [] and "Attach to which process" not in screen_text(app)
                await pilot.press("a")
                await until(pilot, lambda: "Attach to which process" in screen_text(app), "the question again")
                await pilot.press("7")  # no such rank: still asking
                await pilot.pause(0.3)
                assert handed == [] and "Attach to which process" in screen_text(app)
                await pilot.press("1")
                await until(pilot, lambda: handed, "the attach command")

        run(scenario())
        (argv,) = handed
        assert f"={DEMO}-1" in argv
        tmux(local, "new-session", "-d", "-s", "term", "-x", "120", "-y", "30", shlex.join(argv))
        shown = wait_for(lambda: "RANK-1-OUTPUT" in capture(local, "term") and capture(local, "term"),
                         what="rank 1's session, attached")
        assert "RANK-0-OUTPUT" not in shown
    finally:
        end_server(local)
        end_server(SOCKET)


def test_a_inside_tmux_opens_a_split_attached_to_a_local_run(tmp_path, monkeypatch):
    """The console runs in tmux (``$TMUX``), with no client to show a popup: ``a``
    splits its pane and attaches there to the run's session (a real nested attach)."""
    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local"}}}))
    run_socket, console_socket = SOCKET, f"{SOCKET}-console"
    tmux(run_socket, "new-session", "-d", "-s", DEMO, "-x", "100", "-y", "20", "echo LOCAL-RUN-OUTPUT; exec sleep 600")
    tmux(console_socket, "new-session", "-d", "-s", "console", "-x", "120", "-y", "40", "exec sleep 600")
    try:
        path = tmux(console_socket, "display-message", "-p", "#{socket_path}").stdout.strip()
        pid = tmux(console_socket, "display-message", "-p", "#{pid}").stdout.strip()
        pane = tmux(console_socket, "display-message", "-p", "-t", "console", "#{pane_id}").stdout.strip()
        monkeypatch.setenv("TMUX", f"{path},{pid},0")
        monkeypatch.setenv("TMUX_PANE", pane)
        store = Store(str(tmp_path / "runs.db"))
        store.create_run("demo", "local", {}, time.time() - 60, run_id=DEMO, run_dir=str(tmp_path),
                         tmux_session=DEMO, tmux_socket=run_socket)

        async def scenario():
            app = app_for(store, tmp_path, inventory_path=str(inventory_path))
            async with app.run_test(size=(120, 40)) as pilot:
                await loaded(pilot, app)
                await pilot.press("a")
                await until(pilot, lambda: app.attached, "the attach")
                await until(pilot, lambda: not [w for w in app.workers if w.group == "attach" and w.is_running],
                            "the split opened")
                await pilot.pause()
                # The operator's own tmux reads C-b first: a lone C-b d would detach their client.
                said = [n.message for n in app._notifications if "split below" in n.message]
                assert said and "C-b C-b d detaches it" in said[0], said

        run(scenario())

        def listed():
            return tmux(console_socket, "list-panes", "-t", "console", "-F", "#{pane_id}").stdout.split()

        panes = wait_for(lambda: len(listed()) > 1 and listed(), 10, "the split pane")  # tmux's own moment
        assert len(panes) == 2, panes
        new = next(p for p in panes if p != pane)
        wait_for(lambda: "LOCAL-RUN-OUTPUT" in capture(console_socket, new), what="the run's session in the split")
    finally:
        end_server(console_socket)
        end_server(run_socket)


# --------------------------------------------------------------------------- w: a supervisor


def _fake_run(tmp_path: Path):
    from dflashctl.config import load_inventory, load_playbook
    from tests.harness.fake_trainer import start_fake_run
    from tests.harness.local import write_playbook

    inventory_path = tmp_path / "inventory.yaml"
    inventory_path.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local",
                                                                  "workdir": str(tmp_path / "work")}}}))
    playbooks = tmp_path / "playbooks"
    source = write_playbook(playbooks, "live", "local", {"train": {"steps": 100000, "log_every": 2,
                                                                    "checkpoint_every": 50}}, poll_interval="1s")
    inventory = load_inventory(str(inventory_path))
    store = Store(str(tmp_path / "runs.db"))
    pb = load_playbook(str(source), inventory=inventory)
    run_id = start_fake_run(store, inventory, "local", pb.trainer.to_dict(), playbook=pb.name,
                            playbook_source=pb.source, socket=SOCKET, step_s=0.1)
    return store, inventory_path, run_id


def test_w_asks_then_starts_a_real_supervisor_and_the_run_shows_supervised(tmp_path):
    from dflashctl.launch import supervisor_session
    from dflashctl.tui.app import StatusApp
    from dflashctl.tui.screens import ConfirmScreen

    with environ(**{SOCKET_ENV: SOCKET}):
        store, inventory_path, run_id = _fake_run(tmp_path)
        try:
            async def scenario():
                app = StatusApp(store.path, interval=0.5, inventory_path=str(inventory_path),
                                playbooks_dir=str(tmp_path / "playbooks"), probe_unsupervised=False)
                async with app.run_test(size=(120, 40)) as pilot:
                    await loaded(pilot, app)
                    assert not app.view.runs[0].freshness.supervised
                    await pilot.press("w")
                    await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
                    text = screen_text(app)
                    assert f"Start a supervisor for run {run_id}?" in text
                    assert f"dflashctl watch {run_id}" in text and "detached" in text
                    assert supervisor_session(run_id)[:20] in text
                    assert not store.get_run(run_id).supervisor  # nothing before the yes
                    await pilot.press("y")
                    await until(pilot, lambda: app.view and app.view.runs[0].freshness.supervised,
                                "the run shown supervised", timeout=60)
                    assert app.actions_done[-1][1] == 0, app.actions_done
                    assert "unsupervised" not in str(app.query_one("#runs").get_cell(run_id, "state"))
                    # Watched now: w is refused, with the reason, and asks nothing.
                    await pilot.press("w")
                    await pilot.pause(0.2)
                    assert not isinstance(app.screen, ConfirmScreen)
                    assert any("supervised already" in n.message for n in app._notifications)

            run(scenario())
            info = store.get_run(run_id).supervisor
            assert info["session"] == supervisor_session(run_id) and info["kind"] == "tmux"
            beats = [b for b in store.supervisors() if run_id in (b.get("runs") or [])]
            assert beats and beats[0]["pid"] != os.getpid()  # its own process, not the console
        finally:
            end_server(SOCKET)  # the run's and the supervisor's sessions


def test_w_and_a_are_gone_under_readonly(tmp_path):
    from dflashctl.tui.screens import ConfirmScreen
    from tests.harness.scenes import build

    store = build("unsupervised", tmp_path)

    async def scenario():
        app = app_for(store, tmp_path, readonly=True, attach=lambda argv: pytest.fail(f"attached: {argv}"))
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            footer = screen_text(app).splitlines()[-1]
            assert "a Attach" not in footer and "w Watch" not in footer
            await pilot.press("w", "a")
            await pilot.pause(0.3)
            assert not isinstance(app.screen, ConfirmScreen) and not app.attached and not app.actions_done

    run(scenario())


def test_w_asks_nothing_for_a_supervised_run(tmp_path):
    from dflashctl.tui.screens import ConfirmScreen
    from tests.harness.scenes import PROD, build

    store = build("healthy", tmp_path)  # a supervisor ticks for prod

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(pilot, app)
            while app.query_one("#runs").current != PROD:
                await pilot.press("down")
            assert "a Attach" in screen_text(app).splitlines()[-1] and "w Watch" in screen_text(app).splitlines()[-1]
            await pilot.press("w")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ConfirmScreen)
            assert any(f"run {PROD} is supervised already" in n.message for n in app._notifications)

    run(scenario())


# --------------------------------------------------------------------------- the log view


def _log(app):
    from dflashctl.tui.widgets import LogLines

    return app.screen.query_one(LogLines)


async def _open_log(pilot, app, lines: int) -> None:
    await log_open(pilot, app, lines)
    await pilot.pause()


def test_scrolling_up_pauses_the_log_and_end_follows_again(tmp_path):
    store, run_dir = run_with_log(tmp_path, [f"step {i}/900 tok/s 900" for i in range(1, 121)])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await _open_log(pilot, app, 120)
            log = _log(app)
            assert log.scroll_y == log.max_scroll_y > 0 and not log.paused
            await pilot.press("pageup")
            await pilot.pause()
            held = log.scroll_y
            assert log.paused and held < log.max_scroll_y
            with open(run_dir / contract.LOG_FILE, "a") as f:
                f.write("".join(f"step {i}/900 tok/s 901\n" for i in range(121, 128)))
            await until(pilot, lambda: app.screen.log_lines >= 127, "the new lines")
            await pilot.pause()
            assert log.scroll_y == held  # not pulled back to the end
            assert "paused, 7 new lines, End to follow" in screen_text(app)
            assert "step 127/900" not in screen_text(app)
            await pilot.press("end")
            await pilot.pause()
            assert not log.paused and log.scroll_y == log.max_scroll_y
            assert "step 127/900" in screen_text(app) and "End to follow" not in screen_text(app)
            footer = screen_text(app).splitlines()[-1]
            for key in ("End Follow", "t Wrap", "h Earlier", "n Next"):
                assert key in footer, (key, footer)

    run(scenario())


def test_t_wraps_long_log_lines(tmp_path):
    long = "x" * 150 + " THE-END-OF-A-LONG-LINE"
    store, _ = run_with_log(tmp_path, ["short line", long])

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await _open_log(pilot, app, 2)
            log = _log(app)
            assert len(log.texts()) == 2 and "THE-END-OF-A-LONG-LINE" not in screen_text(app)
            await pilot.press("t")
            await until(pilot, lambda: not log.rebuilding, "the lines wrapped")
            await pilot.pause()
            assert log.wrap and len(log.texts()) > 2 and "THE-END-OF-A-LONG-LINE" in screen_text(app)
            assert "".join(log.texts()[1:]) == long  # cut into rows, nothing lost
            await pilot.press("t")
            await until(pilot, lambda: not log.rebuilding, "the lines cut again")
            assert not log.wrap and len(log.texts()) == 2

    run(scenario())


def test_search_finds_a_line_and_n_goes_to_the_next(tmp_path):
    lines = [f"step {i}/900 tok/s 900" for i in range(1, 181)]
    lines[20] = "step 21/900 WARNING needle one"
    lines[90] = "step 91/900 WARNING needle two"
    store, _ = run_with_log(tmp_path, lines)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await _open_log(pilot, app, 180)
            log = _log(app)
            await pilot.press("slash", *"needle", "enter")
            await until(pilot, lambda: not log.rebuilding and log.rows.words == ["needle"], "the filter")
            assert log.texts() == [lines[20], lines[90]]  # filtered
            await pilot.press("m")  # every line again, the matches marked
            await until(pilot, lambda: not log.rebuilding, "every line again")
            assert len(log.texts()) == 180
            await pilot.press("n")  # the first match from the top... (none chosen yet: the first)
            await pilot.pause()
            assert log.match == 20 and "needle one" in screen_text(app) and log.paused
            await pilot.press("n")
            await pilot.pause()
            assert log.match == 90 and "needle two" in screen_text(app) and "needle one" not in screen_text(app)
            assert "'needle': 2 lines (at line 91 of 180)" in screen_text(app)
            await pilot.press("N")
            await pilot.pause()
            assert log.match == 20 and "needle one" in screen_text(app)

    run(scenario())


def test_h_reads_earlier_lines_in_bounded_chunks_to_the_start(tmp_path, monkeypatch):
    from dflashctl.tui.screens import DetailScreen

    monkeypatch.setattr(DetailScreen, "HISTORY_LINES", 1000)
    monkeypatch.setattr(DetailScreen, "HISTORY_BYTES", 16 * 1024)  # ~700 lines of this log per read
    lines = [f"line {i:05d} of the trainer log" for i in range(1, 3001)]
    store, _ = run_with_log(tmp_path, lines)

    async def scenario():
        app = app_for(store, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await _open_log(pilot, app, DetailScreen.LOG_TAIL)
            log = _log(app)
            assert log.kept == lines[-DetailScreen.LOG_TAIL:]
            held = []
            for _ in range(10):
                before = len(log.kept)
                await pilot.press("h")
                await until(pilot, lambda: len(log.kept) > before or "first line" in log.history, "earlier lines")
                held.append(len(log.kept) - before)
                assert log.kept == lines[-len(log.kept):]  # in order, none lost, none twice
                if log.kept == lines:
                    break
            assert log.kept == lines, len(log.kept)
            line_bytes = len(lines[0]) + 1
            assert max(held) * line_bytes <= 16 * 1024 and len(held) >= 5  # each read bounded by HISTORY_BYTES
            await pilot.press("h")
            await pilot.pause(0.2)
            assert "the log's first line is held" in screen_text(app) and log.kept == lines
            # Scrolling up at the top asks too (here: it is all held).
            await pilot.press("home", "up")
            await pilot.pause()
            assert log.paused and log.kept == lines

    run(scenario())


def test_typed_text_in_the_log_filter_is_text_never_the_new_keys(tmp_path):
    """`/` then a, w, t, h, n, N, m, End in the log tab: all of it is text in the filter
    box; nothing is attached, no supervisor asked for, the log neither wrapped nor read
    further back."""
    from textual.widgets import Input

    from dflashctl.tui.screens import ConfirmScreen

    store, _ = run_with_log(tmp_path, [f"step {i}/300 tok/s 900" for i in range(1, 41)])

    async def scenario():
        app = app_for(store, tmp_path, attach=lambda argv: pytest.fail(f"attached: {argv}"))
        async with app.run_test(size=(120, 40)) as pilot:
            await _open_log(pilot, app, 40)
            log = _log(app)
            await pilot.press("slash", "a", "w", "t", "h", "n", "N", "m")
            await pilot.pause(0.3)
            box = app.focused
            assert isinstance(box, Input) and box.value == "awthnNm"
            assert not app.attached and not isinstance(app.screen, ConfirmScreen)
            assert not log.wrap and log.only_matches and not log.history and log.match is None

    run(scenario())
