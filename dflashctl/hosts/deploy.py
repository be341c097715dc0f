"""Put a trainer bundle and a run's files on its run host.

Layout under the host's work directory (inside the container, when there is one):

    <workdir>/bundles/<sha256>/          one unpacked bundle per content hash
    <workdir>/bundles/<sha256>/.complete written last: the bundle is whole
    <workdir>/bundles/.tmp-<sha256>-*/   an upload in progress (or a stale one)
    <workdir>/runs/<run_id>/             a run directory (see contract.py)

Everything travels as the stdin of ``sh -c SCRIPT`` through ``Transport.run``:
a container wrapper such as ``pct exec 200 --`` has no SFTP, but every kind of
wrapper (none, plain ssh, pct exec, docker exec -i, lxc-attach) passes stdin, so
this one way works everywhere, through any number of jump hosts.

Idempotent and safe against cut connections:
- one cheap round trip first: is ``<hash>/.complete`` there? Then nothing is sent.
- otherwise the archive is received into a temporary directory beside the final
  one, its sha256 is checked against the hash it must have, it is unpacked there,
  the marker is written, and only then is the directory renamed into place. A
  cut upload leaves at most a temporary directory: the receiver removes it itself
  when it notices (hash mismatch, signal), and the next deploy removes one left
  by a receiver that was killed outright, once it is older than
  ``STALE_TEMP_MINUTES`` (younger ones may be a concurrent upload).

Never here: deciding what to deploy or when (launch and runhost do), or a file
that a reader could see half written.
"""

from __future__ import annotations

import io
import json
import posixpath
import shlex
import tarfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashctl.core import contract
from dflashctl.core.errors import TransportError
from dflashctl.hosts.bundle import Bundle

if TYPE_CHECKING:
    from dflashctl.hosts.transport import Transport

STALE_TEMP_MINUTES = 10
BUNDLES = "bundles"
RUNS = "runs"
COMPLETE_MARKER = ".complete"

# Resolve the work directory ('~' expands on the run host), create it, clean stale
# temporary upload directories, and say whether the bundle is already complete.
# Arguments: workdir, bundle hash ('' to skip the bundle check), stale minutes.
# A shell function: make DIR (and its missing parents) mode 0700, or refuse one that
# exists and is another user's or writable by others (exit 76, a message naming the
# path, its owner and the fix): whoever made it first could put code or data in it.
# Arguments: DIR, what it is (for the message). The trainer checks the same in Python
# (contract.private_dir).
PRIVATE_DIR = r"""
private_dir() {
  (umask 077 && mkdir -p -- "$1") || { echo "dflashctl: cannot create the $2 $1" >&2; exit 70; }
  if [ -z "$(find -H "$1" -prune -type d -user "$(id -u)" ! -perm -g=w ! -perm -o=w 2>/dev/null)" ]; then
    echo "dflashctl: the $2 $1 is not private: $(ls -ldn "$1" | awk '{print "mode " $1 ", owner uid " $3}'),"\
      "this user is uid $(id -u); another user could put code or data in it: use a directory of your own, or" \
      "remove it (what another user left in it stays otherwise) and let it be created again, mode 0700;" \
      "if it is yours and no one else can have written in it (a group of your own): chmod go-w $1" >&2
    exit 76
  fi
}
"""

_CHECK = PRIVATE_DIR + r"""
set -e
wd=$1; h=$2; stale=$3
case "$wd" in "~") wd=$HOME ;; "~/"*) wd=$HOME/${wd#"~/"} ;; esac
private_dir "$wd" "work directory"
private_dir "$wd/bundles" "bundle directory"
private_dir "$wd/runs" "run directory root"
wd=$(cd "$wd" && pwd -P)
cleaned=0
for t in "$wd"/bundles/.tmp-*; do
  [ -d "$t" ] || continue
  if [ -n "$(find "$t" -maxdepth 0 -mmin +"$stale" 2>/dev/null)" ]; then
    rm -rf "$t" && cleaned=$((cleaned + 1))
  fi
done
state=absent
if [ -n "$h" ] && [ -f "$wd/bundles/$h/.complete" ]; then state=present; fi
printf 'workdir=%s\nbundle=%s\ncleaned=%s\n' "$wd" "$state" "$cleaned"
"""

# A shell function for receivers: stdin into FILE, whose sha256 must be SHA256; else
# a message naming TAG and exit 72 (cannot write), 73 (no sha256sum) or 74 (bytes
# missing or wrong). Arguments: FILE, expected size (for the message), SHA256, TAG.
RECEIVE_CHECKED = r"""
receive_checked() {
  cat > "$1" || { echo "$4: could not write $(dirname "$1") (disk full?)" >&2; exit 72; }
  got=$(wc -c < "$1" | tr -d ' ')
  if ! command -v sha256sum >/dev/null 2>&1; then
    echo "$4: sha256sum not found on this host (install coreutils)" >&2; exit 73
  fi
  sum=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$sum" != "$3" ]; then
    echo "$4: upload incomplete or corrupted: received $got of $2 bytes (sha256 $sum)" >&2
    exit 74
  fi
}
"""

# Receive the archive on stdin. Arguments: absolute workdir, hash, expected size.
_RECEIVE = RECEIVE_CHECKED + r"""
set -u
wd=$1; h=$2; size=$3
b=$wd/bundles
tmp=$(mktemp -d "$b/.tmp-$h-XXXXXX") || exit 70
trap 'rm -rf "$tmp"' EXIT
trap 'exit 71' HUP INT TERM PIPE
receive_checked "$tmp/.archive" "$size" "$h" dflashctl-deploy
tar -xzf "$tmp/.archive" -C "$tmp" --no-same-owner || { echo "dflashctl-deploy: cannot unpack the bundle" >&2; exit 75; }
rm -f "$tmp/.archive"
printf '%s\n' "$h" > "$tmp/.complete"
if [ -f "$b/$h/.complete" ]; then
  echo "unchanged"   # a concurrent deploy of the same bundle finished first
  exit 0
fi
rm -rf "$b/$h"
mv "$tmp" "$b/$h"
echo "uploaded"
"""

# Create a run directory, remove stale files named after it (relative to it), and
# unpack the run's small files (a tar on stdin) into it.
_RUN_FILES = PRIVATE_DIR + r"""
set -e
d=$1; shift
private_dir "$d" "run directory"
chmod 700 "$d"
for f in "$@"; do rm -f "$d/$f"; done
tar -xf - -C "$d" --no-same-owner
"""


@dataclass
class DeployResult:
    host: str
    bundle_hash: str
    workdir: str  # absolute, on the run host
    bundle_dir: str  # absolute, on the run host; PYTHONPATH of the trainer
    status: str  # "unchanged" | "uploaded"
    bytes_sent: int
    cleaned_temp_dirs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def bundle_dir(workdir: str, bundle_hash: str) -> str:
    return posixpath.join(workdir, BUNDLES, bundle_hash)


def run_dir(workdir: str, run_id: str) -> str:
    return posixpath.join(workdir, RUNS, run_id)


def check_argv(workdir: str, bundle_hash: str = "") -> list[str]:
    return ["sh", "-c", _CHECK, "dflashctl-check", workdir, bundle_hash, str(STALE_TEMP_MINUTES)]


def receive_argv(workdir: str, bundle: Bundle) -> list[str]:
    return ["sh", "-c", _RECEIVE, "dflashctl-deploy", workdir, bundle.hash, str(bundle.size)]


def run_files_argv(directory: str, remove: list[str] = ()) -> list[str]:
    return ["sh", "-c", _RUN_FILES, "dflashctl-run-files", directory, *remove]


def _parse_keys(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def check(transport: "Transport", workdir: str, bundle_hash: str = "", timeout: float | None = None) -> dict[str, str]:
    """One round trip: {'workdir': absolute, 'bundle': 'present'|'absent', 'cleaned': N}."""
    result = transport.run(check_argv(workdir, bundle_hash), timeout=timeout)
    keys = _parse_keys(result.stdout)
    if "workdir" not in keys:
        raise TransportError(
            transport.host.name, shlex.join(check_argv(workdir)[:2]) + " ...",
            f"unexpected answer while preparing the work directory {workdir}", stderr_tail=result.stdout[-500:],
        )
    return keys


def deploy_bundle(transport: "Transport", bundle: Bundle, workdir: str | None = None,
                  timeout: float | None = None) -> DeployResult:
    """Make ``<workdir>/bundles/<hash>/`` complete on the host; send only when missing."""
    host = transport.host.name
    state = check(transport, workdir or transport.host.workdir, bundle.hash, timeout=timeout)
    abs_workdir = state["workdir"]
    result = DeployResult(host, bundle.hash, abs_workdir, bundle_dir(abs_workdir, bundle.hash),
                          "unchanged", 0, int(state.get("cleaned", 0)))
    if state["bundle"] == "present":
        return result
    try:
        answer = transport.run(receive_argv(abs_workdir, bundle), input=bundle.data, timeout=timeout)
    except TransportError as e:
        raise TransportError(
            host, f"upload of bundle {bundle.short} ({bundle.size} bytes) to {result.bundle_dir}",
            "the upload failed; bundles already on the host are untouched" + _why(e),
            exit_code=e.remote_exit_code, stderr_tail=e.stderr_tail,
            hint="check the connection to the host and launch again; a partial upload is never used",
        ) from e
    result.status = "unchanged" if answer.stdout.strip().endswith("unchanged") else "uploaded"
    result.bytes_sent = bundle.size
    return result


def _why(error: TransportError) -> str:
    if error.remote_exit_code == -1:  # the channel closed without an exit status
        return " (the connection was lost mid-transfer)"
    if error.remote_exit_code is None:  # could not even run: say why
        return f" ({str(error).splitlines()[0].split(': ', 1)[-1]})"
    return ""  # the receiver's stderr (in the error) says what went wrong


def tar_of(files: dict[str, bytes | str]) -> bytes:
    """The run's files as a tar: only the run's user may read them (run.sh and
    config.json may hold what the playbook's environment says, the rendezvous key is a
    secret): scripts mode 0700, the rest 0600."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in sorted(files.items()):
            data = content.encode("utf-8") if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o700 if name.endswith(".sh") else 0o600
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def write_run_files(transport: "Transport", directory: str, files: dict[str, bytes | str],
                    remove: list[str] = (), timeout: float | None = None) -> None:
    """Create the run directory, delete the files named in ``remove`` and write
    ``files`` into it, in one round trip."""
    transport.run(run_files_argv(directory, list(remove)), input=tar_of(files), timeout=timeout)


def config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
