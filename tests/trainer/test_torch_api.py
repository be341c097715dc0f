"""What the trainer relies on in torch's private API (trainer/torch_api.py), tested on the
torch installed: a release that moves one of them fails here, by name, not in a run."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from trainer import torch_api


def test_the_start_up_probe_finds_every_private_use_on_this_torch():
    report = torch_api.check()
    assert report["torch"] == torch.__version__
    assert report["moved"] == {}, report
    assert torch_api.describe(report).startswith(f"torch api: {torch.__version__}: all {len(torch_api.PROBES)}")


def test_a_moved_use_is_named_in_the_start_up_line():
    line = torch_api.describe({"torch": "2.99.0", "checked": False,
                               "moved": {"counters": "ImportError: no module torch._dynamo.utils"}})
    assert "1 private use(s) moved" in line and "counters: ImportError" in line
    assert "not one of 2.11, 2.13, 2.14, 2.15" in line


@pytest.mark.parametrize("version, expected", [("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)),
                                               ("2.15.0a0+git", (2, 15)), ("", (0, 0)), ("nightly", (0, 0))])
def test_version_tuple(version, expected):
    assert torch_api.version_tuple(version) == expected


def test_checked_on_compares_the_minor_release():
    assert torch_api.checked_on("2.11.0+cu130") and torch_api.checked_on("2.13.0+cpu")
    assert torch_api.checked_on("2.14.1") and not torch_api.checked_on("2.16.0") and not torch_api.checked_on("garbage")


def test_set_everywhere_reaches_a_thread_that_set_nothing():
    cfg = torch_api.dynamo_config()
    before = cfg.recompile_limit
    try:
        torch_api.set_everywhere(cfg, "recompile_limit", before + 17)
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(cfg.recompile_limit))
        t.start()
        t.join(10)
        assert seen == [before + 17]
    finally:
        torch_api.set_everywhere(cfg, "recompile_limit", before)
    entry = cfg._config["recompile_limit"]
    if torch_api.version_tuple(torch.__version__) >= (2, 12):
        # what set_everywhere relies on: an assignment is a per-thread override, the default shared
        from contextvars import ContextVar
        assert isinstance(entry.user_override, ContextVar)
        assert entry.default == before


def test_dynamo_counters_count_a_compiled_frame():
    before = torch_api.dynamo_counters()
    assert set(before) == {"frames_ok", "frames_total", "unique_graphs", "fxgraph_cache_hit", "fxgraph_cache_miss"}

    def double(x):
        return x * 2 + 1

    out = torch.compile(double, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0))
    after = torch_api.dynamo_counters()
    assert after["frames_ok"] > before["frames_ok"] and after["frames_total"] > before["frames_total"]
    assert after["unique_graphs"] > before["unique_graphs"]


def test_compile_seconds_grow_by_phase_with_an_inductor_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cache hit would skip inductor's compile
    before = torch_api.compile_seconds()

    def shifted(x):
        return (x.sin() + 2).cos()

    out = torch.compile(shifted)(torch.ones(5))  # inductor: every phase runs
    assert torch.allclose(out, torch.ones(5).sin().add(2).cos())
    after = torch_api.compile_seconds()
    assert {"dynamo", "trace", "backend", "inductor"} <= set(after)
    assert after["dynamo"] >= after["backend"] >= after["inductor"] > 0  # phases nest
    assert after["dynamo"] > before.get("dynamo", 0.0)


def test_the_inductor_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    assert torch_api.inductor_cache_dir() == str(tmp_path / "ind")


def test_the_artifact_reader_parses_without_writing_and_returns_none_for_garbage(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    manager = torch_api.cache_artifact_manager()
    assert manager.deserialize(b"not a compile artifact") is None
    assert not (tmp_path / "ind").exists()


def test_the_eager_fallback_warning_is_shown_once_until_forgotten():
    q = torch.randn(1, 1, 16, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch_api.forget_flex_fallback_warning()
        flex_attention(q, q, q)
        flex_attention(q, q, q)
        shown = [w for w in seen if "without torch.compile" in str(w.message)]
        assert len(shown) == 1  # torch shows it once per process: the record the trainer clears
        assert torch_api.forget_flex_fallback_warning() is True
        flex_attention(q, q, q)
        shown = [w for w in seen if "without torch.compile" in str(w.message)]
        assert len(shown) == 2


def test_an_ahead_of_time_compile_runs_forward_and_backward_and_names_a_failed_guard(tmp_path, monkeypatch):
    # Both ways in: torch.compile(...).aot_compile where this torch has it, and the
    # function it calls (what torch 2.11, which has no such method, is given).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def f(x, w):
        return torch.relu(x @ w) * 2

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    f(x, w).sum().backward()
    expected, w.grad = w.grad.clone(), None
    for compile_with in (torch_api.aot_compile, lambda *a: torch_api._aot_compile_fullgraph(*a)):
        compiled = compile_with(f, {"dynamic": False}, (x, w), {})
        y = compiled(x, w)
        y.sum().backward()
        assert torch.allclose(y, f(x, w)) and torch.allclose(w.grad, expected)
        w.grad = None
        assert torch_api.aot_guards_pass(compiled, (x, w), {})
        assert not torch_api.aot_guards_pass(compiled, (torch.randn(5, 8), w), {})
        assert "size mismatch at index 0. expected 4, actual 5" in torch_api.aot_guard_failure(
            compiled, (torch.randn(5, 8), w), {})


def _scaled_linear(layer, x):  # at module level: a saved compile finds its source by module and lines
    return torch.relu(layer(x)) * 2


def test_an_ahead_of_time_compile_saved_and_loaded_keeps_its_guards_results_and_source(tmp_path, monkeypatch):
    # Gradients left by an earlier step are on the inputs while it compiles (they are
    # set aside, or the saved guards could not be loaded), and are there again after.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    _scaled_linear(layer, x).sum().backward()
    before = [t.grad.clone() for t in (*layer.parameters(), x)]
    compiled = torch_api.aot_compile(_scaled_linear, {"dynamic": False}, (layer, x), {})
    assert all(torch.equal(t.grad, g) for t, g in zip((*layer.parameters(), x), before))
    loaded = torch_api.aot_deserialize(torch_api.aot_serialize(compiled), _scaled_linear.__globals__)
    assert torch_api.aot_stale_source(loaded) is None
    assert torch_api.aot_guards_pass(loaded, (layer, x), {})
    assert not torch_api.aot_guards_pass(loaded, (layer, torch.randn(5, 8, requires_grad=True)), {})
    for t in (*layer.parameters(), x):
        t.grad = None
    y = loaded(layer, x)
    y.sum().backward()
    got = [t.grad.clone() for t in (*layer.parameters(), x)]
    for t in (*layer.parameters(), x):
        t.grad = None
    eager = _scaled_linear(layer, x)
    eager.sum().backward()
    assert torch.allclose(y, eager, atol=1e-6)
    assert all(torch.allclose(g, t.grad, atol=1e-6) for g, t in zip(got, (*layer.parameters(), x)))


def _causal(b, h, q, kv):
    return q >= kv


def _attend(q, k, v, mask):
    return flex_attention(q * 2, k, v, block_mask=mask)


@pytest.mark.slow
def test_a_saved_compile_of_flex_attention_loads_outside_a_compile(tmp_path, monkeypatch):
    # Its saved guards name a module the traced code imports (flex_attention's mask
    # functions); loading them installs a guard, which needs a tracing context.
    # (Forward only: flex_attention has no backward on the CPU.)
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))  # three buffers: torch 2.11's CPU lowering takes no fewer
    mask = create_block_mask(_causal, 1, 1, 128, 128, device="cpu")
    compiled = torch_api.aot_compile(_attend, {"dynamic": False}, (q, k, v, mask), {})
    loaded = torch_api.aot_deserialize(torch_api.aot_serialize(compiled), _attend.__globals__)
    assert torch_api.aot_guards_pass(loaded, (q, k, v, mask), {})
    assert torch.allclose(loaded(q, k, v, mask), compiled(q, k, v, mask))
