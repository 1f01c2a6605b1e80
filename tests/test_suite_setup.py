"""What tests/conftest.py sets up for the whole suite, checked from inside a run."""

from __future__ import annotations

import gc
import importlib
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def test_what_collection_built_is_frozen_out_of_the_collector() -> None:
    """``gp.graph`` collects garbage at every capture's start; the suite's own modules and
    parameters are kept out of those collections (they made the property machines' and the
    capture tests' time grow with everything imported before them)."""
    assert gc.get_freeze_count() > 0


def test_gpu_tests_share_one_xdist_group(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup`` every `gpu` test runs on one worker: one device, tests in turn."""
    gpu = [item for item in request.session.items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        pytest.skip("no gpu test selected in this run")
    groups = {m.args[0] for item in gpu for m in item.iter_markers("xdist_group")}
    assert groups == {"gpu"}, groups


def _derandomized_draws() -> list[int]:
    """The integers a derandomized test draws (the same test each call: the same seed)."""
    seen: list[int] = []

    @settings(max_examples=300, derandomize=True, database=None)
    @given(st.integers(0, 10**6))
    def draw(n: int) -> None:
        seen.append(n)

    draw()
    return seen


def test_ci_examples_do_not_depend_on_the_modules_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under CI's profile a derandomized test draws the same examples after a local module
    full of new literals is imported: hypothesis mines literals from the local modules loaded
    and draws from them now and then, which made CI's examples differ between a test file run
    alone and the whole suite (tests/conftest.py leaves them out under CI)."""
    if not os.environ.get("CI"):
        pytest.skip("CI's profile only: elsewhere the property tests explore")
    from hypothesis.internal.conjecture import providers

    if not hasattr(providers, "_local_constants"):  # what conftest.pin_mined_constants replaces
        pytest.skip("this hypothesis mines no local constants under that name (nothing to pin)")
    first = _derandomized_draws()
    literals = ", ".join(str(7919 * k + 13) for k in range(1, 60))
    (tmp_path / "graphpool_literals_probe.py").write_text(f"VALUES = ({literals})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("graphpool_literals_probe")
    assert _derandomized_draws() == first
