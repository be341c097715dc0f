"""Env-audit's backup of what a fix step removes, and its restore: run on the host
by ``dflashctl env-audit --apply`` around each step of the plan.

``save`` copies each named dist-info directory and every file its RECORD lists
(that exists) into a backup directory, with a manifest; ``restore`` puts every
saved file back where it was and removes the dist-info directories of those
names that the step created (a new version's), so the environment is as it was
before the step.

Stdlib only, Python 3.8+, nothing from dflashctl. One JSON argument, one JSON
line answered: ``{"saved"|"restored": N, "errors": [...]}``.

``workdir`` makes the apply's own directory (``tempfile.mkdtemp``: a fresh name,
mode 0700, answered as ``{"dir": PATH}``): the backups and the fetched wheels go
under it, never under a name in /tmp another user could make first.

Argument::

    {"action": "workdir"}
    {"action": "save", "dir": BACKUP, "dist_infos": ["/site/x-1.0.dist-info", ...]}
    {"action": "restore", "dir": BACKUP}
"""

import csv
import json
import os
import re
import shutil
import sys
import tempfile

USAGE = 'usage: envsave.py \'{"action": "workdir"|"save"|"restore", "dir": BACKUP, "dist_infos": [...]}\'\n'
MANIFEST = "manifest.json"


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


def save(directory, dist_infos, errors):
    files = []
    for info in dist_infos:
        for path in listed_files(info) + [os.path.join(info, n) for n in _listdir(info)]:
            if os.path.isfile(path) and path not in files:
                try:
                    copy(path, os.path.join(directory, "files", path.lstrip("/")))
                    files.append(path)
                except OSError as e:
                    errors.append("%s: %s" % (path, e))
    sites = sorted({os.path.dirname(i.rstrip("/")) for i in dist_infos})
    names = sorted({info_name(i) for i in dist_infos})
    present = [os.path.join(s, n) for s in sites for n in _listdir(s)
               if n.endswith(".dist-info") and info_name(n) in names]
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"files": files, "sites": sites, "names": names, "present": present}, f)
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
        try:
            copy(os.path.join(directory, "files", path.lstrip("/")), path)
            count += 1
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    return count


def _listdir(directory):
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def main(argv):
    try:
        args = json.loads(argv[1])
        action = args["action"]
        directory = args["dir"] if action != "workdir" else None
        dist_infos = list(args.get("dist_infos") or [])
    except (IndexError, KeyError, TypeError, ValueError):
        sys.stderr.write(USAGE)
        return 2
    errors = []
    try:
        if action == "workdir":
            answer = {"dir": tempfile.mkdtemp(prefix="dflashctl-env-apply-")}
        elif action == "save":
            os.mkdir(directory, 0o700)  # new, under the workdir: never one that was there
            answer = {"saved": save(directory, dist_infos, errors)}
        elif action == "restore":
            answer = {"restored": restore(directory, errors)}
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
