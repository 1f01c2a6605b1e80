"""Memory limits: ``set_per_process_memory_fraction``, ``set_memory_limit`` and
``GRAPHPOOL_ALLOC_CONF``, enforced at every segment allocation like a real out-of-memory."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.policy.limits import AllocConf, MemoryLimits, parse_alloc_conf, parse_size
from graphpool.sim import SimBackend
from simenv import fresh_sim

MiB = 1024 * 1024
TOTAL = 64 * MiB


@pytest.fixture
def small() -> Iterator[Any]:
    """Two simulated devices of 64 MiB each; the default backend again afterwards."""
    with fresh_sim(2, TOTAL) as rt:
        yield rt


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("bad", ["0.5", None, True, [0.5], 1j])
def test_fraction_of_the_wrong_type_is_a_type_error(small: Any, bad: Any) -> None:
    with pytest.raises(TypeError, match="fraction"):
        gp.set_per_process_memory_fraction(bad)
    assert gp.get_per_process_memory_fraction() == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, 2])
def test_fraction_out_of_range_is_a_value_error(small: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gp.set_per_process_memory_fraction(bad)
    assert gp.get_per_process_memory_fraction() == 1.0


@pytest.mark.parametrize("bad", [1.5, "8GiB", True, [8]])
def test_limit_of_the_wrong_type_is_a_type_error(small: Any, bad: Any) -> None:
    with pytest.raises(TypeError, match="int number of bytes or None"):
        gp.set_memory_limit(bad)
    assert gp.get_memory_limit() is None


def test_negative_limit_is_a_value_error(small: Any) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        gp.set_memory_limit(-1)
    assert gp.get_memory_limit() is None


def test_getters_give_what_was_set_per_device(small: Any) -> None:
    assert gp.get_per_process_memory_fraction() == 1.0  # PyTorch's answer when none is set
    assert gp.get_memory_limit() is None
    gp.set_per_process_memory_fraction(0.25, device=1)
    gp.set_memory_limit(8 * MiB, device=1)
    assert gp.get_per_process_memory_fraction(1) == 0.25
    assert gp.get_memory_limit(1) == 8 * MiB
    assert gp.get_per_process_memory_fraction(0) == 1.0  # another device is untouched
    assert gp.get_memory_limit(0) is None
    gp.set_per_process_memory_fraction(1, device=1)  # an int 1 is fine: no cap beyond the device
    gp.set_memory_limit(None, device=1)
    assert gp.get_per_process_memory_fraction(1) == 1.0
    assert gp.get_memory_limit(1) is None
    assert runtime.allocator(1).limits.cap is None


# ----------------------------------------------------------------- enforcement
def test_byte_limit_refuses_a_segment_as_an_out_of_memory(small: Any) -> None:
    gp.set_memory_limit(8 * MiB)
    keep = gp.alloc(1000)  # a 2 MiB small segment
    before = gp.memory_stats()
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(7 * MiB)  # a 20 MiB segment, then the least one of 8 MiB: 2 + 8 > 8
    msg = str(info.value)
    assert "limit was hit" in msg
    assert "memory limit of 8.00 MiB" in msg and str(8 * MiB) in msg
    assert "set_memory_limit" in msg and "fraction" not in msg
    assert msg.endswith("then call empty_cache(); or raise the limit.")
    after = gp.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["reserved_bytes.all.current"] == 2 * MiB  # the device itself had room
    gp.check_invariants()
    with gp.alloc(5 * MiB) as buf:  # 2 + 6 (its least segment) fits under 8
        assert buf.nbytes == 5 * MiB
    gp.set_memory_limit(None)
    with gp.alloc(7 * MiB):
        pass
    keep.free()


def test_limit_releases_the_cache_and_retries_first(small: Any) -> None:
    cached = gp.alloc(1000)  # a 2 MiB segment, free and cached once freed
    cached.free()
    assert gp.memory_reserved() == 2 * MiB
    gp.set_memory_limit(5 * MiB)
    before = gp.memory_stats()
    buf = gp.alloc(3 * MiB)  # 20 MiB refused; cache released; retry refused; least (4 MiB) fits
    after = gp.memory_stats()
    assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
    assert after["num_device_free"] == before["num_device_free"] + 1  # the cached segment went
    assert after["num_ooms"] == before["num_ooms"]
    assert gp.memory_reserved() == 4 * MiB
    buf.free()
    gp.check_invariants()


def test_fraction_caps_reserved_memory_at_a_share_of_the_device(small: Any) -> None:
    gp.set_per_process_memory_fraction(0.25)  # 16 MiB of 64
    with gp.alloc(14 * MiB):  # its own 14 MiB segment
        pass
    gp.empty_cache()
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(18 * MiB)  # 18 MiB segment > 16 MiB
    msg = str(info.value)
    assert "per-process memory fraction 0.25" in msg
    assert "16.00 MiB" in msg and "set_per_process_memory_fraction" in msg
    assert "set_memory_limit" not in msg
    gp.check_invariants()


def test_the_smaller_limit_binds_and_the_message_names_it(small: Any) -> None:
    gp.set_per_process_memory_fraction(0.5)  # 32 MiB
    gp.set_memory_limit(12 * MiB)
    assert runtime.allocator().limits.cap == 12 * MiB
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(14 * MiB)  # under the fraction, over the byte limit
    msg = str(info.value)
    assert "memory limit of 12.00 MiB" in msg and "fraction" not in msg
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(40 * MiB)  # over both
    assert "fraction 0.5" in str(info.value) and "memory limit of 12.00 MiB" in str(info.value)


def test_a_zero_limit_refuses_every_segment(small: Any) -> None:
    gp.set_memory_limit(0)
    with pytest.raises(gp.OutOfMemoryError, match="limit was hit"):
        gp.alloc(1)
    assert gp.memory_reserved() == 0
    assert gp.alloc(0).ptr == 0  # a null buffer needs no memory


def test_a_limit_below_what_is_reserved_keeps_what_is_there(small: Any) -> None:
    buf = gp.alloc(12 * MiB)
    gp.set_memory_limit(4 * MiB)
    assert gp.memory_reserved() == 12 * MiB  # nothing is taken back
    with pytest.raises(gp.OutOfMemoryError, match="limit was hit"):
        gp.alloc(1000)  # a new 2 MiB segment: 14 > 4
    buf.free()
    gp.empty_cache()
    with gp.alloc(1000):  # 2 <= 4 once the cache is back
        pass


def test_limit_holds_inside_a_capture(small: Any) -> None:
    c = gp.alloc(20 * MiB)
    c.free()  # cached: releasing it would make room, but not during capture
    gp.set_memory_limit(24 * MiB)
    before = gp.memory_stats()
    g = gp.CUDAGraph()
    s = gp.Stream()
    with gp.stream(s):
        g.capture_begin()
        x = gp.alloc(1000)  # a 2 MiB private segment: 22 MiB reserved
        with pytest.raises(gp.OutOfMemoryError) as info:
            gp.alloc(3 * MiB)  # a 20 MiB segment, then 4 MiB: 26 > 24
        assert gp.is_current_stream_capturing()  # the capture goes on
        assert "limit was hit" in str(info.value) and "capture" in str(info.value)
        after = gp.memory_stats()
        assert after["num_ooms"] == before["num_ooms"] + 1
        assert after["num_device_free"] == before["num_device_free"]  # nothing released
        g.reset()  # abandon it
    del x
    gp.check_invariants()


# ------------------------------------------------------------------ GRAPHPOOL_ALLOC_CONF
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8589934592", 8 * 1024**3),
        ("8GiB", 8 * 1024**3),
        ("512 MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("4kib", 4096),
        ("0", 0),
        ("10B", 10),
    ],
)
def test_sizes_parse(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 XB", "-1", "8GiBs", "1e9"])
def test_bad_sizes_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


def test_alloc_conf_parses_both_keys() -> None:
    conf = parse_alloc_conf(" memory_limit:8GiB , per_process_memory_fraction:0.5,")
    assert conf.memory_limit == 8 * 1024**3
    assert conf.per_process_memory_fraction == 0.5
    assert parse_alloc_conf("") == AllocConf()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("memory_limit", "key:value"),
        ("max_splt_size_mb:128", "memory_limit, per_process_memory_fraction"),
        ("memory_limit:lots", "not a size"),
        ("per_process_memory_fraction:half", "not a number"),
        ("per_process_memory_fraction:1.5", r"\[0, 1\]"),
    ],
)
def test_bad_alloc_conf_is_refused(bad: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_alloc_conf(bad)


def test_alloc_conf_applies_to_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_ALLOC_CONF", "memory_limit:8MiB,per_process_memory_fraction:0.5")
    runtime.set_backend("sim", backend=SimBackend(device_count=2, memory_bytes=TOTAL))
    try:
        for device in (0, 1):
            assert gp.get_memory_limit(device) == 8 * MiB
            assert gp.get_per_process_memory_fraction(device) == 0.5
        with pytest.raises(gp.OutOfMemoryError, match=r"memory limit of 8\.00 MiB"):
            gp.alloc(9 * MiB)
        gp.set_memory_limit(None)  # the calls override it
        with gp.alloc(9 * MiB):
            pass
    finally:
        gp.empty_cache()
        monkeypatch.delenv("GRAPHPOOL_ALLOC_CONF")
        gp.set_backend("sim")


def test_bad_alloc_conf_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_ALLOC_CONF", "memory_limt:8GiB")
    gp.set_backend("sim")
    try:
        with pytest.raises(ValueError, match="GRAPHPOOL_ALLOC_CONF='memory_limt:8GiB'"):
            gp.alloc(1)
    finally:
        monkeypatch.delenv("GRAPHPOOL_ALLOC_CONF")
        gp.set_backend("sim")
    with gp.alloc(1):  # fine once the variable is gone
        pass


def test_memory_limits_describe_the_cap_they_pass() -> None:
    lim = MemoryLimits(100, 0.5, 80)
    assert lim.cap == 50 and lim.fraction_bytes() == 50
    assert lim.refusal(40, 10, str) is None  # 50 is allowed
    assert "fraction 0.5" in (lim.refusal(40, 11, str) or "")
    assert "memory limit" not in (lim.refusal(40, 11, str) or "")
    both = lim.refusal(70, 11, str) or ""
    assert both == (
        "the per-process memory fraction 0.5 of the device's 100 (= 50; set_per_process_memory_fraction)"
        " and the memory limit of 80 (80 bytes; set_memory_limit)"
    )
    assert lim.with_fraction(None).cap == 80 and lim.with_bytes(None).cap == 50
    assert MemoryLimits(100).cap is None


def test_a_limit_refusal_that_the_cache_then_satisfied_is_not_blamed_later() -> None:
    """A segment refused by a limit, the request then served from the cache: a later
    out-of-memory error with no limit in force does not say a limit was hit."""
    import graphpool as gp

    gp.set_backend("sim")
    a = gp.runtime.allocator()
    a._limit_hit = "a memory limit of 20.00 MiB"  # as a refusal earlier in the process left it
    gp.set_memory_limit(None)
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(a._total + 1)
    assert "limit" not in str(info.value)
    half = gp.alloc(a._total // 2 + (1 << 20))
    a._limit_hit = "a memory limit of 20.00 MiB"
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(a._total // 2 + (1 << 20))  # a segment the device cannot give: no limit either
    assert "a limit was hit" not in str(info.value)
    half.free()
    gp.empty_cache()
