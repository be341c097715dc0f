"""env-audit's pure parts as tables: ``apply.worse`` (what a step made worse for
the protected packages, imports compared, not error counts) and the plan's model
of the files the loader resolves (``program.prove``: a step that deletes one, or
leaves it holding another wheel's bytes, is refused, at any step of the plan)."""

from __future__ import annotations

import pytest

from dflashctl import envaudit as ea
from dflashctl.envaudit.apply import step_targets, worse
from dflashctl.envaudit.program import prove

SITE = "/venv/lib/python3.11/site-packages"
LIB = f"{SITE}/nvidia/cudnn/lib/libcudnn.so.9"


def snapshot(imports: dict | None = None, versions: dict | None = None, loader_owners=(2,)) -> ea.Snapshot:
    versions = {"torch": "2.7.0", "nvidia-cudnn-cu12": "9.1.0.70", "nvidia-cudnn-cu13": "9.13.0.50",
                "sympy": "1.14.0", **(versions or {})}
    requires = {"torch": ["nvidia-cudnn-cu12==9.1.0.70", "sympy"]}
    dists = [ea.Dist(name, v, SITE, requires.get(name, []), index=i, metadata=f"{SITE}/{name}-{v}.dist-info",
                     files=3)
             for i, (name, v) in enumerate(versions.items()) if v is not None]
    return ea.Snapshot("box", python="/venv/bin/python", python_version="3.11.7", prefix="/venv",
                       base_prefix="/usr", dists=dists,
                       deep={"imports": imports} if imports is not None else None,
                       loader=[ea.LoaderFile(LIB, "RUNPATH", f"{SITE}/torch/lib/libtorch_cuda.so",
                                             list(loader_owners))])


def report(s: ea.Snapshot) -> ea.AuditReport:
    return ea.AuditReport("box", "box", None, s, [], None)


OK = {"torch": {"loaded": [LIB]}, "sympy": {"loaded": []}}


@pytest.mark.parametrize("after, versions, targets, says", [
    (OK, {}, set(), []),
    ({"torch": {"error": "OSError: libcudnn.so.9: cannot open shared object file"}, "sympy": {}}, {}, set(),
     ["`import torch` fails after it: OSError: libcudnn.so.9"]),
    ({"torch": {"loaded": ["/usr/lib/libcudnn.so.9"]}, "sympy": {}}, {}, set(),
     [f"`import torch` loaded {LIB}, after it /usr/lib/libcudnn.so.9"]),
    ({"torch": {"loaded": []}, "sympy": {}}, {}, set(), [f"`import torch` loaded {LIB}, after it no such library"]),
    (OK, {"sympy": "1.13.0"}, set(), ["sympy 1.14.0 is 1.13.0 after it, which the step did not install"]),
    (OK, {"sympy": "1.13.0"}, {"sympy"}, []),  # the step installed it
    (OK, {"sympy": None}, set(), ["sympy 1.14.0 is gone after it"]),
    ({}, {}, set(), ["`import torch` was not tried after it", "`import sympy` was not tried after it"]),
])
def test_worse_compares_imports_libraries_and_versions(after, versions, targets, says):
    found = worse(report(snapshot(OK)), report(snapshot(after, versions)), targets)
    assert len(found) == len(says) and all(f.startswith(s) for f, s in zip(found, says)), found


def test_an_import_that_already_failed_is_not_worse():
    broken = {"torch": {"error": "RuntimeError: x"}, "sympy": {}}
    assert worse(report(snapshot(broken)), report(snapshot(broken)), set()) == []


def test_step_targets_are_the_names_a_step_installs():
    argv = ["/venv/bin/python", "-m", "pip", "install", "--no-index", "--find-links", "/tmp/w", "transformers>=4.51",
            "torch==2.7.0"]
    assert step_targets(argv) == {"transformers", "torch"}
    assert step_targets(["rm", "-r", "--", "/x"]) == set()


@pytest.mark.parametrize("owners, refused", [((2,), True), ((1, 2), True), ((), False)])
def test_the_proof_refuses_deleting_a_library_the_loader_resolves(owners, refused):
    """A bare uninstall of the CUDA 13 cuDNN (index 2): refused when its RECORD
    lists the library torch loads, whether torch's own cuDNN wheel lists it too or
    not (the step deletes it; a later reinstall would not make that step safe);
    allowed when no RECORD lists it (pip deletes nothing it does not list)."""
    s = snapshot(OK, loader_owners=owners)
    keep = ea.protected(s)
    f = ea.Finding("warning", "cuda-major", "stray", argv=[[s.python, "-m", "pip", "uninstall", "-y",
                                                            "nvidia-cudnn-cu13"]], remove=["nvidia-cudnn-cu13"])
    proof = prove([f], s, keep)
    assert (id(f) in proof.refused) is refused, proof.refused
    if refused:
        assert "libcudnn.so.9" in proof.refused[id(f)] and "the loader resolves" in proof.refused[id(f)]


def test_a_library_overwritten_by_another_wheel_in_a_middle_step_is_refused():
    """An install of a new nvidia-cudnn-cu13 version writes over the library (its RECORD lists it):
    another wheel's bytes where torch loads its own, refused even if a later step would undo it."""
    s = snapshot(OK, loader_owners=(2,))
    keep = ea.protected(s)
    f = ea.Finding("warning", "requirement-version", "x",
                   argv=[[s.python, "-m", "pip", "install", "nvidia-cudnn-cu13==9.14.0"]])
    proof = prove([f], s, keep)
    assert id(f) in proof.refused and "libcudnn.so.9" in proof.refused[id(f)]


@pytest.mark.parametrize("pip_spec, ensurepip, severity, argv0, says", [
    (None, ea.ModuleSpec("ensurepip", "/usr/lib/python3.11/ensurepip/__init__.py"), "info",
     ["/venv/bin/python", "-m", "ensurepip"], "put pip back with ensurepip"),
    (None, None, "warning", None, "carry pip's wheel (pip-VERSION-py3-none-any.whl from PyPI) to the host as "
                                  "/tmp/pip-VERSION-py3-none-any.whl, and run `/venv/bin/python "
                                  "/tmp/pip-VERSION-py3-none-any.whl/pip install --no-index"),
])
def test_pip_missing_with_and_without_ensurepip(pip_spec, ensurepip, severity, argv0, says):
    s = snapshot()
    s.modules = {"torch": ea.ModuleSpec("torch", f"{SITE}/torch/__init__.py"), "pip": pip_spec, "ensurepip": ensurepip}
    (found,) = [f for f in ea.audit(s) if f.code == "pip-unusable"]
    assert found.severity == severity and says in found.fix, found.fix
    assert (found.argv[0] if found.argv else None) == argv0
