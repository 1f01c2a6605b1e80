"""Logging through the stdlib logger ``graphpool``: slow paths only, nothing formatted when
the level is off, nothing at all on the cached malloc/free path."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.policy import logs
from simenv import fresh_sim

MiB = 1024 * 1024


@pytest.fixture
def small() -> Iterator[Any]:
    with fresh_sim(1, 64 * MiB) as rt:
        yield rt


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "graphpool" and r.levelno == level]


def test_segments_are_logged_with_device_size_stream_and_pool(
    small: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="graphpool")
    s = gp.Stream()
    buf = gp.alloc(1000, stream=s)
    base = runtime.allocator().lookup(buf.ptr)
    assert base is not None
    [allocated] = messages(caplog, logging.DEBUG)
    assert allocated == (
        f"device 0: segment allocated at 0x{buf.ptr:x}, {2 * MiB} bytes, stream 0x{s.handle:x}, ordinary pool"
    )
    caplog.clear()
    buf.free()
    assert messages(caplog, logging.DEBUG) == []  # a cached free logs nothing
    gp.empty_cache()
    assert messages(caplog, logging.DEBUG) == [
        f"device 0: segment released at 0x{buf.ptr:x}, {2 * MiB} bytes, stream 0x{s.handle:x}, ordinary pool"
    ]


def test_captures_and_private_pools_are_logged(small: Any, caplog: pytest.LogCaptureFixture) -> None:
    xp = pytest.importorskip("graphpool.sim.xp")
    caplog.set_level(logging.DEBUG, logger="graphpool")
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(100)
    pool = tuple(g.pool())
    text = "\n".join(messages(caplog, logging.DEBUG))
    assert f"private pool {pool} created" in text
    assert "began on stream" in text and f"({g.label}), private pool {pool}" in text
    assert "ended on stream" in text
    assert "segment allocated at" in text and f"private pool {pool}" in text
    caplog.clear()
    del out
    g.reset()
    gp.empty_cache()
    text = "\n".join(messages(caplog, logging.DEBUG))
    assert "segment released" in text and f"private pool {pool}" in text
    assert f"private pool {pool} released" in text


def test_a_failed_capture_is_logged_as_failed(small: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="graphpool")
    g = gp.CUDAGraph()
    with pytest.raises(RuntimeError, match="boom"), gp.graph(g):
        raise RuntimeError("boom")
    assert any(" failed on stream " in m for m in messages(caplog, logging.DEBUG))


def test_out_of_memory_and_limit_hits_are_logged_at_info(
    small: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="graphpool")
    gp.set_memory_limit(4 * MiB)
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(5 * MiB)
    logged = messages(caplog, logging.INFO)
    assert logged[-1] == str(info.value)  # the error, as raised
    refused = [m for m in logged if "refused by" in m]
    assert refused and all("memory limit of 4.00 MiB" in m for m in refused)
    assert f"a new segment of {20 * MiB} bytes refused" in refused[0]
    assert messages(caplog, logging.DEBUG) == []  # INFO: no segment chatter


class CountingLogger:
    """Stands in for the allocator's logger: counts every call, level ``enabled`` or off."""

    disabled = False

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.checks = 0
        self.records = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Stand in for the allocator's logger, with an empty level cache (so it is asked)."""
        monkeypatch.setattr(logs, "log", self)
        monkeypatch.setattr(logs, "LEVELS", {})

    def isEnabledFor(self, level: int) -> bool:
        self.checks += 1
        return self.enabled

    def _record(self, *args: Any, **kwargs: Any) -> None:
        self.records += 1

    debug = info = warning = error = _record


def test_nothing_is_logged_when_the_level_is_off(small: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    log = CountingLogger(enabled=False)
    log.install(monkeypatch)
    gp.set_memory_limit(30 * MiB)
    g = gp.CUDAGraph()
    with gp.stream(gp.Stream()):
        g.capture_begin()
        x = gp.alloc(1000)
        g.reset()
    del x
    buf = gp.alloc(1000)
    buf.free()
    gp.empty_cache()
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(40 * MiB)
    assert log.checks > 0  # every slow path asked
    assert log.records == 0  # and none went on to format a record


def test_the_cached_malloc_and_free_never_touch_the_logger(
    small: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = gp.Stream()
    gp.alloc(1000, stream=s).free()  # the segment now sits in the cache
    log = CountingLogger(enabled=True)
    log.install(monkeypatch)
    for _ in range(50):
        gp.alloc(1000, stream=s).free()
    assert (log.checks, log.records) == (0, 0)
    gp.alloc(4 * MiB, stream=s).free()  # a new segment: the slow path logs
    assert log.checks > 0 and log.records > 0


def test_the_level_test_reads_the_loggers_cache() -> None:
    """Compiled, a cached answer is read without running Python code (no signal handler can
    run inside the test, in the middle of an update): the allocator reads the logger's own
    cache, which logging clears in place when a level changes."""
    log = logging.getLogger("graphpool")
    assert logs.LEVELS is log._cache  # type: ignore[attr-defined]
    old = log.level
    try:
        log.setLevel(logging.DEBUG)
        assert logs.enabled(logging.DEBUG) is True
        assert logs.LEVELS[logging.DEBUG] is True
        log.setLevel(logging.WARNING)
        assert logging.DEBUG not in logs.LEVELS  # cleared by the level change
        assert logs.enabled(logging.DEBUG) is False
        log.disabled = True
        assert logs.enabled(logging.WARNING) is False
    finally:
        log.disabled = False
        log.setLevel(old)


@pytest.mark.filterwarnings("ignore:graph#.* captured no work:UserWarning")
def test_a_pool_with_no_segment_is_logged_released_when_its_last_use_ends(
    small: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph that allocated nothing: its pool goes when the graph is reset (no segment to
    wait for empty_cache), and that release is logged."""
    caplog.set_level(logging.DEBUG, logger="graphpool")
    g = gp.CUDAGraph()
    with gp.graph(g):
        pass
    pool = tuple(g.pool())
    caplog.clear()
    g.reset()
    assert messages(caplog, logging.DEBUG) == [f"device 0: private pool {pool} released"]
