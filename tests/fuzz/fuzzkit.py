"""Byte-checking fuzz programs for the allocator, on the simulated device.

A program is a seeded random sequence of steps a graphpool user may take. Buffers are
allocated on random streams (the legacy stream and three ``gp.Stream``), filled with a
byte by a kernel, and checked by a kernel on their stream just before they are freed or
dropped; they are used on other streams (``wait_stream``, a check kernel there,
``record_stream``); long kernels keep streams busy; streams and the device are
synchronized and ``empty_cache`` runs. The graph program adds captures (``gp.graph``,
``CUDAGraph.capture_begin`` and, with detection on, captures begun on the device
directly, in every capture mode) whose kernels write temporaries, outputs, buffers made
during the capture on other streams and eager buffers freed during it, and read eager
buffers freed during it; eager code allocating and freeing beside the capture; replays on
random streams; graphs reset, dropped, and destroyed with their launches still queued.

What must hold: every kernel that reads a buffer finds the bytes its owner last wrote
(an eager buffer is never written by a replay or by another owner of its memory; a
graph's temporaries and outputs hold the graph's byte when its kernels read them),
``check_invariants()`` after every step, and, once everything is freed and released,
no memory reserved. Nothing asserts which address a request gets or when a block is
reused: those rules may change, correctness may not.
"""

from __future__ import annotations

import gc
import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODES
from graphpool.errors import GraphpoolError, OutOfMemoryError
from graphpool.sim import SimBackend, SimDevice

MiB = 1 << 20
DEVICE_BYTES = 192 * MiB
"""Small enough that out-of-memory (and its release and retry) happens in some programs."""
SIZES = (512, 4096, 100_000, MiB, MiB + 512, 3 * MiB, 5 * MiB, 12 * MiB, 25 * MiB)
"""Both pools, every segment size, and (25 MiB) oversize blocks under max_split_size_mb:20;
the two largest drawn a third as often (reading bytes is the programs' main cost)."""
SIZE_WEIGHTS = (3, 3, 3, 3, 3, 3, 3, 1, 1)
JITTER = (0, 512, 1536)
EAGER_BYTES = range(1, 201)
"""What eager code writes; graphs write ``GRAPH_BYTES``, so a misplaced write never passes."""
GRAPH_BYTES = range(201, 255)
MAX_GRAPHS = 4


def differing(got: np.ndarray, value: int) -> str:
    """'' when every byte of ``got`` is ``value``, else how many differ and the first one.
    Compares 8 bytes at a time: the programs read about a gigabyte per run."""
    body = got.size - got.size % 8
    same = bool((got[:body].view(np.uint64) == np.uint64(value * 0x0101010101010101)).all())
    if same and bool((got[body:] == value).all()):
        return ""
    bad = np.flatnonzero(got != value)
    return f"{bad.size} bytes differ, the first at +{int(bad[0])} is {int(got[bad[0]])}"


class Config(NamedTuple):
    """An allocator configuration: ``set_allocator_config`` text and capture detection."""

    conf: str
    detect: bool


CONFIGS = {
    "default": Config("", True),
    "expandable": Config("expandable_segments:True", True),
    "expandable-split": Config("expandable_segments:True,max_split_size_mb:20", True),
    "split-roundup": Config(
        "max_split_size_mb:20,max_non_split_rounding_mb:40,roundup_power2_divisions:4", True
    ),
    "roundup-ranges": Config("roundup_power2_divisions:[1:2,4:4,>:8]", True),
    "gc-threshold": Config("garbage_collection_threshold:0.6,per_process_memory_fraction:0.5", True),
    "expandable-gc": Config(
        "expandable_segments:True,garbage_collection_threshold:0.5,per_process_memory_fraction:0.75",
        True,
    ),
    "no-detection": Config("", False),
    "expandable-no-detection": Config("expandable_segments:True,roundup_power2_divisions:4", False),
}


@contextmanager
def configured(config: Config) -> Iterator[SimDevice]:
    """A fresh simulated device under ``config``; the default configuration again afterwards."""
    runtime.set_backend("sim", backend=SimBackend(device_count=1, memory_bytes=DEVICE_BYTES))
    gp.set_allocator_config(config.conf)
    gp.set_capture_detection(config.detect)
    try:
        dev = runtime.get().device(0)
        assert isinstance(dev, SimDevice)
        yield dev
    finally:
        try:
            gp.empty_cache()  # notices captures begun on the device that ended (after a failure)
        except GraphpoolError:
            pass
        gp.set_capture_detection(True)
        gp.set_backend("sim")  # a new runtime, which has not allocated: the config may change
        gp.set_allocator_config("")


@dataclass
class Buf:
    """A buffer the program holds and what it must contain: ``value`` in every byte (None:
    nothing known, e.g. a graph's output after the graph was released)."""

    buf: gp.DeviceBuffer | None
    ptr: int
    n: int
    stream: gp.Stream
    value: int | None
    written: int  # the program's clock (``Fuzz.tick``) when its fill was queued
    users: bool = False  # record_stream'd: other streams may still read it


@dataclass
class Graph:
    """A captured graph: graphpool's (``g``) or one captured on the device (``handles``)."""

    value: int
    g: gp.CUDAGraph | None = None
    handles: tuple[int, int] | None = None  # (graph, exec)
    outputs: list[Buf] = field(default_factory=list)
    replays: int = 0


class FuzzFailure(AssertionError):
    """A fuzz program found wrong bytes, a broken invariant or an unexpected error."""


class Fuzz:
    """One program: ``Fuzz(seed, dev, graphs=..., detect=...).run(steps)``."""

    def __init__(self, seed: int, dev: SimDevice, *, graphs: bool, detect: bool) -> None:
        self.rng = random.Random(seed)
        self.dev = dev
        self.graph_steps = graphs
        self.detect = detect
        self.streams = [gp.default_stream(), gp.Stream(), gp.Stream(), gp.Stream()]
        self.live: list[Buf] = []
        self.graphs: list[Graph] = []
        self.findings: list[str] = []
        self.log: list[str] = []
        self.capturing: set[int] = set()  # handles of the streams in the capture underway
        # What the program knows of each stream's queue, on its own clock: when work was last
        # queued on the stream, and when the stream was last synchronized.
        self.tick = 0
        self.queued: dict[int, int] = {}
        self.synced: dict[int, int] = {}
        self.step = 0
        self.reach: Counter[str] = Counter()  # what the program did, for the long runs' record
        self._eager = 0
        self._graph = 0

    # -- the program ------------------------------------------------------------
    def run(self, steps: int) -> None:
        """``steps`` random steps, then the final checks; FuzzFailure with the last steps."""
        table = self._table()
        names = list(table)
        weights = [table[n][1] for n in names]
        try:
            for self.step in range(1, steps + 1):
                name = self.rng.choices(names, weights)[0]
                self.note(name)
                table[name][0]()
                self._after_step()
            self.step += 1
            self.note("finish")
            self._finish()
        except FuzzFailure:
            raise
        except Exception as exc:
            self._fail(f"{type(exc).__name__}: {exc}", exc)

    def _table(self) -> dict[str, tuple[Callable[[], None], int]]:
        table: dict[str, tuple[Callable[[], None], int]] = {
            "alloc": (self.alloc, 30),
            "free": (self.free, 22),
            "use elsewhere": (self.use_elsewhere, 12),
            "sleep": (self.sleep_step, 7),
            "sync stream": (self.sync_stream, 5),
            "sync device": (self.sync_device, 2),
            "empty_cache": (self.empty_cache, 4),
            "collect": (self.collect, 1),
        }
        if self.graph_steps:
            table.update(
                capture=(self.capture, 8),
                replay=(self.replay, 12),
                **{"free output": (self.free_output, 3), "release": (self.release_step, 4)},
            )
        return table

    def note(self, what: str) -> None:
        self.log.append(f"{self.step:4d} {what}")
        self.reach[what.strip().split(",")[0]] += 1

    def _after_step(self) -> None:
        if self.findings:
            self._fail("wrong bytes:\n  " + "\n  ".join(self.findings[:5]))
        try:
            gp.check_invariants()
        except AssertionError as exc:
            self._fail(f"broken invariant: {exc}", exc)

    def _fail(self, what: str, cause: BaseException | None = None) -> None:
        tail = "\n".join(self.log[-40:])
        if self.findings and not what.startswith("wrong bytes"):
            what += "\nkernels that failed:\n  " + "\n  ".join(self.findings[:5])
        raise FuzzFailure(f"step {self.step}: {what}\nlast steps:\n{tail}") from cause

    # -- kernels ----------------------------------------------------------------
    def fill(self, ptr: int, n: int, value: int, stream: gp.Stream, what: str) -> None:
        """Queue a kernel on ``stream`` that writes ``value`` over ``[ptr, ptr + n)``."""
        dev, findings = self.dev, self.findings
        where = f"step {self.step} {what} (0x{ptr:x}, {n} B, value {value}, on stream 0x{stream.handle:x})"

        def kernel() -> None:
            try:
                dev.view(ptr, n)[:] = value
            except GraphpoolError as exc:  # e.g. memory given back to the driver: say whose
                findings.append(f"{where}: {exc}")
                raise

        dev.launch_kernel(stream.handle, kernel, "fill")
        self.work(stream)

    def check(self, b: Buf, stream: gp.Stream, what: str) -> None:
        """Queue a kernel on ``stream`` that reads ``b`` and reports bytes other than its value."""
        if b.value is None:
            return
        dev, findings, ptr, n, value = self.dev, self.findings, b.ptr, b.n, b.value
        where = f"step {self.step} {what} (0x{ptr:x}, {n} B, value {value}, on stream 0x{stream.handle:x})"

        def kernel() -> None:
            try:
                got = dev.view(ptr, n)
            except GraphpoolError as exc:
                findings.append(f"{where}: {exc}")
                raise
            wrong = differing(got, value)
            if wrong:
                findings.append(f"{where}: {wrong}")

        dev.launch_kernel(stream.handle, kernel, "check")
        self.work(stream)

    def sleep(self, stream: gp.Stream, most: int = 8) -> None:
        self.dev.launch_sleep(stream.handle, self.rng.randint(1, most))
        self.work(stream)

    def work(self, stream: gp.Stream) -> None:
        """Work was queued on ``stream`` (work on a capturing stream is captured, not queued)."""
        if stream.handle not in self.capturing:
            self.tick += 1
            self.queued[stream.handle] = self.tick

    def synchronized(self, *streams: gp.Stream) -> None:
        self.tick += 1
        for s in streams:
            self.synced[s.handle] = self.tick

    def idle(self, stream: gp.Stream) -> bool:
        """Whether all work queued on ``stream`` has run for sure (synchronized since)."""
        last = self.queued.get(stream.handle)
        return last is None or self.synced.get(stream.handle, 0) > last

    # -- choices ----------------------------------------------------------------
    def eager_streams(self) -> list[gp.Stream]:
        return [s for s in self.streams if s.handle not in self.capturing]

    def eager_value(self) -> int:
        self._eager += 1
        return EAGER_BYTES[self._eager % len(EAGER_BYTES)]

    def graph_value(self) -> int:
        self._graph += 1
        return GRAPH_BYTES[self._graph % len(GRAPH_BYTES)]

    def size(self) -> int:
        return self.rng.choices(SIZES, SIZE_WEIGHTS)[0] + self.rng.choice(JITTER)

    def pick_live(self) -> Buf | None:
        """A random live buffer on a stream not capturing, taken out of ``live``."""
        choices = [i for i, b in enumerate(self.live) if b.stream.handle not in self.capturing]
        if not choices:
            return None
        return self.live.pop(self.rng.choice(choices))

    def settled(self, b: Buf) -> bool:
        """Whether the kernel that last wrote ``b`` has run (its stream was synchronized since)."""
        return self.synced.get(b.stream.handle, 0) > b.written

    def new(self, n: int, stream: gp.Stream, value: int | None) -> Buf | None:
        """``n`` bytes on ``stream``, through ``gp.alloc(n, stream)`` or ``gp.stream``; None
        when the device is out of memory (a legitimate answer)."""
        try:
            if self.rng.random() < 0.3:
                with gp.stream(stream):
                    buf = gp.alloc(n)
            else:
                buf = gp.alloc(n, stream=stream)
        except OutOfMemoryError:
            self.note(f"     out of memory, {n} B on 0x{stream.handle:x}")
            return None
        return Buf(buf, buf.ptr, n, stream, value, written=0)

    def let_go(self, b: Buf) -> None:
        """Free ``b``: ``free()``, or drop the last reference (the finalizer frees it)."""
        buf, b.buf = b.buf, None
        assert buf is not None
        if self.rng.random() < 0.25:
            del buf
            if self.rng.random() < 0.2:
                gc.collect()
        else:
            buf.free()

    # -- eager steps ------------------------------------------------------------
    def alloc(self) -> None:
        s = self.rng.choice(self.eager_streams())
        b = self.new(self.size(), s, self.eager_value())
        if b is None:
            return
        if self.rng.random() < 0.4:
            self.sleep(s)
        assert b.value is not None
        self.fill(b.ptr, b.n, b.value, s, "eager buffer")
        b.written = self.tick
        self.live.append(b)

    def free(self) -> None:
        b = self.pick_live()
        if b is None:
            return
        if self.rng.random() < 0.5:
            self.sleep(b.stream)
        self.check(b, b.stream, "before its free")
        self.let_go(b)

    def use_elsewhere(self) -> None:
        """Another stream reads a buffer after a long kernel, then ``record_stream``."""
        b = self.pick_live()
        if b is None:
            return
        self.live.append(b)
        others = [s for s in self.eager_streams() if s.handle != b.stream.handle]
        o = self.rng.choice(others)
        o.wait_stream(b.stream)
        self.work(o)
        self.sleep(o)
        self.check(b, o, "read on another stream")
        assert b.buf is not None
        b.buf.record_stream(o)
        b.users = True

    def sleep_step(self) -> None:
        self.sleep(self.rng.choice(self.streams), 10)

    def sync_stream(self) -> None:
        s = self.rng.choice(self.streams)
        s.synchronize()
        self.synchronized(s)

    def sync_device(self) -> None:
        gp.synchronize()
        self.synchronized(*self.streams)

    def empty_cache(self) -> None:
        gp.empty_cache()

    def collect(self) -> None:
        gc.collect()

    # -- graphs -----------------------------------------------------------------
    def capture(self) -> None:
        if len(self.graphs) >= MAX_GRAPHS:
            return
        kinds = ["gp.graph", "capture_begin"] + (["device"] if self.detect else [])
        kind = self.rng.choice(kinds)
        mode = self.rng.choice(list(CAPTURE_MODES))
        graph = Graph(self.graph_value())
        self.note(f"     {kind} capture, {mode} mode, graph byte {graph.value}")
        self.reach[f"{mode} mode"] += 1
        if kind == "gp.graph":
            g = gp.CUDAGraph()
            on = self.rng.choice([None, *self.streams[1:]])
            with gp.graph(g, stream=on, capture_error_mode=mode):
                self.synchronized(*self.streams)  # gp.graph synchronized the device first
                self.capture_body(gp.current_stream(), graph, device=False)
            graph.g = g
        elif kind == "capture_begin":
            g = gp.CUDAGraph()
            c = self.rng.choice(self.streams[1:])
            with gp.stream(c):
                g.capture_begin(capture_error_mode=mode)
                with _ending(g.capture_end):
                    self.capture_body(c, graph, device=False)
            graph.g = g
        else:
            c = self.rng.choice(self.streams[1:])
            self.dev.begin_capture(c.handle, CAPTURE_MODES[mode])
            ended: list[int] = []
            with _ending(lambda: ended.append(self.dev.end_capture(c.handle))):
                self.capture_body(c, graph, device=True)
            graph.handles = (ended[0], self.dev.instantiate(ended[0]))
        self.graphs.append(graph)

    def capture_body(self, c: gp.Stream, graph: Graph, *, device: bool) -> None:
        """Random steps inside a capture on ``c``; the temporaries left allocated at the end
        are the graph's outputs. A capture begun on the device allocates first: detection
        happens at allocations (a free before the first one is not protected, as documented)."""
        self.capturing = {c.handle}
        joined: list[gp.Stream] = []
        temps: list[Buf] = []
        body: dict[str, tuple[Callable[[gp.Stream, Graph, list[Buf], list[gp.Stream]], bool], int]] = {
            "temporary": (self.temporary, 30),
            "free temporary": (self.free_temporary, 12),
            "write and free eager buffer": (self.victim, 14),
            "read and free eager buffer": (self.reader, 6),
            "buffer of another stream": (self.other_stream_buffer, 12),
            "eager alloc beside": (self.beside, 10),
            "eager free beside": (self.free_beside, 8),
            "join stream": (self.join, 6),
            "release another graph": (self.release_other, 2),
        }
        names = list(body)
        weights = [body[n][1] for n in names]
        plan = [self.rng.choices(names, weights)[0] for _ in range(self.rng.randint(1, 7))]
        if device:
            plan[0] = "temporary"
            if self.graphs and self.rng.random() < 0.25:
                plan.insert(0, "release another graph")  # before graphpool knows of the capture
        try:
            for name in plan:
                self.note(f"     in capture: {name}")
                done = body[name][0](c, graph, temps, joined)
                self._after_step()
                if device and name == "temporary" and not done and not temps:
                    break  # not detected: nothing may be freed in it
            for j in joined:
                c.wait_stream(j)
        finally:
            self.capturing = set()
        graph.outputs.extend(temps)

    def capture_streams(self, c: gp.Stream, joined: list[gp.Stream]) -> list[gp.Stream]:
        return [c, *joined]

    def temporary(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """The graph writes a buffer of its own and reads it back."""
        s = self.rng.choice(self.capture_streams(c, joined))
        b = self.new(self.size(), s, graph.value)
        if b is None:
            return False
        self.fill(b.ptr, b.n, graph.value, s, f"temporary of graph {graph.value}")
        self.check(b, s, f"temporary of graph {graph.value}")
        temps.append(b)
        return True

    def free_temporary(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        if not temps:
            return False
        self.let_go(temps.pop(self.rng.randrange(len(temps))))
        return True

    def victim(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """The graph writes an eager buffer of any stream, which is freed during the capture.
        Only one no other stream may still read (record_stream'd) and whose stream is idle
        (its fill, and the work of earlier owners of its memory, done): replays are not
        ordered after that work, so writing it would be the program's race, not the
        allocator's."""
        choices = [i for i, b in enumerate(self.live) if not b.users and self.idle(b.stream)]
        if not choices:
            return False
        b = self.live.pop(self.rng.choice(choices))
        self.fill(b.ptr, b.n, graph.value, c, f"eager buffer written by graph {graph.value}")
        self.let_go(b)
        return True

    def reader(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """The graph reads an eager buffer whose bytes are written for sure (its stream was
        synchronized since), which is then freed during the capture (after a ``record_stream``
        onto the capturing stream, sometimes): no one may write it while the graph lives."""
        choices = [i for i, b in enumerate(self.live) if self.settled(b)]
        if not choices:
            return False
        b = self.live.pop(self.rng.choice(choices))
        self.check(b, c, f"eager buffer read by graph {graph.value}")
        if self.rng.random() < 0.3 and b.buf is not None:
            b.buf.record_stream(c)
        self.let_go(b)
        return True

    def other_stream_buffer(
        self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]
    ) -> bool:
        """A buffer allocated during the capture on a stream outside it, written (and read) by
        the graph, freed before the capture ends. The stream is idle: the graph's use of the
        buffer is not ordered after the work of its memory's earlier owners there."""
        idle = [s for s in self.eager_streams() if self.idle(s)]
        if not idle:
            return False
        w = self.rng.choice(idle)
        b = self.new(self.size(), w, graph.value)
        if b is None:
            return False
        what = f"buffer of stream 0x{w.handle:x} in graph {graph.value}"
        self.fill(b.ptr, b.n, graph.value, c, what)
        if self.rng.random() < 0.5:
            self.check(b, c, what)
        self.let_go(b)
        return True

    def beside(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """Eager code allocates and writes on a stream outside the capture."""
        s = self.rng.choice(self.eager_streams())
        b = self.new(self.size(), s, self.eager_value())
        if b is None:
            return False
        assert b.value is not None
        self.fill(b.ptr, b.n, b.value, s, "eager buffer beside a capture")
        b.written = self.tick
        self.live.append(b)
        return True

    def free_beside(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """Eager code checks and frees a buffer on a stream outside the capture."""
        b = self.pick_live()
        if b is None:
            return False
        self.check(b, b.stream, "before its free beside a capture")
        self.let_go(b)
        return True

    def join(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        """Another stream joins the capture (it waits for the capturing stream)."""
        free = [s for s in self.eager_streams()[1:] if s.handle != c.handle]  # not the legacy stream
        if not free:
            return False
        j = self.rng.choice(free)
        j.wait_stream(c)
        self.capturing.add(j.handle)
        joined.append(j)
        return True

    def release_other(self, c: gp.Stream, graph: Graph, temps: list[Buf], joined: list[gp.Stream]) -> bool:
        if not self.graphs:
            return False
        self.release(self.graphs.pop(self.rng.randrange(len(self.graphs))))
        return True

    def replay(self) -> None:
        if not self.graphs:
            return
        graph = self.rng.choice(self.graphs)
        r = self.rng.choice(self.streams)
        if self.rng.random() < 0.5:
            self.sleep(r, 10)
        if graph.g is not None:
            with gp.stream(r):
                graph.g.replay()
        else:
            assert graph.handles is not None
            self.dev.launch(graph.handles[1], r.handle)
        self.work(r)
        graph.replays += 1
        for out in graph.outputs:
            if self.rng.random() < 0.5:
                self.check(out, r, f"output of graph {graph.value} after a replay")

    def free_output(self) -> None:
        with_outputs = [g for g in self.graphs if g.outputs]
        if not with_outputs:
            return
        graph = self.rng.choice(with_outputs)
        self.let_go(graph.outputs.pop(self.rng.randrange(len(graph.outputs))))

    def release_step(self) -> None:
        if self.graphs:
            self.release(self.graphs.pop(self.rng.randrange(len(self.graphs))))

    def release(self, graph: Graph) -> None:
        """Reset, drop or destroy a graph (launches may still be queued). Its outputs are freed
        or kept, their bytes then unknown (queued replays may still be writing them)."""
        for out in graph.outputs:
            if self.rng.random() < 0.5:
                self.let_go(out)
            else:
                out.value = None
                self.live.append(out)
        graph.outputs = []
        if graph.g is not None:
            if self.rng.random() < 0.5:
                graph.g.reset()
            else:
                graph.g = None
                gc.collect()
            self.note(f"     graph released, byte {graph.value}")
        else:
            assert graph.handles is not None
            handle, exe = graph.handles
            if self.rng.random() < 0.5:
                self.dev.destroy_graph_exec(exe)
                self.dev.destroy_graph(handle)
            else:
                self.dev.destroy_graph(handle)
                self.dev.destroy_graph_exec(exe)
            self.note(f"     device graph destroyed, byte {graph.value}")

    # -- the end ----------------------------------------------------------------
    def _finish(self) -> None:
        """Every byte read back, everything freed and released, nothing left reserved."""
        gp.synchronize()
        held = [*self.live, *(o for g in self.graphs if g.replays for o in g.outputs)]
        for b in held:
            if b.value is not None:
                wrong = differing(self.dev.view(b.ptr, b.n), b.value)
                if wrong:
                    self.findings.append(f"at the end: 0x{b.ptr:x} ({b.n} B, value {b.value}): {wrong}")
        self._after_step()
        while self.graphs:
            self.release(self.graphs.pop())  # its outputs join ``live`` or are freed
        for b in self.live:
            self.let_go(b)
        self.live.clear()
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        self._after_step()
        stats = gp.memory_stats()
        for key in ("num_alloc_retries", "num_ooms"):
            self.reach[key] += stats[key]
        reserved = gp.memory_reserved()
        if reserved:
            self._fail(f"{reserved} B still reserved after everything was freed and released")


@contextmanager
def _ending(end: Callable[[], object]) -> Iterator[None]:
    """Run ``end()`` after the block; if the block raised, its exception wins over ``end``'s."""
    try:
        yield
    except BaseException:
        try:
            end()
        except Exception:
            pass
        raise
    end()


def run_program(program: str, config: str, seed: int, steps: int) -> Counter[str]:
    """Run fuzz program ``program`` ("streams" or "graphs") under ``CONFIGS[config]``; what it
    did (steps by kind, out-of-memory retries and errors)."""
    cfg = CONFIGS[config]
    with configured(cfg) as dev:
        fuzz = Fuzz(seed, dev, graphs=program == "graphs", detect=cfg.detect)
        try:
            fuzz.run(steps)
            return fuzz.reach
        except FuzzFailure as exc:
            raise FuzzFailure(f"{program} program, config {config!r} ({cfg}), seed {seed}: {exc}") from exc
