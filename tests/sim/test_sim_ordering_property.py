"""Property: whatever mix of kernels, records, waits and syncs, the simulator respects
stream order and event dependencies, and runs every kernel exactly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from graphpool.sim import SimDevice

N_STREAMS, N_EVENTS = 3, 3

op = st.one_of(
    st.tuples(st.just("kernel"), st.integers(0, N_STREAMS - 1)),
    st.tuples(st.just("sleep"), st.integers(0, N_STREAMS - 1), st.integers(1, 4)),
    st.tuples(st.just("record"), st.integers(0, N_EVENTS - 1), st.integers(0, N_STREAMS - 1)),
    st.tuples(st.just("wait"), st.integers(0, N_STREAMS - 1), st.integers(0, N_EVENTS - 1)),
    st.tuples(st.just("sync_stream"), st.integers(0, N_STREAMS - 1)),
    st.tuples(st.just("sync_event"), st.integers(0, N_EVENTS - 1)),
    st.tuples(st.just("query"), st.integers(0, N_EVENTS - 1)),
)


def _appender(log: list[int], kid: int) -> Callable[[], None]:
    return lambda: log.append(kid)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=40))
def test_happens_before_is_respected(program: list[tuple[Any, ...]]) -> None:
    dev = SimDevice(0, 1 << 20)
    streams = [dev.create_stream() for _ in range(N_STREAMS)]
    events = [dev.create_event() for _ in range(N_EVENTS)]
    ran: list[int] = []  # kernel ids in execution order
    # Model: for each stream, the kernel ids it must follow (its own earlier kernels and
    # everything its waits imported); for each event, the kernel ids of its last record.
    deps: list[set[int]] = [set() for _ in range(N_STREAMS)]
    event_deps: list[set[int]] = [set() for _ in range(N_EVENTS)]
    must_follow: dict[int, set[int]] = {}
    next_id = 0
    for step in program:
        kind = step[0]
        if kind == "kernel":
            s = int(step[1])
            kid = next_id
            next_id += 1
            must_follow[kid] = set(deps[s])
            dev.launch_kernel(streams[s], _appender(ran, kid))
            deps[s].add(kid)
        elif kind == "sleep":
            dev.launch_sleep(streams[int(step[1])], rounds=int(step[2]))
        elif kind == "record":
            e, s = int(step[1]), int(step[2])
            dev.record_event(events[e], streams[s])
            event_deps[e] = set(deps[s])
        elif kind == "wait":
            s, e = int(step[1]), int(step[2])
            dev.stream_wait_event(streams[s], events[e])
            deps[s] |= event_deps[e]
        elif kind == "sync_stream":
            s = int(step[1])
            dev.stream_synchronize(streams[s])
            assert deps[s] <= set(ran)
        elif kind == "sync_event":
            e = int(step[1])
            dev.event_synchronize(events[e])
            assert event_deps[e] <= set(ran)
            assert dev.query_event(events[e])
        else:
            e = int(step[1])
            before = dev.pending_ops()
            done = dev.query_event(events[e])
            assert dev.pending_ops() == before  # a query runs nothing
            if done:
                assert event_deps[e] <= set(ran)
    dev.device_synchronize()
    assert sorted(ran) == list(range(next_id))
    position = {kid: i for i, kid in enumerate(ran)}
    for kid, earlier in must_follow.items():
        assert all(position[b] < position[kid] for b in earlier)
