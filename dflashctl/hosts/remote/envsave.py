"""Env-audit's backup of what a fix step removes, and its restore: run on the host
by ``dflashctl env-audit --apply`` around each step of the plan.

``start`` makes the run's private backup directory (mode 0700, a fresh name in
the environment's prefix, else in the host's temporary directory) and answers
its path. ``save`` keeps each named dist-info directory, every file its RECORD
lists (that exists) and the other files named (what torch's loader resolves)
in a step's directory under it, as hard links where it can (``keep``), with a
manifest, and refuses when what must be copied would not leave room on that
filesystem (``MARGIN``); ``restore`` puts back every saved file
that is missing or holds other bytes (a step that changed nothing, as on a
read-only environment, writes nothing), removes the dist-info directories of
those names that the step created (a new version's) and the ``~`` stash
directories pip left there during the step, so the environment is as it was
before it. ``drop`` removes a backup directory once it cannot be needed any more.

Stdlib only, Python 3.8+, nothing from dflashctl. One JSON argument, one JSON
line answered: ``{"dir"|"saved"|"restored"|"dropped": ..., "errors": [...]}``.

``workdir`` makes the apply's own directory (``tempfile.mkdtemp``: a fresh name,
mode 0700, answered as ``{"dir": PATH}``): the fetched wheels go under it, never
under a name in /tmp another user could make first.

Argument::

    {"action": "workdir"}
    {"action": "start", "near": PREFIX}
    {"action": "save", "dir": BACKUP/step-N, "dist_infos": ["/site/x-1.0.dist-info", ...], "files": [...]}
    {"action": "restore", "dir": BACKUP/step-N}
    {"action": "drop", "dir": WORKDIR or BACKUP or BACKUP/step-N}
"""

import csv
import json
import os
import re
import shutil
import sys
import tempfile

USAGE = 'usage: envsave.py \'{"action": "workdir"|"start"|"save"|"restore"|"drop", "dir": BACKUP, "dist_infos": [...]}\'\n'
MANIFEST = "manifest.json"
PREFIX = "dflashctl-env-apply-"  # the backup directories' names: drop removes nothing else
MARGIN = 1 << 30  # free bytes a backup leaves on its filesystem


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def info_name(directory):
    """The canonical project name of a ``name-version.dist-info`` directory."""
    return canon(os.path.basename(directory.rstrip("/")).split("-", 1)[0])


def listed_files(info):
    """Absolute paths of the files a dist-info's RECORD lists."""
    location = os.path.dirname(info.rstrip("/"))
    try:
        with open(os.path.join(info, "RECORD"), encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    return [os.path.normpath(os.path.join(location, row[0])) for row in rows if row and row[0]]


def copy(source, target):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(source, target, follow_symlinks=False)


def keep(source, target):
    """``source`` kept as ``target``: a hard link where both lie on one filesystem
    (pip unlinks a file before it writes a new one and moves or deletes what it
    uninstalls, so the link keeps the old bytes at no cost), else a copy. Whether
    it was linked."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.islink(source):
        try:
            os.link(source, target)
            return True
        except OSError:
            pass
    shutil.copy2(source, target, follow_symlinks=False)
    return False


def start(near):
    """The run's backup directory: beside ``near`` (the environment's prefix), on
    its filesystem, so that backups are hard links; in the temporary directory
    when that one cannot be written."""
    for parent in ([near] if near else []) + [None]:
        try:
            return tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        except OSError:
            continue
    raise OSError("no directory to keep backups in")


def save(directory, dist_infos, extra, errors):
    candidates = []
    for info in dist_infos:
        for path in listed_files(info) + [os.path.join(info, n) for n in _listdir(info)]:
            if os.path.isfile(path) and path not in candidates:
                candidates.append(path)
    candidates += [p for p in extra if os.path.isfile(p) and p not in candidates]
    os.mkdir(directory, 0o700)  # new, under the run's own directory: never one that was there
    device = os.stat(directory).st_dev
    need = sum(_size(p) for p in candidates if _device(p) != device)  # what cannot be a hard link is copied
    free = shutil.disk_usage(directory).free
    if need and need + MARGIN > free:
        errors.append("no room to save what the step removes: %d MB to copy into %s, %d MB free there (%d MB "
                      "are kept free)" % (need >> 20, directory, free >> 20, MARGIN >> 20))
        return 0
    files = []
    for path in candidates:
        try:
            keep(path, os.path.join(directory, "files", path.lstrip("/")))
            files.append(path)
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    sites = sorted({os.path.dirname(i.rstrip("/")) for i in dist_infos})
    names = sorted({info_name(i) for i in dist_infos})
    present = [os.path.join(s, n) for s in sites for n in _listdir(s)
               if n.endswith(".dist-info") and info_name(n) in names]
    stashes = [os.path.join(s, n) for s in sites for n in _listdir(s) if n.startswith("~")]
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"files": files, "sites": sites, "names": names, "present": present, "stashes": stashes}, f)
    return len(files)


def restore(directory, errors):
    with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    for site in manifest["sites"]:
        for n in _listdir(site):
            path = os.path.join(site, n)
            if n.endswith(".dist-info") and info_name(n) in manifest["names"] and path not in manifest["present"]:
                shutil.rmtree(path, ignore_errors=True)  # made by the step: a version that was not there
    count = 0
    for path in manifest["files"]:
        saved = os.path.join(directory, "files", path.lstrip("/"))
        if _same(saved, path):
            continue  # the step left it as it was: nothing to write (a read-only environment stays untouched)
        try:
            if os.path.lexists(path):
                os.unlink(path)
            keep(saved, path)
            count += 1
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    for site in manifest["sites"]:
        for n in _listdir(site):
            path = os.path.join(site, n)
            if n.startswith("~") and path not in manifest.get("stashes", []):
                shutil.rmtree(path, ignore_errors=True)  # what pip moved aside during the step: back in place now
    return count


def drop(directory, errors):
    """Remove a backup directory this script made (its name says so), nothing else."""
    parts = os.path.normpath(directory).split(os.sep)
    if not any(p.startswith(PREFIX) for p in parts):
        errors.append("%s is not an env-audit backup directory" % directory)
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not os.path.exists(directory)


def _device(path):
    try:
        return os.lstat(path).st_dev
    except OSError:
        return None


def _size(path):
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _same(saved, path):
    """Whether ``path`` holds the saved bytes (and is the same kind of file)."""
    try:
        if os.path.islink(saved) or os.path.islink(path):
            return os.path.islink(saved) and os.path.islink(path) and os.readlink(saved) == os.readlink(path)
        if os.path.getsize(saved) != os.path.getsize(path):
            return False
        with open(saved, "rb") as a, open(path, "rb") as b:
            while True:
                x, y = a.read(1 << 20), b.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def _listdir(directory):
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def main(argv):
    try:
        args = json.loads(argv[1])
        action, directory = args["action"], args.get("dir")
        dist_infos = list(args.get("dist_infos") or [])
        if action not in ("start", "workdir") and not isinstance(directory, str):
            raise KeyError("dir")
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        sys.stderr.write(USAGE)
        return 2
    errors = []
    try:
        if action == "workdir":
            answer = {"dir": tempfile.mkdtemp(prefix=PREFIX)}
        elif action == "start":
            answer = {"dir": start(args.get("near"))}
        elif action == "save":
            answer = {"saved": save(directory, dist_infos, list(args.get("files") or []), errors)}
        elif action == "restore":
            answer = {"restored": restore(directory, errors)}
        elif action == "drop":
            answer = {"dropped": drop(directory, errors)}
        else:
            sys.stderr.write(USAGE)
            return 2
    except (OSError, ValueError, KeyError) as e:
        answer = {}
        errors.append("%s: %s" % (type(e).__name__, e))
    answer["errors"] = errors
    print(json.dumps(answer))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
