"""What tests/conftest.py sets up for the whole suite, checked from inside a run."""

from __future__ import annotations

import gc

import pytest


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
