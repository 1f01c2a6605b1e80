"""A misuse fuzzer: random sequences of public calls, many of them wrong, must never crash.

Each sequence starts a fresh simulated backend (two devices, 48 MiB each) and makes
``CALLS`` random calls drawn from a menu that mixes valid work (allocations, frees, xp
arrays, streams, events, captures, replays) with misuse:

* wrong types: sizes, streams, events, devices, pools, modes and graphs of the wrong type;
* wrong values: negative and huge sizes, devices out of range, invalid pool ids, unknown
  capture modes and backends, pointers graphpool never handed out, double frees;
* wrong order: replay or ``pool()`` before capture, ``capture_end`` without a begin,
  capture on the legacy stream, nested ``gp.graph``, capturing twice, synchronizing,
  querying events and reading arrays during a capture, ``empty_cache`` during a capture;
* wrong thread: ending another thread's capture, capturing in two threads at once;
* wrong backend: ``set_backend`` with objects of the old backend still in use, and
  ``set_backend("cuda")`` on a machine without a GPU;
* ``graphpool.dlpack`` and ``graphpool.traces`` given objects of the wrong type and bad
  values (shapes, offsets, dtypes, versions, devices, counts, names, paths, snapshots), and
  NumPy refusing a device buffer (``np.from_dlpack``);
* the entries issue 25 bounded or made honest: ``record_memory_history(max_entries=...)``,
  ``make_graphed_callable(s)``'s warm-up counts, ``CUDAGraph(keep_graph=...)`` with
  ``instantiate``/``raw_cuda_graph``, ``reset()`` inside a graph block, ``graphpool.cupy.malloc``
  before ``install()``, the limit setters and ``set_allocator_config``, and a size object whose
  ``__index__`` answers differently each time;
* the other public entries that take arguments (``guard_signal_handler``, the out-of-memory
  observers, ``set_capture_detection``, ``set_replay_checks``, ``dump_snapshot``,
  ``torch_snapshot``, the limit getters and statistics readers) with wrong values.

Every call must return or raise a ``TypeError``, ``ValueError``, ``BufferError`` or
``GraphpoolError`` (which covers ``OutOfMemoryError``) with a message, or a kind the call
documents (NumPy's own refusal, an OSError for a file that is not there, the RuntimeError
of ``graphpool.cupy.malloc`` before ``install()``); any other exception (``AttributeError``,
``IndexError``, ``AssertionError``, ``KeyError``, ``ZeroDivisionError``, ``OverflowError``,
``SystemError`` always, a bare ``RuntimeError`` ...) is a finding. After each call
``check_invariants()`` must hold; after each sequence, once everything is dropped and
``empty_cache()`` ran, every allocator of every backend the sequence made must reserve 0 and
no DLPack export may be left.

``test_cli_misuse_is_one_line`` runs ``python -m graphpool`` with bad command lines (options,
values, commands, output paths; the global option before or after the command): each must
exit non-zero with one line on stderr and no traceback.

Sequences run in child interpreters, in batches (a worker runs many sequences): a crash
(a segfault, an abort) kills only its batch, which is then rerun one sequence per
process to name the crashing seed. The seeds are fixed (CI reproduces them); set
GRAPHPOOL_FUZZ_SEED to explore others, GRAPHPOOL_FUZZ_SEQUENCES to run more, and
GRAPHPOOL_FUZZ_REPORT to a path to get the counts as JSON. Bounded: workers start no new
sequence after TIME_LIMIT_S (the count run is reported). Reproduce one sequence with
``python tests/test_misuse_fuzz.py worker SEED 1 CALLS``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

SEQUENCES = int(os.environ.get("GRAPHPOOL_FUZZ_SEQUENCES", "400"))
CALLS = 40
BATCHES = 4
WORKERS = 2
BASE_SEED = int(os.environ.get("GRAPHPOOL_FUZZ_SEED", "1000"))
TIME_LIMIT_S = 45.0
"""Workers start no new sequence after this many seconds: the test stays under a minute on a
slow or busy machine, running fewer sequences (it reports how many)."""
MIN_SEQUENCES = 40
MiB = 1 << 20


# =============================================================================== worker
class Sequence:
    """One random sequence: the objects it made and what it saw."""

    def __init__(self, seed: int, calls: int) -> None:
        import graphpool as gp
        from graphpool import runtime
        from graphpool.sim import SimBackend, xp

        self.gp = gp
        self.runtime = runtime
        self.xp = xp
        self.SimBackend = SimBackend
        self.rng = random.Random(seed)
        self.seed = seed
        self.calls = calls
        self.done = 0
        self.raised = 0
        self.findings: list[dict[str, Any]] = []
        self.kinds: dict[str, int] = {}  # "call: ErrorType" -> how many times it was raised
        self.runtimes: list[Any] = []
        self._new_backend()
        self.bufs: list[Any] = []
        self.freed: list[Any] = []
        self.streams: list[Any] = []
        self.events: list[Any] = []
        self.graphs: list[Any] = []
        self.arrays: list[Any] = []
        self.pools: list[Any] = []
        self.open_capture: tuple[Any, Any] | None = None  # (graph, stream context) begun by hand
        self.allowed = (TypeError, ValueError, BufferError, gp.GraphpoolError)

    # ----------------------------------------------------------------- plumbing
    def _new_backend(self) -> None:
        self.runtime.set_backend("sim", backend=self.SimBackend(device_count=2, memory_bytes=48 * MiB))
        self.runtimes.append(self.runtime.get())

    def pick(self, items: list[Any]) -> Any:
        return items[self.rng.randrange(len(items))] if items else None

    def size(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            return self.rng.randrange(0, 4096)
        if r < 0.9:
            return self.rng.randrange(4096, 3 * MiB)
        return self.rng.randrange(3 * MiB, 40 * MiB)

    def stream(self) -> Any:
        s = self.pick(self.streams)
        return s if s is not None and self.rng.random() < 0.8 else self.gp.current_stream()

    def call(self, name: str, fn: Callable[[], Any], also: tuple[type[Exception], ...] = ()) -> None:
        """Run one call; classify what it raised. ``also``: the error kinds this call documents
        beyond the common ones (a consumer's own refusal, an OSError for a file that is not)."""
        self.done += 1
        try:
            fn()
        except self.allowed + also as exc:
            if isinstance(exc, SystemError):  # never a documented kind
                raise
            self.raised += 1
            key = f"{name}: {type(exc).__name__}"
            self.kinds[key] = self.kinds.get(key, 0) + 1
            if os.environ.get("GRAPHPOOL_FUZZ_VERBOSE"):
                print(f"{key}: {str(exc)[:240]}", file=sys.stderr)
            if not str(exc):
                self.finding(name, exc, "an error without a message")
        except Exception as exc:
            self.finding(name, exc, "unexpected exception type")
        try:
            for d in range(self.gp.device_count()):
                self.runtime.get().allocator(d).check_invariants()
        except Exception as exc:
            self.finding(name, exc, "invariants broken after the call")

    def finding(self, name: str, exc: BaseException, why: str) -> None:
        self.findings.append(
            {
                "seed": self.seed,
                "step": self.done,
                "call": name,
                "why": why,
                "type": type(exc).__name__,
                "message": str(exc)[:300],
                "where": "".join(traceback.format_exception(exc)[-3:])[-600:],
            }
        )

    # ----------------------------------------------------------------- the menu
    def run(self) -> None:
        menu = [(name, getattr(self, name)) for name in dir(self) if name.startswith("a_")]
        for _ in range(self.calls):
            name, action = self.pick(menu)
            try:
                action(name)
            except Exception as exc:
                self.finding(name, exc, "raised outside a checked call (a bug in the fuzzer?)")
        self.cleanup()

    # valid work, to give misuse something to hit
    def a_alloc(self, name: str) -> None:
        n, s = self.size(), self.stream()
        self.call(name, lambda: self.bufs.append(self.gp.alloc(n, stream=s)))

    def a_alloc_current(self, name: str) -> None:
        self.call(name, lambda: self.bufs.append(self.gp.alloc(self.rng.randrange(0, 9000))))

    def a_free(self, name: str) -> None:
        if self.bufs:
            b = self.bufs.pop(self.rng.randrange(len(self.bufs)))
            self.freed.append(b)
            self.call(name, b.free)

    def a_drop(self, name: str) -> None:
        if self.bufs:
            self.bufs.pop(self.rng.randrange(len(self.bufs)))
            self.call(name, gc.collect)

    def a_xp(self, name: str) -> None:
        xp = self.xp

        def work() -> None:
            a = xp.arange(self.rng.randrange(0, 2000))
            self.arrays.append(a * 2 + 1)
            if len(self.arrays) > 6:
                self.arrays.pop(0)

        self.call(name, work)

    def a_xp_read(self, name: str) -> None:
        a = self.pick(self.arrays)
        if a is not None:
            self.call(name, lambda: a.sum().item())

    def a_xp_mix(self, name: str) -> None:
        a, b = self.pick(self.arrays), self.pick(self.arrays)
        if a is not None and b is not None:
            self.call(name, lambda: self.arrays.append(a + b))

    def a_stream(self, name: str) -> None:
        d = self.rng.randrange(2)
        self.call(name, lambda: self.streams.append(self.gp.Stream(d)))

    def a_event(self, name: str) -> None:
        s = self.stream()

        def work() -> None:
            e = self.gp.Event(s.device)
            e.record(s)
            self.events.append(e)

        self.call(name, work)

    def a_wait(self, name: str) -> None:
        s, o = self.stream(), self.stream()
        self.call(name, lambda: s.wait_stream(o))

    def a_wait_event(self, name: str) -> None:
        s, e = self.stream(), self.pick(self.events)
        if e is not None:
            self.call(name, lambda: s.wait_event(e))

    def a_query(self, name: str) -> None:
        e = self.pick(self.events)
        if e is not None:
            self.call(name, e.query)

    def a_record_stream(self, name: str) -> None:
        b, s = self.pick(self.bufs), self.stream()
        if b is not None:
            self.call(name, lambda: b.record_stream(s))

    def a_sync(self, name: str) -> None:
        what = self.rng.randrange(3)
        if what == 0:
            self.call(name, self.gp.synchronize)
        elif what == 1:
            self.call(name, self.stream().synchronize)
        else:
            self.call(name, self.gp.empty_cache)

    def a_capture(self, name: str) -> None:
        gp, xp = self.gp, self.xp
        g = gp.CUDAGraph()
        pool = self.pick(self.pools) if self.rng.random() < 0.4 else None
        body = self.rng.randrange(4)

        def work() -> None:
            with gp.graph(g, pool=pool):
                a = xp.ones(self.rng.randrange(1, 3000))
                out = a + 1
                if body == 1:
                    gp.alloc(self.size())
                elif body == 2:
                    raise ValueError("the body failed (on purpose)")
                elif body == 3:
                    self.bufs and self.bufs.pop().free()
            self.graphs.append((g, out))

        self.call(name, work)

    def a_replay(self, name: str) -> None:
        item = self.pick(self.graphs)
        if item is not None:
            self.call(name, item[0].replay)

    def a_reset(self, name: str) -> None:
        item = self.pick(self.graphs)
        if item is not None:
            self.call(name, item[0].reset)

    def a_pool_handle(self, name: str) -> None:
        self.call(name, lambda: self.pools.append(self.gp.graph_pool_handle()))

    def a_stats(self, name: str) -> None:
        what = self.rng.randrange(4)
        gp = self.gp
        fns: list[Callable[[], Any]] = [
            gp.memory_stats,
            gp.memory_summary,
            gp.memory_snapshot,
            gp.memory_reserved,
        ]
        self.call(name, fns[what])

    # wrong types
    def a_bad_size_type(self, name: str) -> None:
        bad = self.pick(["8", 1.5, None, [8], True, b"x", object(), 2**70 * 1.0, {}])
        self.call(name, lambda: self.gp.alloc(bad))

    def a_bad_stream_type(self, name: str) -> None:
        bad = self.pick([1, "s", 0x1000, object(), self.gp.Event, 1.0])
        self.call(name, lambda: self.gp.alloc(64, stream=bad))

    def a_bad_device(self, name: str) -> None:
        gp = self.gp
        bad = self.pick(["0", -1, 2, 7, 1.0, None, True, [0], 2**65])
        fn = self.pick(
            [
                gp.memory_stats,
                gp.empty_cache,
                gp.synchronize,
                gp.Stream,
                gp.Event,
                gp.set_device,
                gp.current_stream,
                gp.default_stream,
                gp.memory_snapshot,
                gp.reset_peak_memory_stats,
                lambda d: gp.device(d).__enter__(),
            ]
        )
        self.call(name, lambda: fn(bad))
        self.call("restore_device", lambda: gp.set_device(0))

    def a_bad_pool(self, name: str) -> None:
        gp = self.gp
        bad = self.pick(["x", (1, 2, 3), (5, 5), (-1, 0), (0, 99999), 3, (1.5, 0), None])
        what = self.rng.randrange(3)
        if what == 0:
            self.call(name, lambda: gp.memory_stats(pool=bad))
        elif what == 1:
            self.call(name, lambda: gp.PoolId(*bad) if isinstance(bad, tuple) else gp.PoolId(bad))

        else:

            def work() -> None:
                with gp.graph(gp.CUDAGraph(), pool=bad):
                    self.xp.ones(4)

            self.call(name, work)

    def a_bad_mode(self, name: str) -> None:
        gp = self.gp
        bad = self.pick(["bogus", 5, None, "GLOBAL", ""])
        what = self.rng.randrange(3)
        if what == 0:

            def work() -> None:
                with gp.graph(gp.CUDAGraph(), capture_error_mode=bad):
                    self.xp.ones(4)

            self.call(name, work)
        elif what == 1:
            self.call(name, lambda: gp.set_replay_checks(bad))
        else:
            self.call(name, lambda: gp.set_backend(bad))

    def a_bad_args(self, name: str) -> None:
        gp = self.gp
        b = self.pick(self.bufs)
        s = self.stream()
        e = self.pick(self.events)
        calls: list[Callable[[], Any]] = [
            lambda: s.wait_stream(123),
            lambda: s.wait_event("e"),
            lambda: s.record_event(5),
            lambda: gp.Event().record(5),
            lambda: gp.stream("x").__enter__(),
            lambda: gp.graph("g"),
            lambda: gp.graph(gp.CUDAGraph(), stream=5),
            lambda: b.record_stream("s") if b is not None else None,
            lambda: e.record(s) if e is not None else None,
            lambda: gp.DeviceBuffer(0x7F0000000000, 64, s, None),
            lambda: gp.DeviceBuffer(),
            lambda: gp.make_graphed_callable(None, ()),
            lambda: self.xp.ones(-3),
            lambda: self.xp.ones(4, dtype="complex64"),
            lambda: self.xp.ones(4) + "a",
            lambda: self.xp.ones(4) + self.xp.ones(5),
        ]
        self.call(name, self.pick(calls))

    def a_export(self, name: str) -> None:
        b = self.pick(self.bufs + self.freed)
        if b is None:
            return
        gp = self.gp
        from graphpool import dlpack

        calls: list[Callable[[], Any]] = [
            lambda: b.__cuda_array_interface__,
            lambda: b.__dlpack__(),
            lambda: b.__dlpack__(stream="x"),
            lambda: b.__dlpack__(stream=-7),
            lambda: b.__dlpack__(dl_device=(1, 0)),
            lambda: b.__dlpack__(dl_device="cuda"),
            lambda: b.__dlpack__(copy=True),
            lambda: b.__dlpack__(max_version="a"),
            lambda: b.__dlpack__(max_version=(0, 5)),
            lambda: dlpack.as_tensor(b, "float32", (b.nbytes,)).__dlpack__(),
            lambda: dlpack.as_tensor(b, "nonsense", (1,)).__dlpack__(),
            lambda: dlpack.as_tensor(b, "float32", (-1,)).__dlpack__(),
            lambda: dlpack.as_tensor(b, "float32", "x").__dlpack__(),
            lambda: gp.make_graphed_callable(lambda x: x + 1, (self.xp.ones(4),)),
            lambda: gp.make_graphed_callable(lambda x: x, (1,)),
            lambda: gp.make_graphed_callable(5, (self.xp.ones(4),)),
        ]
        self.call(name, self.pick(calls))

    def a_dlpack(self, name: str) -> None:
        """graphpool.dlpack's entries with wrong types and values, and a consumer that refuses."""
        import numpy as np

        from graphpool import dlpack

        b = self.pick(self.bufs + self.freed)
        bad = self.pick(
            [None, "x", [], -1, 2**64, 2**63, (1, 2, 3), 1.5, True, (-1,), {}, object(), "complex256", b"u1"]
        )
        calls: list[Callable[[], Any]] = [
            lambda: dlpack.as_tensor(bad, "uint8"),
            lambda: dlpack.export(bad),
            lambda: dlpack.TensorView(bad, "uint8", (1,)),
        ]
        if b is not None:
            calls += [
                lambda: dlpack.as_tensor(b, bad),
                lambda: dlpack.as_tensor(b, "uint8", bad),
                lambda: dlpack.as_tensor(b, "uint8", None, bad),
                lambda: dlpack.as_tensor(b, "float32", (bad,)),
                lambda: dlpack.as_tensor(b, []),
                lambda: dlpack.export(b, dtype="float32", shape=(-1,)),
                lambda: b.__dlpack__(max_version=bad),
                lambda: b.__dlpack__(dl_device=bad),
                lambda: b.__dlpack__(copy=bad),
                lambda: b.__dlpack__(stream=bad),
            ]
        self.call(name, self.pick(calls))
        if b is None:
            return
        # NumPy refuses device memory: its own error, nothing left behind (checked at cleanup)
        source: Any = b
        if not b.freed and b.nbytes >= 4 and self.rng.random() < 0.5:
            source = dlpack.TensorView.__new__(dlpack.TensorView)  # a view made without checks:
            source.buffer, source.dtype, source.shape, source.byte_offset = (  # export checks it
                b,
                np.dtype("float32"),
                self.pick([(b.nbytes // 4,), (-1,), (2**40,)]),
                self.pick([0, -4, 2**64]),
            )
        self.call("np.from_dlpack", lambda: np.from_dlpack(source), also=(RuntimeError,))

    def a_traces(self, name: str) -> None:
        """graphpool.traces' entries with wrong types and values."""
        from graphpool.tools import traces

        t = traces.synthetic(self.rng.randrange(50), 30)
        bad = self.pick([None, 5, "small", "../x", [], {"name": "x"}, b"x", t.events, 1.5, True, -3, (7,), t])
        snap = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "stream": 0}]]}
        calls: list[tuple[Callable[[], Any], tuple[type[Exception], ...]]] = [
            (lambda: traces.validate(bad), ()),
            (lambda: traces.summary(bad), ()),
            (lambda: traces.peak_live_bytes(bad), ()),
            (lambda: traces.truncated(bad, 3), ()),
            (lambda: traces.truncated(t, bad), ()),
            (lambda: traces.save(bad, os.devnull), (OSError,)),
            (lambda: traces.save(t, 5 if isinstance(bad, str) else bad), ()),  # writes no file
            (lambda: traces.read(bad), (OSError,)),  # a str names a file that is not there
            (lambda: traces.load(bad), ()),
            (lambda: traces.synthetic(bad, 30), ()),
            (lambda: traces.synthetic(0, bad), ()),
            (lambda: traces.synthetic(0, 30, streams=bad), ()),
            (lambda: traces.synthetic(0, 30, name=bad), ()),
            (lambda: traces.from_torch_snapshot(bad), ()),
            (lambda: traces.from_torch_snapshot(snap, bad), ()),
            (lambda: traces.from_torch_snapshot({"device_traces": [[bad]]}), ()),
            (lambda: traces.from_torch_snapshot({"device_traces": [[{"action": "alloc", "addr": bad}]]}), ()),
            (lambda: traces.from_torch_snapshot(snap, name=bad), ()),
            (lambda: traces.Trace(bad, "", []), ()),
            (lambda: traces.Trace("t", "", bad), ()),
            (lambda: traces.validate(traces.Trace("t", "", [bad])), ()),
        ]
        fn, also = self.pick(calls)
        self.call(name, fn, also=also)

    def a_new_entries(self, name: str) -> None:
        """The entries issue 25 bounded or made honest, with wrong and absurd arguments."""
        gp, xp = self.gp, self.xp
        bad = self.pick([2**63, 10**18, 10**30, 0, -1, "3", 1.5, True, None, 1001, float("nan")])

        def history() -> None:
            try:
                gp.record_memory_history(True, max_entries=bad, stacks=False)
            finally:
                gp.record_memory_history(False)

        def reset_in_block() -> None:
            g = gp.CUDAGraph()
            with gp.graph(g):
                xp.ones(4)
                g.reset()

        def keep_graph() -> None:
            g = gp.CUDAGraph(keep_graph=True)
            with gp.graph(g):
                out = xp.ones(16) + 1
            self.pick([g.raw_cuda_graph, g.instantiate, g.replay, g.capture_begin])()
            self.graphs.append((g, out))

        class Flaky:
            calls = 0

            def __index__(self) -> int:
                Flaky.calls += 1
                return 4096 if Flaky.calls == 1 else 64

        def flaky_alloc() -> None:
            buf = gp.alloc(Flaky())
            self.bufs.append(buf)
            block = buf._block
            if block is None or block.size < buf.nbytes:
                raise AssertionError(f"a buffer of {buf.nbytes} bytes on a block of {block}")

        graph = self.pick(self.graphs)
        calls: list[tuple[Callable[[], Any], tuple[type[Exception], ...]]] = [
            (history, ()),
            (lambda: gp.make_graphed_callable(lambda x: x + 1, (xp.ones(4),), warmup=bad), ()),
            (lambda: gp.make_graphed_callables(lambda x: x + 1, (xp.ones(4),), num_warmup_iters=bad), ()),
            (lambda: gp.CUDAGraph(keep_graph=bad), ()),
            (keep_graph, ()),
            (lambda: graph[0].instantiate() if graph else gp.CUDAGraph().instantiate(), ()),
            (lambda: graph[0].raw_cuda_graph() if graph else gp.CUDAGraph(True).raw_cuda_graph(), ()),
            (reset_in_block, ()),
            (lambda: __import__("graphpool.cupy", fromlist=["malloc"]).malloc(64), (RuntimeError,)),
            (
                lambda: gp.set_allocator_config(
                    self.pick(
                        [
                            "memory_limit:-1",
                            "per_process_memory_fraction:2",
                            "nonsense:1",
                            "max_split_size_mb:10",
                            bad,
                        ]
                    )
                ),
                (),
            ),
            (lambda: gp.set_memory_limit(bad), ()),
            (lambda: gp.set_per_process_memory_fraction(bad if bad != 0 else 2.5), ()),
            (flaky_alloc, ()),
        ]
        fn, also = self.pick(calls)
        self.call(name, fn, also=also)

    def a_other_entries(self, name: str) -> None:
        """The remaining public entries that take arguments: signal guards, out-of-memory
        observers, capture detection, replay checks, snapshots, limits and statistics readers."""
        gp = self.gp
        bad = self.pick(["0", -1, 2, 7, 1.5, None, True, [0], 2**65, object(), "bogus"])
        observer = self.pick([bad, lambda device, requested, stats: None])

        def attach_detach() -> None:
            gp.attach_out_of_memory_observer(observer)
            gp.detach_out_of_memory_observer(observer)

        def detection() -> None:
            try:
                gp.set_capture_detection(bad)
            finally:
                gp.set_capture_detection(True)

        calls: list[tuple[Callable[[], Any], tuple[type[Exception], ...]]] = [
            (lambda: gp.guard_signal_handler(bad), ()),
            (attach_detach, ()),
            (lambda: gp.detach_out_of_memory_observer(bad), ()),
            (detection, ()),
            (lambda: gp.set_replay_checks(bad), ()),
            (lambda: gp.dump_snapshot(5 if isinstance(bad, str) else bad), ()),  # writes no file
            (lambda: gp.torch_snapshot(bad), ()),
            (lambda: self.pick([gp.get_memory_limit, gp.get_per_process_memory_fraction])(bad), ()),
            (lambda: self.pick([gp.max_memory_allocated, gp.max_memory_reserved])(bad), ()),
            (lambda: self.pick([gp.memory_allocated, gp.memory_reserved, gp.memory_summary])(bad), ()),
            (lambda: self.pick([gp.reset_accumulated_memory_stats, gp.check_invariants])(bad), ()),
        ]
        fn, also = self.pick(calls)
        self.call(name, fn, also=also)

    def a_copy_pickle(self, name: str) -> None:
        import copy
        import pickle

        target = self.pick(
            [self.pick(self.bufs), self.pick(self.arrays), self.pick(self.events), self.pick(self.streams)]
        )
        item = self.pick(self.graphs)
        if self.rng.random() < 0.3 and item is not None:
            target = item[0]
        if target is None:
            return
        how = self.pick([copy.copy, copy.deepcopy, pickle.dumps])
        self.call(name, lambda: self._keep(how(target)))

    def _keep(self, obj: Any) -> None:
        if isinstance(obj, self.gp.DeviceBuffer):
            self.bufs.append(obj)

    # wrong values
    def a_bad_size(self, name: str) -> None:
        bad = self.pick([-1, -(2**40), 2**62, 2**70, 49 * MiB, 200 * MiB])
        self.call(name, lambda: self.gp.alloc(bad))

    def a_double_free(self, name: str) -> None:
        b = self.pick(self.freed)
        if b is not None:
            self.call(name, b.free)

    def a_bad_pointer(self, name: str) -> None:
        a = self.runtime.get().allocator(0)
        b = self.pick([x for x in self.bufs if x.nbytes > 8 and x.device == 0])
        bad = self.pick([0, 1, -5, 0x1234, 2**64, "p", None] + ([b.ptr + 8] if b is not None else []))
        self.call(name, lambda: a.free(bad))

    # wrong order
    def a_wrong_order(self, name: str) -> None:
        gp, xp = self.gp, self.xp
        what = self.rng.randrange(10)
        if what == 0:
            self.call(name, gp.CUDAGraph().replay)
        elif what == 1:
            self.call(name, gp.CUDAGraph().capture_end)
        elif what == 2:
            self.call(name, gp.CUDAGraph().pool)
        elif what == 3:
            self.call(name, gp.CUDAGraph().capture_begin)  # on the legacy stream

        elif what == 4:

            def nested() -> None:
                with gp.graph(gp.CUDAGraph()):
                    xp.ones(4)
                    with gp.graph(gp.CUDAGraph()):
                        xp.ones(4)

            self.call(name, nested)
        else:
            during = [
                gp.synchronize,
                gp.empty_cache,
                lambda: self.pick(self.events).query() if self.events else None,
                lambda: self.pick(self.arrays).get() if self.arrays else None,
                lambda: gp.set_backend("sim"),
            ][what - 5]

            def in_capture() -> None:
                with gp.graph(gp.CUDAGraph()):
                    xp.ones(8)
                    during()

            self.call(name, in_capture)
            if self.runtime.get() is not self.runtimes[-1]:
                self.runtimes.append(self.runtime.get())

    def a_capture_by_hand(self, name: str) -> None:
        gp = self.gp
        if self.open_capture is None:
            s = self.pick([x for x in self.streams if x.device == gp.current_device()])
            if s is None:
                return
            g = gp.CUDAGraph()
            pool = self.pick(self.pools)

            def begin() -> None:
                ctx = gp.stream(s)
                ctx.__enter__()
                try:
                    g.capture_begin(pool=pool)
                except BaseException:
                    ctx.__exit__(None, None, None)
                    raise
                self.open_capture = (g, ctx)

            self.call(name, begin)
        else:
            g, _ = self.open_capture
            what = self.rng.randrange(4)
            if what == 0:
                self.call(name, g.capture_begin)  # twice
            elif what == 1:
                self.call(name, lambda: self.bufs.append(gp.alloc(self.size())))
            elif what == 2:
                self.call(name, lambda: self.arrays.append(self.xp.ones(16) * 3))
            else:
                self._close_capture(end=True)

    def _close_capture(self, end: bool) -> None:
        assert self.open_capture is not None
        g, ctx = self.open_capture
        self.open_capture = None
        if end:
            self.call("capture_end", g.capture_end)
            if g._exec is not None:
                self.graphs.append((g, None))
        if g._capturing:
            self.call("reset", g.reset)
        self.call("leave_stream", lambda: ctx.__exit__(None, None, None))

    # wrong thread
    def a_wrong_thread(self, name: str) -> None:
        gp, xp = self.gp, self.xp
        what = self.rng.randrange(3)
        box: dict[str, Any] = {}

        def in_thread(fn: Callable[[], Any]) -> None:
            def target() -> None:
                try:
                    fn()
                except BaseException as exc:
                    box["exc"] = exc

            t = threading.Thread(target=target)
            t.start()
            t.join()
            if "exc" in box:
                raise box["exc"]

        if what == 0 and self.open_capture is not None:
            g = self.open_capture[0]
            self.call(name, lambda: in_thread(g.capture_end))
        elif what == 1:

            def two_captures() -> None:
                with gp.graph(gp.CUDAGraph()):
                    xp.ones(8)
                    in_thread(lambda: gp.graph(gp.CUDAGraph()).__enter__())

            self.call(name, two_captures)
        else:
            b = self.pick(self.bufs)
            if b is not None:
                self.bufs.remove(b)
                self.freed.append(b)
                self.call(name, lambda: in_thread(b.free))

    # wrong backend
    def a_wrong_backend(self, name: str) -> None:
        gp = self.gp
        if self.open_capture is not None or self.rng.random() < 0.5:
            self.call(name, lambda: gp.set_backend("cuda"))  # no GPU here: refused, nothing changes
            return
        self._new_backend()  # every object made so far belongs to the replaced backend

    # ----------------------------------------------------------------- the end
    def cleanup(self) -> None:
        """Drop everything; every allocator of every backend must then reserve nothing."""
        gp = self.gp
        if self.open_capture is not None:
            self._close_capture(end=self.rng.random() < 0.5)
        self.bufs.clear()
        self.freed.clear()
        self.arrays.clear()
        self.graphs.clear()
        self.events.clear()
        self.streams.clear()
        gc.collect()
        try:
            from graphpool import dlpack

            if gp.is_current_stream_capturing():
                raise AssertionError("a capture is still underway after the sequence")
            if dlpack.live_exports():
                raise AssertionError(f"{dlpack.live_exports()} DLPack exports still live after the sequence")
            for rt in self.runtimes:
                for index in range(rt.count):
                    rt.device(index).device_synchronize()
                    a = rt.allocators[index]
                    if a is None:
                        continue
                    a.empty_cache()
                    a.check_invariants()
                    reserved = a.memory_stats()["reserved_bytes.all.current"]
                    if reserved:
                        raise AssertionError(
                            f"{reserved} bytes still reserved on device {index} of {rt.name}"
                        )
        except Exception as exc:
            self.finding("cleanup", exc, "memory not given back or invariants broken")


def worker(first: int, count: int, calls: int, deadline: float = float("inf")) -> None:
    """Run sequences ``first .. first + count - 1``, starting none after ``deadline`` (a
    ``time.time()``); print one JSON line with the counts."""
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"sequences": 0, "calls": 0, "raised": 0, "findings": [], "kinds": {}}
    for seed in range(first, first + count):
        if time.time() > deadline:
            break
        seq = Sequence(seed, calls)
        seq.run()
        out["sequences"] += 1
        out["calls"] += seq.done
        out["raised"] += seq.raised
        out["findings"].extend(seq.findings)
        for k, v in seq.kinds.items():
            out["kinds"][k] = out["kinds"].get(k, 0) + v
    print("FUZZ " + json.dumps(out), flush=True)


# =============================================================================== the test
def _spawn(first: int, count: int, deadline: float = float("inf")) -> subprocess.Popen[str]:
    import graphpool

    env = dict(os.environ, PYTHONPATH=str(Path(graphpool.__file__).resolve().parents[1]))
    env.pop("GRAPHPOOL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, __file__, "worker", str(first), str(count), str(CALLS), repr(deadline)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen[str]) -> tuple[dict[str, Any] | None, str]:
    stdout, stderr = p.communicate(timeout=300)
    for line in stdout.splitlines():
        if line.startswith("FUZZ ") and p.returncode == 0:
            return json.loads(line[5:]), stderr
    return None, f"exit {p.returncode}: {stderr[-1500:]}"


def test_misuse_fuzz(record_property: Any) -> None:
    import graphpool as gp

    start = time.monotonic()
    deadline = time.time() + TIME_LIMIT_S
    per = -(-SEQUENCES // BATCHES)
    batches = [(BASE_SEED + i * per, per) for i in range(BATCHES)]
    totals: dict[str, Any] = {"sequences": 0, "calls": 0, "raised": 0, "crashes": [], "findings": []}
    pending = list(batches)
    running: list[tuple[tuple[int, int], subprocess.Popen[str]]] = []
    while pending or running:
        while pending and len(running) < WORKERS:
            batch = pending.pop(0)
            running.append((batch, _spawn(*batch, deadline=deadline)))
        batch, p = running.pop(0)
        got, _ = _result(p)
        if got is None:  # the batch crashed: rerun it one sequence per process
            for seed in range(batch[0], batch[0] + batch[1]):
                one, err1 = _result(_spawn(seed, 1))
                if one is None:
                    totals["crashes"].append({"seed": seed, "error": err1})
                else:
                    got1 = one
                    for k in ("sequences", "calls", "raised"):
                        totals[k] += got1[k]
                    totals["findings"].extend(got1["findings"])
            continue
        for k in ("sequences", "calls", "raised"):
            totals[k] += got[k]
        totals["findings"].extend(got["findings"])
    elapsed = time.monotonic() - start
    summary = {
        "build": "compiled" if gp.compiled() else "plain Python",
        "sequences": totals["sequences"],
        "calls": totals["calls"],
        "misuse_errors_raised": totals["raised"],
        "crashes": len(totals["crashes"]),
        "findings": len(totals["findings"]),
        "seconds": round(elapsed, 1),
    }
    print(f"\nmisuse fuzz: {json.dumps(summary)}")
    for k, v in summary.items():
        record_property(k, v)
    report = os.environ.get("GRAPHPOOL_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({**summary, "details": totals}, indent=1))
    assert not totals["crashes"], totals["crashes"][:5]
    assert not totals["findings"], json.dumps(totals["findings"][:10], indent=1)
    assert totals["sequences"] >= min(SEQUENCES, MIN_SEQUENCES), "too few sequences ran in the time limit"


# =============================================================================== the CLI
CLI_CASES = 12
"""Command lines per run of the CLI fuzz test (each a process that exits at its first check)."""


CLI_KINDS = ("option", "value", "command", "path", "extra")


def _cli_argv(rng: random.Random, kind: str) -> list[str]:
    """A command line that must fail, of ``kind``: an unknown option, a bad or missing value, an
    unknown command, an output path that cannot be written, a stray argument; the global
    option before or after the command."""
    command = rng.choice(["bench", "snapshot"] if kind == "path" else ["demo", "bench", "snapshot"])
    if kind == "command":
        return [
            rng.choice(["nosuch", "-", "démo", "Demo"]),
            *rng.choice([[], ["--backend", "sim"], ["--bogus"]]),
        ]
    if kind == "option":
        wrong = [
            rng.choice(["--bogus", "-x", "--json=3" if command == "demo" else "--quick=1", "--backend="])
        ]
    elif kind == "value":
        wrong = rng.choice([["--backend"], ["--backend", rng.choice(["gpu", "", "SIM", "0"])]])
    elif kind == "path":
        bad = rng.choice(["/proc/graphpool-fuzz/x", "/dev/null/x", "/", ""])
        wrong = ["--out", bad] if command == "snapshot" else ["--json", bad]
    else:
        wrong = [rng.choice(["extra", "1", "--", "sim"])]
    backend = ["--backend", "sim"] if rng.random() < 0.7 else []
    return [*backend, command, *wrong] if rng.random() < 0.5 else [command, *wrong, *backend]


def test_cli_misuse_is_one_line() -> None:
    """Bad command lines (options, values, commands, output paths): a non-zero exit and one line
    on stderr, never a traceback; output paths are refused before any work."""
    import graphpool

    rng = random.Random(BASE_SEED)
    env = dict(
        os.environ, PYTHONPATH=str(Path(graphpool.__file__).resolve().parents[1]), GRAPHPOOL_BACKEND="sim"
    )
    argvs = [_cli_argv(rng, CLI_KINDS[i % len(CLI_KINDS)]) for i in range(CLI_CASES)]
    bad: list[dict[str, Any]] = []
    for start in range(0, len(argvs), WORKERS):
        procs = [
            (
                argv,
                subprocess.Popen(
                    [sys.executable, "-m", "graphpool", *argv],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for argv in argvs[start : start + WORKERS]
        ]
        for argv, p in procs:
            out, err = p.communicate(timeout=60)
            lines = err.strip().splitlines()
            if (
                p.returncode == 0
                or "Traceback" in err
                or len(lines) != 1
                or not lines[0].startswith("python -m graphpool")
            ):
                bad.append({"argv": argv, "exit": p.returncode, "stderr": err[-800:], "stdout": out[-200:]})
    assert not bad, json.dumps(bad, indent=1)


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "worker":
        limit = float(sys.argv[5]) if len(sys.argv) == 6 else float("inf")
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), limit)
    else:
        sys.exit("usage: python tests/test_misuse_fuzz.py worker FIRST_SEED COUNT CALLS")
