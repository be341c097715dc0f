"""The run store against what the world does to a file: values of the wrong type,
a newer dflashctl's schema, a corrupted file, a full disk. Real SQLite files; the
full disk is a real tmpfs of a few hundred KiB (mounting needs root: skipped, with
the reason, otherwise)."""

from __future__ import annotations

import os
import sqlite3
import subprocess

import pytest

from dflashctl.core.errors import StoreError
from dflashctl.store import SCHEMA_VERSION, Store
from tests.harness import cli
from tests.harness.disk import fill, mount_tmpfs

T0 = 1_800_000_000.0


def _run(store: Store, run_id: str = "r1"):
    return store.create_run("demo", "local", {}, T0, run_id=run_id)


def test_text_in_a_numeric_sample_field_is_stored_as_no_value(tmp_path):
    """`"tok_s": "fast"` once broke every later watch of the playbook, status and the TUI."""
    store = Store(str(tmp_path / "runs.db"))
    _run(store)
    store.add_samples("r1", [{"time": T0, "step": 1, "tok_s": "fast", "loss": float("inf"), "eta_s": 10**400,
                              "acc": True, "mfu": "0.4", "phase": 7}])
    [s] = store.samples("r1")
    assert (s.tok_s, s.loss, s.eta_s, s.acc, s.mfu, s.phase) == (None, None, None, None, None, None)
    types = store.db.execute("SELECT typeof(tok_s), typeof(loss), typeof(eta_s) FROM samples").fetchone()
    assert types == ("null", "null", "null")
    assert store.baseline_tok_s("demo") is None  # the median over no numbers, not a TypeError


def test_a_store_poisoned_before_validation_is_cleaned_when_it_upgrades(tmp_path):
    path = str(tmp_path / "runs.db")
    store = Store(path)
    _run(store)
    store.add_samples("r1", [{"time": T0, "step": 1, "tok_s": 5.0}])
    store.close()
    conn = sqlite3.connect(path)  # as an older dflashctl left it: text in a REAL column, version 3
    conn.execute("UPDATE samples SET tok_s = 'fast'")
    conn.execute("DELETE FROM _sqlite_migrations WHERE name LIKE '0004%'")
    conn.execute("ALTER TABLE restarts DROP COLUMN outcome")
    conn.execute("PRAGMA user_version = 0")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.samples("r1")[0].tok_s is None
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


@pytest.mark.parametrize("how", ["user_version", "unknown_migration"])
def test_a_store_from_a_newer_dflashctl_is_refused_with_the_fix(tmp_path, how):
    path = str(tmp_path / "runs.db")
    _run(Store(path))
    conn = sqlite3.connect(path)
    if how == "user_version":
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 3}")
    else:
        conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                     "VALUES ('dflashctl', '0099_renamed_columns', '2030-01-01')")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as e:
        Store(path)
    assert f"this dflashctl knows up to {SCHEMA_VERSION}" in str(e.value) and path in str(e.value)
    assert "upgrade" in e.value.hint and "DFLASHCTL_STORE" in e.value.hint


def test_a_file_that_is_not_a_database_is_a_clean_error(tmp_path):
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not sqlite\n" * 500)
    with pytest.raises(StoreError) as e:
        Store(str(path))
    assert "is corrupted" in str(e.value) and ".corrupt" in e.value.hint


def test_a_damaged_page_fails_the_quick_check(tmp_path):
    path = str(tmp_path / "runs.db")
    store = Store(path)
    for i in range(30):
        _run(store, f"r{i}")
        store.add_samples(f"r{i}", [{"time": T0 + j, "step": j, "tok_s": 1.0} for j in range(200)])
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # scribble over a page in the middle of the samples table
        f.seek(size // 2)
        f.write(os.urandom(4096))
    store = Store(path)  # opens: the damaged page is not read at open
    with pytest.raises(StoreError) as e:
        store.quick_check()
    assert "is corrupted" in str(e.value) and "mv " in e.value.hint


@pytest.fixture
def small_fs(tmp_path):
    where = str(tmp_path / "fs")
    mount_tmpfs(where, "512k")
    yield where
    subprocess.run(["umount", "-l", where], check=True)


def test_a_full_disk_is_a_store_error_that_says_where_space_is_missing(small_fs):
    store = Store(os.path.join(small_fs, "runs.db"))
    _run(store)
    filler = fill(small_fs)
    with pytest.raises((StoreError, sqlite3.OperationalError)) as e:
        with store.batch():
            store.add_samples("r1", [{"time": T0 + i, "step": i, "tok_s": 1.0, "phase": "x" * 500}
                                     for i in range(2000)])
    error = store.error(e.value)
    assert "cannot write" in str(error) and "MiB free" in str(error) and small_fs in error.hint
    os.unlink(filler)
    store.add_samples("r1", [{"time": T0, "step": 1}])  # space back: writes go through again
    assert [s.step for s in store.samples("r1")] == [1]
    store.close()


def test_the_cli_reports_a_newer_store_without_a_traceback(tmp_path):
    path = str(tmp_path / "runs.db")
    _run(Store(path))
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    done = cli.invoke("runs", env={"DFLASHCTL_STORE": path})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "schema version" in done.stderr + done.stdout


def test_an_empty_run_reference_matches_nothing(tmp_path):
    """`dflashctl stop ""` once acted on the only run in the store."""
    from dflashctl.core.errors import ConfigError

    store = Store(str(tmp_path / "runs.db"))
    _run(store)
    for ref in ("", "   "):
        with pytest.raises(ConfigError, match="empty run reference"):
            store.get_run(ref)
    assert store.get_run("r").id == "r1"  # a prefix still works
