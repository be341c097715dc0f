"""compile.share shared: one compile per variant for every thread, each variant saved
whole in the compile cache and loaded by the next start; what its guards keep apart;
the saved variants pruned.

Real torch.compile (inductor on the CPU, with the machine's C compiler) in child processes,
so each test starts with Dynamo's caches empty. (A file of its own: these are the suite's
slowest tests, and a worker takes one file at a time.)"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tests.harness.compile_runs import race, race_with_stderr, run_python  # noqa: E402
from trainer import compile as compile_mod  # noqa: E402


@pytest.mark.slow
def test_a_shared_compile_serves_every_thread_from_one_compile_per_variant(tmp_path):
    # The same layers, shapes and threads as above, each variant compiled once ahead of
    # its call and called by every thread without Dynamo: no recompile, one compile per
    # (shape, grad flag) whatever the number of threads, and every 50th step of each
    # thread equal to the eager step on the same weights and input.
    shared = race("aot", tmp_path, iters=2000)
    assert shared == {**shared, "failures": 0, "iterations": 4000, "compiles": 4, "loaded": 0}, shared
    # A second process on the same compile cache loads every variant the first saved and
    # compiles none; its steps still equal the eager ones (outputs and gradients).
    again = race("aot", tmp_path, iters=2000)
    assert again == {**again, "failures": 0, "iterations": 4000, "compiles": 0, "loaded": 4}, again


def _saved_variants(tmp_path) -> list:
    return sorted((tmp_path / "inductor" / compile_mod.SAVED_DIR).iterdir())


@pytest.mark.slow
def test_a_corrupt_or_truncated_saved_variant_is_compiled_again_and_replaced(tmp_path):
    assert race("aot", tmp_path, iters=100)["compiles"] == 4
    files = _saved_variants(tmp_path)
    assert len(files) == 4 and all(compile_mod.SAVED_NAME.fullmatch(f.name) for f in files)
    files[0].write_bytes(files[0].read_bytes()[:-100])  # truncated
    files[1].write_bytes(b"\x80\x04 not a saved variant at all")
    after, stderr = race_with_stderr("aot", tmp_path, iters=100)
    assert after == {**after, "failures": 0, "compiles": 2, "loaded": 2}, after
    ignored = [line for line in stderr.splitlines() if "is ignored" in line]
    assert len(ignored) == 2 and all(line.startswith("warning: compile: saved variant ") for line in ignored)
    assert any(files[0].name in line and "truncated or corrupt" in line for line in ignored), ignored
    # The two compiled again took the broken files' places.
    assert _saved_variants(tmp_path) == files
    final = race("aot", tmp_path, iters=100)
    assert final == {**final, "failures": 0, "compiles": 0, "loaded": 4}, final


SHARED_IN_A_PROCESS = r"""
import json, torch
import aotmod
from trainer import compile as c
f = c.Shared(aotmod.f, dynamic=False)
x = torch.randn(4, 8, requires_grad=True)
y = f(x)
y.sum().backward()
grad, x.grad = x.grad.clone(), None
eager = aotmod.f(x)
eager.sum().backward()
print(json.dumps({"compiles": f.compiles, "loaded": f.loaded,
                  "same": torch.allclose(y, eager, atol=1e-6) and torch.allclose(grad, x.grad, atol=1e-6)}))
"""


AOTMOD = """
import torch


def helper(x):
    return torch.sin(x) * {scale}


def f(x):
    return helper(x) {tail}
"""


@pytest.mark.slow
def test_a_changed_function_does_not_load_the_variant_compiled_from_the_old_one(tmp_path):
    def run(scale: str, tail: str) -> tuple[dict, str]:
        (tmp_path / "mod").mkdir(exist_ok=True)
        (tmp_path / "mod" / "aotmod.py").write_text(AOTMOD.format(scale=scale, tail=tail))
        return run_python(["-c", SHARED_IN_A_PROCESS], tmp_path, pythonpath=(tmp_path / "mod",))

    assert run("2.0", "+ 1")[0] == {"compiles": 1, "loaded": 0, "same": True}
    assert run("2.0", "+ 1")[0] == {"compiles": 0, "loaded": 1, "same": True}
    # A function it calls changed (the one called is the same code): the saved variant
    # is found but refused, the new code compiled, and its variant takes the place.
    out, stderr = run("3.0", "+ 1")
    assert out == {"compiles": 1, "loaded": 0, "same": True}, out
    assert "compiled from other source (aotmod:" in stderr, stderr
    # The function called changed: no saved variant is even looked at.
    out, stderr = run("3.0", "- 1")
    assert out == {"compiles": 1, "loaded": 0, "same": True} and "is ignored" not in stderr, (out, stderr)
    assert run("3.0", "+ 1")[0] == {"compiles": 0, "loaded": 1, "same": True}


def _make_scale(k):
    def scale(x):
        return x * k
    return scale


def _times(t):
    def times(x):
        return x * t
    return times


def _apply(x, op):
    return op(x) + 1


@pytest.mark.slow
def test_a_shared_compile_tells_apart_what_its_guards_do_not_keep(tmp_path, monkeypatch):
    # An ahead-of-time compile keeps no identity guard (which function, which object):
    # a function passed in must still get its own variant, a closure's constant too,
    # while a tensor a closure holds is an input (one variant serves every tensor).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    shared = compile_mod.Shared(_apply, dynamic=False)
    x = torch.ones(4)

    def same(got, want):  # a compiled sin may differ from eager's in its last bit
        return torch.allclose(got, want if isinstance(want, torch.Tensor) else torch.full((4,), want), atol=1e-6)

    assert same(shared(x, torch.sin), torch.sin(x) + 1) and same(shared(x, torch.cos), torch.cos(x) + 1)
    assert same(shared(x, _make_scale(2.0)), 3.0) and same(shared(x, _make_scale(3.0)), 4.0)
    compiles = shared.compiles
    assert same(shared(x, _times(torch.full((4,), 5.0))), 6.0)
    assert same(shared(x, _times(torch.full((4,), 7.0))), 8.0)
    assert shared.compiles == compiles + 1
    assert same(shared(x, torch.sin), torch.sin(x) + 1) and shared.compiles == compiles + 1
    compile_mod.freeze_shared()
    try:
        with pytest.raises(compile_mod.RecompileAfterWarmup, match="_apply: a call after the warm-up"):
            shared(torch.ones(5), torch.sin)
    finally:
        compile_mod.freeze_shared(False)


def test_the_signature_names_what_a_variant_depends_on():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3, requires_grad=True)
    sig = compile_mod.signature
    assert sig((a,)) != sig((b,)) and sig((a,)) == sig((torch.ones(2, 3),)) and sig((a,)) != sig((torch.zeros(3, 2),))
    assert sig((_make_scale(2.0),)) == sig((_make_scale(3.0),))  # one code: the guards tell the constants apart
    assert sig((_make_scale(2.0),)) != sig((_times(a),)) and sig((torch.sin,)) != sig((torch.cos,))
    layer, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    other.layer_type = "sliding"
    assert sig((layer,)) == sig((torch.nn.Linear(2, 2),)) and sig((layer,)) != sig((other,))
    # Its printed form names no address: saved variants are found by it in the next process.
    printed = repr(sig((_make_scale(2.0), torch.sin, layer, a)))
    assert "0x" not in printed and "test_compile_shared.py:_make_scale.<locals>.scale:" in printed
    assert printed == repr(sig((_make_scale(3.0), torch.sin, torch.nn.Linear(2, 2), torch.ones(2, 3))))


def test_the_sharing_mode_picks_the_compiled_kind():
    try:
        assert compile_mod.set_sharing("per_thread") == "per_thread"
        assert isinstance(compile_mod.thread_safe_compile(_apply), compile_mod.PerLane)
        assert compile_mod.set_sharing("auto") == "shared"  # this torch has aot_compile
        assert isinstance(compile_mod.thread_safe_compile(_apply), compile_mod.Shared)
        # every replica's layers call one compiled function: each graph compiles once
        assert compile_mod.thread_safe_compile(_apply) is compile_mod.thread_safe_compile(_apply)
        assert compile_mod.thread_safe_compile(_apply, dynamic=False) is not compile_mod.thread_safe_compile(_apply)
        tuned = compile_mod.thread_safe_compile(_apply, fullgraph=True, options={"max_autotune": False})
        assert tuned is compile_mod.thread_safe_compile(_apply, fullgraph=True, options={"max_autotune": False})
        with pytest.raises(ValueError, match="compile.share: 'sometimes'"):
            compile_mod.set_sharing("sometimes")
    finally:
        compile_mod.set_sharing("per_thread")


def test_saved_variants_unused_for_weeks_or_past_the_size_cap_are_removed_least_recently_used_first(tmp_path):
    now = 1_800_000_000.0
    day = 86400.0

    def saved(name: str, days_ago: float, size: int) -> str:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        os.utime(path, (now - days_ago * day, now - days_ago * day))
        return str(path)

    old = saved(f"layer_fwd-{'a' * 32}.0.bin", 15, 10)     # unused past the 14 days
    used_old = saved(f"layer_fwd-{'b' * 32}.0.bin", 30, 10)  # as old, but this process loaded it
    lru = saved(f"loss_chunk-{'c' * 32}.0.bin", 3, 60)
    recent = saved(f"loss_chunk-{'d' * 32}.1.bin", 1, 60)
    other = saved("notes.txt", 100, 10)  # not a variant's name: never touched
    removed = compile_mod.prune_saved(str(tmp_path), now, keep_s=14 * day, keep_bytes=100, in_use=[used_old])
    # 15 days unused goes; then 10 + 60 + 60 = 130 bytes > 100: the least recently used goes too.
    assert removed == [os.path.basename(old), os.path.basename(lru)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p) for p in (used_old, recent, other))
    assert compile_mod.prune_saved(str(tmp_path), now, keep_s=14 * day, keep_bytes=100, in_use=[used_old]) == []
