"""Probe graphpool's CUDA device layer on a real GPU: every CudaDevice method, once.

Run on a GPU machine from the repository root::

    PYTHONPATH=src python3 benchmarks/gpu_probe.py

Prints versions, then PASS/FAIL (or SKIP/INFO) per item, and exits 1 if anything
failed. It uses only graphpool.device.cuda, graphpool.device.protocol and
graphpool.errors, so it checks the device layer alone, before any policy runs on it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import graphpool.device.cuda as gcuda
from graphpool.device.protocol import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
    CAPTURE_STATUS_NONE,
    LEGACY_STREAM,
    Backend,
    Device,
)
from graphpool.errors import CUDAError

MiB = 1 << 20
RESULTS: dict[str, int] = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def report(status: str, item: str, detail: str = "") -> None:
    """Print one result line and count it."""
    RESULTS[status] = RESULTS.get(status, 0) + 1
    print(f"{status:4}  {item}" + (f"  -- {detail}" if detail else ""), flush=True)


def check(item: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn``; PASS if it returns without raising (its return is the detail)."""
    try:
        out = fn()
    except Exception as exc:
        tb = traceback.format_exc(limit=3).strip().splitlines()
        report("FAIL", item, f"{type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}")
        return None
    report("PASS", item, "" if out is None else str(out))
    return out


def expect(cond: bool, what: str) -> None:
    """Assert with a message that survives ``python -O``."""
    if not cond:
        raise AssertionError(what)


def raises_cuda(fn: Callable[[], Any], *names: str) -> str:
    """Run ``fn`` expecting CUDAError (one of ``names`` if given); return its text."""
    try:
        out = fn()
    except CUDAError as exc:
        expect(bool(exc.name) and isinstance(exc.code, int) and exc.code != 0, "fields")
        if names:
            expect(exc.name in names, f"got {exc.name}, expected one of {names}")
        return f"{exc.name} ({exc.code}): {exc.meaning}"
    raise AssertionError(f"no CUDAError; returned {out!r}")


def main() -> int:
    """Run every probe item in order."""
    lazy = "cuda.bindings" not in sys.modules
    report("PASS" if lazy else "FAIL", "import graphpool.device.cuda is lazy")

    t0 = time.perf_counter()
    avail = gcuda.is_available()
    dt = (time.perf_counter() - t0) * 1e3
    report("PASS" if avail else "FAIL", "is_available()", f"{avail} in {dt:.1f} ms")
    if not avail:
        return 1
    v = check("versions()", gcuda.versions)
    if v:
        print(
            f"      cuda-bindings {v['cuda_bindings']}, driver CUDA {v['driver']}, "
            f"runtime {v['runtime']}, python {sys.version.split()[0]}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
        )

    be = gcuda.CudaBackend()
    n_dev = be.device_count()

    def backend() -> str:
        expect(be.name == "cuda" and n_dev >= 1, f"{be.name}, {n_dev}")
        return f"{n_dev} device(s)"

    check("backend name/device_count", backend)
    d = be.get_device(0)

    def get_device() -> str:
        expect(be.get_device(0) is d, "same object")
        return repr(d)

    check("get_device(0) cached, name", get_device)
    check(
        "isinstance Device / Backend (runtime_checkable)",
        lambda: expect(isinstance(d, Device) and isinstance(be, Backend), "protocol"),
    )
    check(
        "get_device(out of range) -> CUDAError",
        lambda: raises_cuda(lambda: be.get_device(n_dev), "cudaErrorInvalidDevice"),
    )
    check("set_current_device(0)", lambda: be.set_current_device(0))

    # -- memory ---------------------------------------------------------------
    def mem_info() -> str:
        free, total = d.mem_info()
        expect(0 < free <= total, f"mem_info {free}, {total}")
        return f"free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB"

    check("mem_info", mem_info)

    def malloc_free() -> str:
        p = d.malloc(MiB)
        expect(isinstance(p, int) and p != 0, f"ptr {p!r}")
        assert p is not None
        d.free(p)
        return hex(p)

    check("malloc(1 MiB)/free", malloc_free)

    def oom() -> str:
        p = d.malloc(10 * 10**12)
        expect(p is None, f"10 TB malloc returned {p!r}")
        q = d.malloc(MiB)  # the next call is clean
        expect(q is not None, "malloc after OOM")
        assert q is not None
        d.free(q)
        d.mem_info()
        return "None, then malloc/mem_info ok"

    check("malloc(10 TB) -> None, state clean", oom)
    check(
        "free(bogus) -> CUDAError with name and meaning",
        lambda: raises_cuda(lambda: d.free(0x1234)),
    )
    check("calls still clean after error", malloc_free)

    n = 4 * MiB
    a = d.malloc(n)
    b = d.malloc(n)
    assert a is not None and b is not None
    s1 = check("create_stream", d.create_stream)
    s2 = d.create_stream()
    s3 = d.create_stream()
    check(
        "stream handles are distinct non-zero ints",
        lambda: expect(
            len({s1, s2, s3}) == 3 and all(isinstance(s, int) and s for s in (s1, s2, s3)),
            "handles",
        ),
    )

    def memset_read_legacy() -> None:
        d.memset(a, 0xAB, n, LEGACY_STREAM)
        expect(d.read(a, n, LEGACY_STREAM) == b"\xab" * n, "legacy memset/read")

    check("memset/read on legacy stream 0", memset_read_legacy)

    def write_read() -> None:
        data = os.urandom(n)
        d.write(a, data, s1)
        expect(d.read(a, n, s1) == data, "write/read")
        expect(d.read(a, 0, s1) == b"", "read 0 bytes")
        d.write(a, b"", s1)

    check("write/read round-trip (4 MiB random)", write_read)

    def memcpy_rt() -> None:
        d.memset(a, 0x11, n, s1)
        d.memcpy(b, a, n, s1)
        d.memset(a + 16, 0x22, 16, s1)
        out = d.read(b, 64, s1)
        expect(out == b"\x11" * 64, f"memcpy got {out[:8]!r}")
        expect(d.read(a, 48, s1) == b"\x11" * 16 + b"\x22" * 16 + b"\x11" * 16, "offsets")

    check("memcpy D2D + memset at offset", memcpy_rt)

    def low_byte() -> None:
        d.memset(b, 0x1FF, 8, s1)
        expect(d.read(b, 8, s1) == b"\xff" * 8, "low byte")

    check("memset uses low byte of value", low_byte)

    def stream_sync() -> None:
        d.stream_synchronize(s1)
        d.stream_synchronize(LEGACY_STREAM)

    check("stream_synchronize (s1, legacy)", stream_sync)
    check("device_synchronize", d.device_synchronize)

    # -- events ---------------------------------------------------------------
    e1 = check("create_event", d.create_event)
    e2 = d.create_event()
    check(
        "query_event on unrecorded event -> True",
        lambda: expect(d.query_event(e1) is True, "unrecorded"),
    )

    big_n = 4 << 30
    big = d.malloc(big_n)

    def not_ready() -> str:
        expect(big is not None, "4 GiB buffer")
        assert big is not None
        for i in range(20):
            d.memset(big, i, big_n, s1)
        d.record_event(e1, s1)
        q = d.query_event(e1)
        d.event_synchronize(e1)
        expect(d.query_event(e1) is True, "done after synchronize")
        return f"query right after 80 GiB of memsets: {q} (expected False)"

    check("record_event / query_event (NotReady) / event_synchronize", not_ready)

    def wait_event() -> None:
        d.memset(a, 0x33, n, s1)
        d.record_event(e2, s1)
        d.stream_wait_event(s2, e2)
        d.memcpy(b, a, n, s2)
        expect(d.read(b, n, s2) == b"\x33" * n, "s2 saw s1's memset via event")

    check("stream_wait_event orders s2 after s1", wait_event)

    # -- capture mode ---------------------------------------------------------
    def exchange() -> str:
        prev = d.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        seen: list[int] = []
        th = threading.Thread(target=lambda: seen.append(d.exchange_capture_mode(CAPTURE_MODE_GLOBAL)))
        th.start()
        th.join()
        back = d.exchange_capture_mode(prev)
        expect(prev == CAPTURE_MODE_GLOBAL, f"initial mode {prev}")
        expect(back == CAPTURE_MODE_RELAXED, f"swapped back {back}")
        expect(seen == [CAPTURE_MODE_GLOBAL], f"other thread's mode {seen}")
        return f"prev={prev} back={back} other-thread={seen[0]}"

    check("exchange_capture_mode (per thread)", exchange)
    check(
        "exchange_capture_mode(bad) -> ValueError",
        lambda: expect(_raises(ValueError, lambda: d.exchange_capture_mode(7)), "ValueError"),
    )

    # -- capture_info outside capture -----------------------------------------
    check(
        "capture_info non-capturing stream -> (0, 0)",
        lambda: expect(d.capture_info(s1) == (CAPTURE_STATUS_NONE, 0), str(d.capture_info(s1))),
    )
    check(
        "capture_info legacy stream -> (0, 0)",
        lambda: expect(d.capture_info(LEGACY_STREAM) == (CAPTURE_STATUS_NONE, 0), "legacy"),
    )

    # -- capture with fork/join -----------------------------------------------
    ef, ej = d.create_event(), d.create_event()
    state: dict[str, Any] = {}

    def capture_fork_join() -> str:
        d.stream_synchronize(s1)
        d.begin_capture(s1, CAPTURE_MODE_GLOBAL)
        st, cid = d.capture_info(s1)
        expect(st == CAPTURE_STATUS_ACTIVE and cid != 0, f"s1 capturing ({st}, {cid})")
        expect(d.capture_info(s2) == (CAPTURE_STATUS_NONE, 0), "s2 not yet joined")
        d.memset(a, 0x5A, n, s1)
        d.record_event(ef, s1)
        d.stream_wait_event(s2, ef)  # fork
        expect(d.capture_info(s2) == (CAPTURE_STATUS_ACTIVE, cid), f"s2 joined {cid}")
        expect(d.capture_info(LEGACY_STREAM) == (CAPTURE_STATUS_NONE, 0), "legacy idle")
        expect(d.capture_info(s3) == (CAPTURE_STATUS_NONE, 0), "s3 idle")
        d.memcpy(b, a, n, s2)
        # relaxed-mode malloc inside a global capture (what the allocator does)
        prev = d.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            state["p"] = d.malloc(2 * MiB)
        finally:
            d.exchange_capture_mode(prev)
        d.record_event(ej, s2)
        d.stream_wait_event(s1, ej)  # join
        g = d.end_capture(s1)
        state["g"], state["cid"] = g, cid
        expect(isinstance(g, int) and g != 0, f"graph {g!r}")
        expect(state["p"] is not None, "relaxed malloc during capture")
        expect(d.capture_info(s1) == (CAPTURE_STATUS_NONE, 0), "s1 left capture")
        expect(d.capture_info(s2) == (CAPTURE_STATUS_NONE, 0), "s2 left capture")
        return f"capture id {cid}, graph {g:#x}"

    check(
        "begin/end capture, fork/join via events, capture_info on joined stream",
        capture_fork_join,
    )
    if state.get("p"):
        check("free memory malloc'ed during capture", lambda: d.free(state["p"]))
    g = state.get("g")
    if g:

        def node_count() -> int:
            cnt = d.graph_node_count(g)
            expect(cnt == 2, f"{cnt} nodes")
            return cnt

        check("graph_node_count == 2 (memset, memcpy)", node_count)
        ge = check("instantiate", lambda: d.instantiate(g))

        def launch_read() -> None:
            d.memset(a, 0, n, s1)
            d.memset(b, 0, n, s1)
            d.launch(ge, s1)
            expect(d.read(b, n, s1) == b"\x5a" * n, "graph wrote b")
            expect(d.read(a, n, s1) == b"\x5a" * n, "graph wrote a")
            d.memset(b, 0, n, LEGACY_STREAM)
            d.stream_synchronize(LEGACY_STREAM)
            d.launch(ge, s3)
            expect(d.read(b, n, s3) == b"\x5a" * n, "replay on s3")
            d.memset(b, 1, n, LEGACY_STREAM)
            d.launch(ge, LEGACY_STREAM)
            expect(d.read(b, n, LEGACY_STREAM) == b"\x5a" * n, "replay on legacy")

        if ge:
            check("launch on s1, s3 and legacy, read back", launch_read)
            check("destroy_graph_exec", lambda: d.destroy_graph_exec(ge))
        check("destroy_graph", lambda: d.destroy_graph(g))

    def second_capture() -> str:
        d.begin_capture(s2, CAPTURE_MODE_THREAD_LOCAL)
        _, cid = d.capture_info(s2)
        d.memset(a, 1, n, s2)
        g2 = d.end_capture(s2)
        cnt = d.graph_node_count(g2)
        d.destroy_graph(g2)
        expect(cid not in (0, state.get("cid")), f"id {cid} unique")
        expect(cnt == 1, f"nodes {cnt}")
        return f"id {cid}"

    check("thread_local capture, ids unique", second_capture)

    def empty_capture() -> str:
        d.begin_capture(s2, CAPTURE_MODE_GLOBAL)
        g3 = d.end_capture(s2)
        cnt = d.graph_node_count(g3)
        ge3 = d.instantiate(g3)
        d.launch(ge3, s2)
        d.stream_synchronize(s2)
        d.destroy_graph_exec(ge3)
        d.destroy_graph(g3)
        return f"{cnt} nodes"

    check("empty capture instantiates and launches", empty_capture)

    # -- invalidated capture --------------------------------------------------
    def invalidated() -> str:
        d.begin_capture(s1, CAPTURE_MODE_GLOBAL)
        d.memset(a, 7, n, s1)
        why = raises_cuda(lambda: d.malloc(MiB))
        st, cid = d.capture_info(s1)
        expect(st == CAPTURE_STATUS_INVALIDATED, f"status after bad malloc {st}")
        end = raises_cuda(lambda: d.end_capture(s1))
        expect(d.capture_info(s1) == (CAPTURE_STATUS_NONE, 0), "left capture")
        d.memset(a, 9, n, s1)
        expect(d.read(a, 16, s1) == b"\x09" * 16, "stream usable")
        p = d.malloc(MiB)
        expect(p is not None, "malloc after")
        assert p is not None
        d.free(p)
        return f"malloc: {why} | status {st} id {cid} | end_capture: {end}"

    check(
        "global-mode malloc during capture invalidates; end raises; stream usable",
        invalidated,
    )

    def invalidated_by_query() -> str:
        d.begin_capture(s1, CAPTURE_MODE_GLOBAL)
        d.memset(a, 7, n, s1)
        how = "no error"
        try:
            d.query_event(e2)
        except CUDAError as exc:
            how = exc.name
        st, _ = d.capture_info(s1)
        try:
            g4 = d.end_capture(s1)
            d.destroy_graph(g4)
            end = "succeeded"
        except CUDAError as exc:
            end = exc.name
        return f"query_event: {how}; status {st}; end_capture: {end}"

    check("INFO event query during global capture", invalidated_by_query)

    def legacy_capture() -> str:
        why = raises_cuda(lambda: d.begin_capture(LEGACY_STREAM, CAPTURE_MODE_GLOBAL))
        expect(d.capture_info(LEGACY_STREAM) == (CAPTURE_STATUS_NONE, 0), "legacy idle")
        d.memset(a, 3, 16, LEGACY_STREAM)
        expect(d.read(a, 16, LEGACY_STREAM) == b"\x03" * 16, "legacy usable")
        return why

    check("begin_capture on legacy stream -> CUDAError", legacy_capture)
    check(
        "begin_capture(bad mode) -> ValueError",
        lambda: expect(_raises(ValueError, lambda: d.begin_capture(s1, 9)), "ValueError"),
    )

    # -- other devices --------------------------------------------------------
    if n_dev >= 2:

        def other_device() -> str:
            be.set_current_device(0)
            d1 = be.get_device(1)
            s = d1.create_stream()
            p = d1.malloc(MiB)
            assert p is not None
            be.set_current_device(0)
            d1.memset(p, 0x44, MiB, s)
            be.set_current_device(0)
            ok = d1.read(p, MiB, s) == b"\x44" * MiB
            be.set_current_device(0)
            d1.free(p)
            d1.destroy_stream(s)
            expect(ok, "device 1 round trip")
            return d1.name

        check("device 1 works while device 0 is current", other_device)
    else:
        report("SKIP", "device 1 works while device 0 is current", "one device")

    # -- costs ----------------------------------------------------------------
    def timing() -> str:
        k = 20000
        t = time.perf_counter()
        for _ in range(k):
            d.capture_info(s1)
        ci = (time.perf_counter() - t) / k * 1e6
        t = time.perf_counter()
        for _ in range(k):
            d.capture_info(LEGACY_STREAM)
        cl = (time.perf_counter() - t) / k * 1e6
        t = time.perf_counter()
        for _ in range(1000):
            p = d.malloc(2 * MiB)
            assert p is not None
            d.free(p)
        mf = (time.perf_counter() - t) / 1000 * 1e6
        return f"capture_info {ci:.2f} us, on legacy {cl:.2f} us, malloc+free 2 MiB {mf:.1f} us"

    check("INFO costs", timing)

    # -- cleanup --------------------------------------------------------------
    def cleanup() -> None:
        d.device_synchronize()
        for e in (e1, e2, ef, ej):
            d.destroy_event(e)
        for s in (s1, s2, s3):
            d.destroy_stream(s)
        d.destroy_stream(LEGACY_STREAM)  # a no-op
        for p in (a, b, big):
            if p:
                d.free(p)
        d.device_synchronize()

    check("destroy_event / destroy_stream / free", cleanup)
    print(f"\n{RESULTS['PASS']} passed, {RESULTS['FAIL']} failed, {RESULTS['SKIP']} skipped")
    return 1 if RESULTS["FAIL"] else 0


def _raises(kind: type[BaseException], fn: Callable[[], Any]) -> bool:
    """True when ``fn`` raises ``kind``."""
    try:
        fn()
    except kind:
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
