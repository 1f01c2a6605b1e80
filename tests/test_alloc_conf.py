"""PyTorch's allocator options in ``GRAPHPOOL_ALLOC_CONF`` and ``gp.set_allocator_config``:
parsing (each key, bad values, unknown keys) and their effect through the public API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.policy.limits import parse_alloc_conf, parse_divisions
from graphpool.sim import SimBackend

MiB = 1024 * 1024


@pytest.fixture
def sim() -> Iterator[None]:
    """A fresh simulated device; afterwards no configuration and the default backend again."""
    runtime.set_backend("sim", backend=SimBackend(memory_bytes=1024 * MiB))
    try:
        yield
    finally:
        gp.set_backend("sim")
        gp.set_allocator_config("")


def test_each_pytorch_key_parses() -> None:
    conf = parse_alloc_conf(
        "max_split_size_mb:512, max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:4,expandable_segments:False"
    )
    assert conf.max_split_size == 512 * MiB
    assert conf.max_non_split_rounding == 64 * MiB
    assert conf.roundup_power2_divisions == (4,) * 16
    assert conf.garbage_collection_threshold == 0.6
    assert conf.expandable_segments is False
    assert conf.policy() == {
        "max_split_size": 512 * MiB,
        "max_non_split_rounding": 64 * MiB,
        "roundup_power2_divisions": (4,) * 16,
        "garbage_collection_threshold": 0.6,
        "expandable_segments": False,
    }
    assert parse_alloc_conf("expandable_segments:True").policy() == {"expandable_segments": True}
    assert parse_alloc_conf("max_split_size_mb:20").max_split_size == 20 * MiB  # PyTorch's least
    assert parse_alloc_conf("max_split_size_mb:64,max_split_size_mb:128").max_split_size == 128 * MiB


def test_the_list_form_of_roundup_power2_divisions_follows_pytorch() -> None:
    # PyTorch's parseRoundUpPower2Divisions: an entry per power of two from 1 MiB; the first
    # value also fills every range below it, ">" every range after the last one named.
    assert parse_divisions("[256:1,512:2,>:8]") == (1,) * 9 + (2,) + (8,) * 6
    assert parse_divisions("[1:4, 2:8]") == (4, 8) + (0,) * 14
    assert parse_divisions("[>:2]") == (0,) + (2,) * 15
    assert parse_divisions("[65536:2]") == (2,) * 16  # past the last range: the last entry
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,>:4],max_split_size_mb:100")
    assert conf.roundup_power2_divisions == (1,) * 9 + (4,) * 7
    assert conf.max_split_size == 100 * MiB


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("max_split_size_mb:19", ">= 20"),
        ("max_split_size_mb:big", "not a whole number"),
        ("max_split_size_mb:-40", "not a whole number"),
        ("max_non_split_rounding_mb:1", ">= 20"),
        ("garbage_collection_threshold:0", r"\(0.0, 1.0\)"),
        ("garbage_collection_threshold:1.0", r"\(0.0, 1.0\)"),
        ("garbage_collection_threshold:most", "not a number"),
        ("roundup_power2_divisions:3", "power of two"),
        ("roundup_power2_divisions:[256:3]", "power of two or 0"),
        ("roundup_power2_divisions:[100:2]", "must be a power of two"),
        ("roundup_power2_divisions:[256:1", "expected a list"),
        ("roundup_power2_divisions:[]", "expected a list"),
        ("roundup_power2_divisions:[256]", "size_mb:divisions"),
        ("roundup_power2_divisions:[4]", "'4' is not size_mb:divisions"),
        ("roundup_power2_divisions:[256:x]", "^roundup_power2_divisions:x is not a whole number$"),
        ("expandable_segments:yes", "True or False"),
        ("max_split_size:512", "with a key among"),
        ("backend:cudaMallocAsync", "with a key among"),
    ],
)
def test_bad_values_and_unknown_keys_are_refused(bad: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_alloc_conf(bad)


def test_max_split_size_mb_from_the_environment(sim: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_ALLOC_CONF", "max_split_size_mb:40")
    gp.alloc(50 * MiB).free()
    with gp.alloc(30 * MiB):  # the cached 50 MiB block is oversize: not for a 30 MiB request
        assert gp.memory_stats()["reserved_bytes.all.current"] == 80 * MiB


def test_garbage_collection_threshold_through_the_public_api(sim: None) -> None:
    gp.set_allocator_config("garbage_collection_threshold:0.5,per_process_memory_fraction:1.0")
    for _ in range(3):  # three 300 MiB segments, cached
        bufs = [gp.alloc(300 * MiB) for _ in range(3)]
        for b in bufs:
            b.free()
    assert gp.memory_stats()["reserved_bytes.all.current"] == 900 * MiB
    with gp.alloc(100 * MiB):  # a cached block fits: no collection; its block is the youngest
        pass
    with gp.alloc(400 * MiB):  # a new segment, 900 MiB > 0.5 x 1 GiB: the two older blocks go back
        assert gp.memory_stats()["num_device_free"] == 2
        assert gp.memory_stats()["reserved_bytes.all.current"] == 700 * MiB


def test_set_allocator_config_before_the_first_allocation(sim: None) -> None:
    gp.set_allocator_config("roundup_power2_divisions:4")
    with gp.alloc(4200):
        assert gp.memory_stats()["allocated_bytes.all.current"] == 5120
    with pytest.raises(RuntimeError, match="before the first allocation"):
        gp.set_allocator_config("max_split_size_mb:40")
    gp.set_backend("sim")  # a new backend has not allocated yet: allowed again
    gp.set_allocator_config("")
    with gp.alloc(4200):
        assert gp.memory_stats()["allocated_bytes.all.current"] == 4608


def test_set_allocator_config_applies_to_an_allocator_made_but_unused(sim: None) -> None:
    gp.memory_stats()  # makes the device's allocator, allocates nothing
    gp.set_allocator_config("max_split_size_mb:40,memory_limit:200MiB")
    assert gp.get_memory_limit() == 200 * MiB
    gp.alloc(50 * MiB).free()
    with gp.alloc(30 * MiB):
        assert gp.memory_stats()["reserved_bytes.all.current"] == 80 * MiB


def test_set_allocator_config_keeps_the_limits_it_does_not_name(sim: None) -> None:
    """The README's order: the fraction and the limit first, then the options."""
    gp.set_per_process_memory_fraction(0.5)
    gp.set_memory_limit(300 * MiB)
    gp.set_allocator_config("max_split_size_mb:512,roundup_power2_divisions:4")
    assert (gp.get_per_process_memory_fraction(), gp.get_memory_limit()) == (0.5, 300 * MiB)
    gp.set_allocator_config("memory_limit:100MiB")  # names the limit: only the limit changes
    assert (gp.get_per_process_memory_fraction(), gp.get_memory_limit()) == (0.5, 100 * MiB)
    gp.set_allocator_config("per_process_memory_fraction:0.25")
    assert (gp.get_per_process_memory_fraction(), gp.get_memory_limit()) == (0.25, 100 * MiB)
    gp.set_allocator_config("")  # forgets the options' keys; the limits set stay
    assert (gp.get_per_process_memory_fraction(), gp.get_memory_limit()) == (0.25, 100 * MiB)
    with pytest.raises(gp.OutOfMemoryError, match="memory limit"):
        gp.alloc(150 * MiB)


def test_set_allocator_config_keeps_the_keys_of_earlier_calls(sim: None) -> None:
    gp.set_allocator_config("roundup_power2_divisions:4")
    gp.set_allocator_config("max_split_size_mb:40")  # the rounding stays
    with gp.alloc(4200):
        assert gp.memory_stats()["allocated_bytes.all.current"] == 5120
    gp.set_backend("sim")
    gp.set_allocator_config("roundup_power2_divisions:1")  # a later value of a key wins
    with gp.alloc(4200):
        assert gp.memory_stats()["allocated_bytes.all.current"] == 4608
    gp.set_backend("sim")
    gp.set_allocator_config("")  # forgets both keys
    gp.alloc(50 * MiB).free()
    with gp.alloc(30 * MiB):  # no max_split_size any more: the cached block is split
        assert gp.memory_stats()["reserved_bytes.all.current"] == 50 * MiB


def test_set_allocator_config_keys_win_over_the_variable(sim: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_ALLOC_CONF", "roundup_power2_divisions:4")
    gp.set_allocator_config("roundup_power2_divisions:1")
    with gp.alloc(4200):
        assert gp.memory_stats()["allocated_bytes.all.current"] == 4608


def test_set_allocator_config_refuses_bad_text_and_changes_nothing(sim: None) -> None:
    with pytest.raises(ValueError, match="True or False"):
        gp.set_allocator_config("expandable_segments:maybe")
    with pytest.raises(ValueError, match="with a key among"):
        gp.set_allocator_config("max_split_size_mb:64,nonsense:1")
    with pytest.raises(TypeError, match="takes a str"):
        gp.set_allocator_config(None)  # type: ignore[arg-type]
    gp.alloc(50 * MiB).free()
    with gp.alloc(30 * MiB):  # no max_split_size: the cached block is split
        assert gp.memory_stats()["reserved_bytes.all.current"] == 50 * MiB


def test_torch_snapshot_reports_the_options(sim: None) -> None:
    settings = gp.torch_snapshot()["allocator_settings"]
    assert (settings["max_split_size"], settings["garbage_collection_threshold"]) == (-1, 0.0)
    gp.set_allocator_config("max_split_size_mb:64,garbage_collection_threshold:0.25")
    settings = gp.torch_snapshot()["allocator_settings"]
    assert (settings["max_split_size"], settings["garbage_collection_threshold"]) == (64 * MiB, 0.25)


def test_a_mempool_made_before_set_allocator_config_counts_oversize_by_it(sim: None) -> None:
    """A MemPool's private pool can exist before the first allocation, when the configuration
    may still change: its oversize statistics follow the configuration set after it."""
    from graphpool.sim import xp

    pool = gp.MemPool()
    gp.memory_stats(pool=pool.id)  # its pool made now, before the configuration
    gp.set_allocator_config("max_split_size_mb:40")
    with gp.use_mem_pool(pool):
        x = xp.ones(64 << 18, dtype=xp.float32)  # 64 MiB: oversize
    assert gp.memory_stats()["oversize_allocations.current"] == 1
    assert gp.memory_stats(pool=pool.id)["oversize_allocations.current"] == 1
    gp.check_invariants()
    del x
