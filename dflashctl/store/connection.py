"""The store's SQLite file: opening it, its schema check, connections and write transactions.

One file shared by every dflashctl process, so: a WAL journal (readers and the
writer never block each other), every write one ``BEGIN IMMEDIATE`` transaction,
and one connection per thread (and per process). The store's other parts build on
this class; ``store.Store`` assembles them.
"""

from __future__ import annotations

import os
import shlex
import sqlite3
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    from sqlite_utils import Database

from dflashctl.core.errors import StoreBusy, StoreError
from dflashctl.store.schema import SCHEMA_VERSION, migrations


def _free_mib(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize // (1024 * 1024)


class StoreConnection:
    """The store's file and connections: opened (and migrated) at construction, one
    connection per thread, write transactions, and clean errors for SQLite's."""

    def __init__(self, path: str, timeout: float = 30.0):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.timeout = timeout
        self.write_transactions = 0  # opened by this object (all threads): one per supervisor tick
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._local = threading.local()
        self._shared: sqlite3.Connection | None = None  # ``share``
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._open()
                return
            except sqlite3.OperationalError as e:
                # Another process creating the same new file at this moment: its
                # schema is being written. Look again once it is done.
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise self.error(e) from None
                self.close()
                time.sleep(0.05)
            except sqlite3.DatabaseError as e:
                raise self.error(e) from None

    def _open(self) -> None:
        if self._check_version() != SCHEMA_VERSION:  # a store this version wrote needs no look at migrations
            db = self.db
            if migrations.pending(db):
                with self._write():
                    migrations.apply(db)
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_version(self) -> int:
        """The store's schema version; refuses one newer than this dflashctl's."""
        conn = self.conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        known = {name for name, _ in migrations.steps}
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_sqlite_migrations'").fetchone():
            applied = {r[0] for r in conn.execute(
                "SELECT name FROM _sqlite_migrations WHERE migration_set = ?", [migrations.name]).fetchall()}
            if applied - known:  # names this version does not know: a newer dflashctl's
                version = max(version, SCHEMA_VERSION + len(applied - known))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"run store {self.path} has schema version {version}; this dflashctl knows up to {SCHEMA_VERSION}",
                hint="a newer dflashctl wrote it: upgrade this one (pip install -U dflashctl), or use another store "
                "for this version (DFLASHCTL_STORE=/path/other.db)",
            )
        return version

    def error(self, e: BaseException) -> StoreError:
        """A clean StoreError for an sqlite3 error on this file, saying what to do."""
        text = str(e)
        if isinstance(e, StoreError):
            return e
        if "disk is full" in text or "disk I/O error" in text:
            free = _free_mib(os.path.dirname(self.path))
            return StoreError(f"run store {self.path}: cannot write: {text}"
                              + (f" ({free} MiB free on its file system)" if free is not None else ""),
                              hint=f"free space on the file system of {os.path.dirname(self.path)}")
        if isinstance(e, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text):
            return StoreError(f"run store {self.path} is corrupted: {text}", hint=self._corrupt_hint())
        if isinstance(e, sqlite3.OperationalError) and "no such column" in text:
            return StoreError(f"run store {self.path} does not have the schema this dflashctl expects: {text}",
                              hint="it was changed outside dflashctl or by another version; use another store "
                              "(DFLASHCTL_STORE=/path/other.db)")
        return StoreError(f"run store {self.path}: {type(e).__name__}: {text}")

    def quick_check(self) -> None:
        """``PRAGMA quick_check``; raises StoreError naming the first problems."""
        try:
            rows = [r[0] for r in self.conn.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as e:
            raise self.error(e) from None
        if rows != ["ok"]:
            raise StoreError(f"run store {self.path} is corrupted: integrity check: {'; '.join(rows[:3])}",
                             hint=self._corrupt_hint())

    def _corrupt_hint(self) -> str:
        here, aside = shlex.quote(self.path), shlex.quote(self.path + ".corrupt")
        return (f"move it aside (mv {here} {aside}) and start a new one; `sqlite3 {aside} .recover` may save "
                "its rows")

    # ----------------------------------------------------------------- connections

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection (reads go through it directly), or the one ``share``
        opened for every thread."""
        if self._shared is not None:
            return self._shared
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = self._connect()
            self._local.conn, self._local.db, self._local.pid = conn, None, os.getpid()
        return conn

    def _connect(self, *, any_thread: bool = False) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.timeout, check_same_thread=not any_thread)
        # Transactions are ours to open (BEGIN IMMEDIATE in _write); no implicit ones.
        conn.isolation_level = None
        self._wal(conn)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def share(self) -> None:
        """From now on one connection for every thread, kept open until ``unshare``: for
        a reader whose threads come and go (the console's workers), where a connection
        opened per read cost more than the read (the schema read again, the WAL opened,
        and the last close checkpointing it). Reads only: SQLite
        serializes one connection's statements, but not two threads' transactions."""
        if self._shared is None:
            self.close()
            self._shared = self._connect(any_thread=True)

    def unshare(self) -> None:
        """Close the shared connection; each thread opens its own again."""
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()

    def _wal(self, conn: sqlite3.Connection) -> None:
        """Switch a new file to WAL. Two processes opening it at once both try; the
        switch needs the file to itself and SQLite answers "locked" at once rather
        than waiting, so it is tried again within the busy timeout."""
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            try:
                conn.execute("PRAGMA journal_mode=wal")
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(0.1, delay * 2)

    @property
    def db(self) -> "Database":
        """sqlite-utils over this thread's connection, for writes and migrations
        (imported on first use: read-only commands never pay for it)."""
        conn = self.conn
        db = getattr(self._local, "db", None)
        if db is None:
            from sqlite_utils import Database

            db = self._local.db = Database(conn)
        return db

    def close(self) -> None:
        """Close this thread's connection (others close with their threads; the shared
        one, ``share``, stays open until ``unshare``)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.conn = self._local.db = None

    def batch(self, wait: float | None = None) -> AbstractContextManager[Database]:
        """One write transaction around several writes: every write method called
        inside it joins it (all stored, or none). ``wait``: how long to wait for the
        write lock (default: the store's timeout); past it, ``StoreBusy``."""
        return self._write(wait)

    @contextmanager
    def _write(self, wait: float | None = None) -> Iterator[Database]:
        """One write transaction; nested calls join the outer one."""
        if self._shared is not None:
            raise RuntimeError("this store's connection is shared by threads for reads (Store.share): no writes")
        db = self.db
        if db.conn.in_transaction:
            yield db
            return
        self._begin(db.conn, self.timeout if wait is None else wait)
        self.write_transactions += 1
        try:
            yield db
        except BaseException:
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            raise
        db.conn.execute("COMMIT")

    def _begin(self, conn: sqlite3.Connection, wait: float) -> None:
        """``BEGIN IMMEDIATE``, waiting up to ``wait`` seconds for the write lock."""
        if wait != self.timeout:
            conn.execute(f"PRAGMA busy_timeout = {max(0, int(wait * 1000))}")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            raise StoreBusy(
                f"run store {self.path} is busy: another process held its write lock for over {wait:g} s",
                hint="`dflashctl status` names a supervisor blocked by it; a long `dflashctl store vacuum` or an "
                "open sqlite3 shell holds it too; try again once it is free") from None
        finally:
            if wait != self.timeout:
                conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        cursor = self.conn.execute(sql, list(params))
        names = [d[0] for d in cursor.description or ()]
        return [dict(zip(names, row)) for row in cursor]
