"""The simulated CUDA device: streams, events, stream capture and graphs on the CPU, over
the memory calls it inherits from ``graphpool.sim.memcalls`` (device, managed and pinned host
memory, VMM, IPC).

Work is queued, not run: it runs only at synchronization points (stream, event and
device synchronize, ``read``, ``free``), and then every stream advances round-robin one
op per round, so independent streams interleave kernel by kernel as on a GPU. Capture
records ops into a graph instead; a replay queues each node as its own op and re-runs the
same closures on the same addresses, so replays that share memory corrupt each other and
a replay touching freed memory faults. CUDA's capture rules are enforced where the
allocator depends on them (see ``graphpool.sim.capture``).

This module imports only the device protocol and the errors, never the policy: it is an
independent check of it.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_INVALIDATED,
    CAPTURE_STATUS_NONE,
    LEGACY_STREAM,
)
from graphpool.sim import capture
from graphpool.sim.capture import Capture, Node
from graphpool.sim.cudaerr import cuda_error

# The address layout lives with the memory calls; its names stay importable from here too.
from graphpool.sim.memcalls import ADDRESS_BASE as ADDRESS_BASE
from graphpool.sim.memcalls import ADDRESS_SPAN as ADDRESS_SPAN
from graphpool.sim.memcalls import HOST_ADDRESS_BASE as HOST_ADDRESS_BASE
from graphpool.sim.memcalls import IPC_HANDLE_SIZE as IPC_HANDLE_SIZE
from graphpool.sim.memcalls import MANAGED_ADDRESS_BASE as MANAGED_ADDRESS_BASE
from graphpool.sim.memcalls import MANAGED_ADDRESS_SPAN as MANAGED_ADDRESS_SPAN
from graphpool.sim.memcalls import MemoryCalls

GiB = 1024**3
DEFAULT_DEVICE_COUNT = 2
DEFAULT_MEMORY_BYTES = 16 * GiB
DEFAULT_HOST_MEMORY_BYTES = 64 * GiB

_handles = itertools.count(0x1000, 0x10)
"""Stream, event, graph and exec handles: unique across kinds and devices, like CUDA's pointers;
never 1 or 2, which the CUDA array interface reserves for the default streams."""


class _Marker:
    """The point an event record marks in an eager stream's queue; ``done`` once it has run."""

    __slots__ = ("done",)

    def __init__(self, done: bool = False) -> None:
        self.done = done


@dataclass(frozen=True)
class _CaptureMark:
    """An event last recorded on a capturing stream: what a stream waiting on it depends on."""

    cap: Capture
    covers: dict[int, int]


class _Op:
    """One queued op: a kernel, a sleep, an event record or an event wait.

    A record that ends a graph launch carries the user objects the launch retained
    (``tokens``): they are dropped when it runs, that is when the launch completes.
    """

    __slots__ = ("fn", "marker", "name", "rounds", "tokens")

    def __init__(
        self,
        name: str,
        fn: Callable[[], None] | None = None,
        rounds: int = 0,
        marker: _Marker | None = None,
        tokens: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.fn = fn
        self.rounds = rounds
        self.marker = marker
        self.tokens = tokens


@dataclass
class _Stream:
    handle: int
    queue: deque[_Op] = field(default_factory=deque)
    capture: Capture | None = None
    destroyed: bool = False


class SimDevice(MemoryCalls):
    """One simulated device; implements ``graphpool.device.protocol.Device``.

    Implements ``IpcDevice`` too (memory shared with other processes through files of
    OS shared memory). Beyond the protocols: ``launch_kernel`` and ``launch_sleep`` (queue work),
    ``view`` (bytes at an address, for kernels), ``pending_ops`` and ``allocations``
    (inspection), ``memory_bytes``.
    """

    def __init__(
        self,
        index: int = 0,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        host_memory_bytes: int = DEFAULT_HOST_MEMORY_BYTES,
    ) -> None:
        self.index = index
        self.name = f"graphpool simulated device {index}"
        self._lock = threading.RLock()
        self._query_fn: Any = None  # capture_query_address's ctypes callback, kept alive
        self._init_memory(index, memory_bytes, host_memory_bytes)  # sets memory_bytes
        self._streams: dict[int, _Stream] = {LEGACY_STREAM: _Stream(LEGACY_STREAM)}
        self._made: set[int] = set()  # streams create_stream made, not destroyed
        self._events: dict[int, _Marker | _CaptureMark | None] = {}
        self._graphs: dict[int, tuple[Node, ...]] = {}
        self._execs: dict[int, tuple[Node, ...]] = {}
        # User objects (cuUserObjectCreate + cuGraphRetainUserObject): token -> references
        # held by captures, graphs and execs; a token whose count reaches 0 is released.
        self._token_refs: dict[int, int] = {}
        self._holders: dict[int, tuple[int, ...]] = {}  # graph or exec handle -> its tokens
        self._released: list[int] = []
        self._host_tokens: set[int] = set()  # attach_host_release's, not yet taken
        self._last_launch: dict[int, _Marker] = {}  # exec -> the end of its latest launch
        self._peers: list[SimDevice] = [self]  # the backend's devices (SimBackend sets it)

    def __repr__(self) -> str:
        return f"SimDevice(index={self.index}, memory_bytes={self.memory_bytes})"

    def memcpy_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyAsync(cudaMemcpyDefault): runs (or replays) on ``stream``, reading the host
        bytes then, not now."""

        def copy() -> None:
            self.view(dst, nbytes)[:] = self.view(src, nbytes)

        self._submit("cudaMemcpyAsync", stream, Node("memcpy_host", copy))

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        byte = value & 0xFF

        def fill() -> None:
            self.view(ptr, nbytes)[:] = byte

        self._submit("cudaMemsetAsync", stream, Node("memset", fill))

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        def copy() -> None:
            self.view(dst, nbytes)[:] = self.view(src, nbytes)

        self._submit("cudaMemcpyAsync", stream, Node("memcpy", copy))

    def write(self, ptr: int, data: bytes | bytearray | memoryview, stream: int) -> None:
        """Queue a host-to-device copy of ``data`` (copied now, so the caller may reuse it)."""
        payload = np.frombuffer(bytes(data), dtype=np.uint8)
        with self._lock:
            self._refuse_if_capturing(
                "cudaMemcpyAsync(HostToDevice)", self._stream("cudaMemcpyAsync", stream)
            )

            def put() -> None:
                self.view(ptr, payload.size)[:] = payload

            self._submit("cudaMemcpyAsync", stream, Node("write", put))

    def read(self, ptr: int, nbytes: int, stream: int) -> bytes:
        """Run ``stream``'s work so far, then return the bytes at ``ptr``. A synchronization."""
        with self._lock:
            st = self._stream("cudaMemcpy", stream)
            self._refuse_if_capturing("cudaMemcpy(DeviceToHost)", st)
            capture.check_unsafe("cudaMemcpy(DeviceToHost)")
            self._run_until(lambda: not st.queue)
            mem = self._managed if self._is_managed(ptr) else self._mem
            return mem.view(ptr, nbytes, "cudaMemcpy(DeviceToHost)").tobytes()

    # -- work -----------------------------------------------------------------
    def launch_kernel(self, stream: int, fn: Callable[[], None], name: str = "kernel") -> None:
        """Queue (or capture) ``fn`` on ``stream``; it runs at a later synchronization.

        ``fn`` should close over addresses and sizes only and call ``view`` when it runs,
        as a GPU kernel dereferences its pointers only when it executes.
        """
        self._submit("cudaLaunchKernel", stream, Node(name, fn))

    def launch_sleep(self, stream: int, rounds: int = 10) -> None:
        """Queue a long-running kernel that occupies ``stream`` for ``rounds`` scheduling rounds."""
        if rounds < 1:
            raise cuda_error("cudaLaunchKernel", "cudaErrorInvalidValue", f"rounds {rounds}")
        self._submit("cudaLaunchKernel", stream, Node("sleep", None, rounds))

    def pending_ops(self, stream: int | None = None) -> int:
        """Ops queued and not yet run, on ``stream`` or (None) on every stream."""
        with self._lock:
            if stream is not None:
                return len(self._stream("pending_ops", stream).queue)
            return sum(len(st.queue) for st in self._streams.values())

    # -- streams --------------------------------------------------------------
    def create_stream(self) -> int:
        with self._lock:
            handle = next(_handles)
            self._streams[handle] = _Stream(handle)
            self._made.add(handle)
            return handle

    def destroy_stream(self, stream: int) -> None:
        """Destroy ``stream``; work already queued on it still runs, as in CUDA."""
        with self._lock:
            if stream == LEGACY_STREAM:
                raise cuda_error(
                    "cudaStreamDestroy",
                    "cudaErrorInvalidResourceHandle",
                    "legacy stream",
                )
            st = self._stream("cudaStreamDestroy", stream)
            if st.capture is not None:
                raise cuda_error("cudaStreamDestroy", "cudaErrorIllegalState", "stream is capturing")
            st.destroyed = True
            self._made.discard(stream)
            if not st.queue:
                del self._streams[stream]

    def owns_stream(self, stream: int) -> bool:
        """Whether ``stream`` is a live (not destroyed) stream of this device."""
        with self._lock:
            st = self._streams.get(stream)
            return st is not None and not st.destroyed

    def stream_wait_event(self, stream: int, event: int) -> None:
        call = "cudaStreamWaitEvent"
        if event not in self._events:
            peer = next((d for d in self._peers if d is not self and event in d._events), None)
            if peer is not None:
                self._wait_peer(call, stream, peer, event)
                return
        with self._lock:
            st = self._stream(call, stream)
            state = self._event(call, event)
            cap = st.capture
            if cap is not None and cap.status == CAPTURE_STATUS_INVALIDATED:
                return
            if state is None:
                return  # an event never recorded stands for no work
            if isinstance(state, _CaptureMark):
                self._wait_captured(call, st, state)
            elif cap is not None:
                capture.invalidate(cap)
                raise cuda_error(
                    call,
                    "cudaErrorStreamCaptureIsolation",
                    f"stream {stream} is capturing",
                )
            elif not state.done:
                st.queue.append(_Op("wait", marker=state))

    def _wait_peer(self, call: str, stream: int, peer: SimDevice, event: int) -> None:
        """``stream`` waits on an event of another device, as CUDA allows.

        The simulator has no cross-device queue, so the other device runs its work up to the
        event now (a schedule CUDA could also pick), and nothing is queued here. A capturing
        stream cannot depend on work outside its capture (cudaErrorStreamCaptureIsolation).
        """
        with self._lock:
            st = self._stream(call, stream)
            cap = st.capture
            if cap is not None:
                if cap.status == CAPTURE_STATUS_INVALIDATED:
                    return
                capture.invalidate(cap)
                raise cuda_error(
                    call,
                    "cudaErrorStreamCaptureIsolation",
                    f"stream {stream} is capturing and the event belongs to device {peer.index}",
                )
        with peer._lock:  # never both locks at once: two threads may wait crosswise
            state = peer._event(call, event)
            if isinstance(state, _CaptureMark):
                raise cuda_error(
                    call,
                    "cudaErrorStreamCaptureIsolation",
                    f"event {event} was recorded in a capture on device {peer.index}",
                )
            if state is not None:
                marker = state
                peer._run_until(lambda: marker.done)

    def _wait_captured(self, call: str, st: _Stream, mark: _CaptureMark) -> None:
        """``st`` waits on an event recorded in a capture: a dependency in it, or a join."""
        if mark.cap.ended:
            raise cuda_error(call, "cudaErrorCapturedEvent", "its capture has ended")
        if st.capture is mark.cap:
            mark.cap.join(st.handle, mark.covers)
        elif st.capture is not None:
            capture.invalidate(st.capture)
            raise cuda_error(
                call,
                "cudaErrorStreamCaptureMerge",
                f"stream {st.handle} is in another capture",
            )
        elif st.handle == LEGACY_STREAM:
            capture.invalidate(mark.cap)
            raise cuda_error(
                call,
                "cudaErrorStreamCaptureUnsupported",
                "the legacy stream cannot join a capture",
            )
        else:
            mark.cap.join(st.handle, mark.covers)
            st.capture = mark.cap

    def stream_synchronize(self, stream: int) -> None:
        with self._lock:
            st = self._stream("cudaStreamSynchronize", stream)
            self._refuse_if_capturing("cudaStreamSynchronize", st)
            capture.check_unsafe("cudaStreamSynchronize")
            self._run_until(lambda: not st.queue)

    def device_synchronize(self) -> None:
        """Wait for all work. Like cudaDeviceSynchronize it waits for the capturing streams
        too, so it is illegal while any stream of this device captures, in every mode."""
        with self._lock:
            self._refuse_if_device_capturing("cudaDeviceSynchronize")
            capture.check_unsafe("cudaDeviceSynchronize")
            self._run_until(self._idle)

    def stream_idle(self, stream: int) -> bool:
        """Whether a stream this device made is live, not capturing and has no queued work
        (runs nothing itself); False for any other handle, as on CUDA. Legal in any capture
        mode (CUDA's device queries under the relaxed mode)."""
        with self._lock:
            if stream not in self._made:
                return False
            st = self._streams[stream]
            return st.capture is None and not st.queue

    def stream_synchronize_made(self, stream: int) -> bool:
        """Wait for the queued work of a stream this device made, live and not capturing;
        whether it waited (False for any other handle, never asked, as on CUDA)."""
        with self._lock:
            if stream not in self._made:
                return False
            st = self._streams[stream]
            if st.capture is not None or st.destroyed:
                return False
            capture.check_unsafe("cudaStreamSynchronize")
            self._run_until(lambda: not st.queue)
            return True

    def made_streams_capturing(self) -> bool:
        """Whether a live stream this device made is capturing (as on CUDA: no other is asked)."""
        with self._lock:
            return any(self._streams[s].capture is not None for s in self._made)

    def stream_capturing(self, stream: int) -> bool | None:
        """Whether a stream this device made is live and capturing; None for any other handle,
        as on CUDA (never asked). Legal in any capture mode."""
        with self._lock:
            if stream not in self._made:
                return None
            return self._streams[stream].capture is not None

    # -- events ---------------------------------------------------------------
    def create_event(self) -> int:
        with self._lock:
            handle = next(_handles)
            self._events[handle] = None
            return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            self._event("cudaEventDestroy", event)
            del self._events[event]

    def record_event(self, event: int, stream: int) -> None:
        call = "cudaEventRecord"
        with self._lock:
            st = self._stream(call, stream)
            self._event(call, event)
            cap = st.capture
            if cap is not None:
                if cap.status == CAPTURE_STATUS_ACTIVE:
                    self._events[event] = _CaptureMark(cap, dict(cap.covers[stream]))
                return
            if not st.queue:  # nothing pending: the marked work is already done
                self._events[event] = _Marker(done=True)
                return
            marker = _Marker()
            st.queue.append(_Op("record", marker=marker))
            self._events[event] = marker

    def query_event(self, event: int) -> bool:
        """Whether the recorded work has run. Runs nothing itself. Unsafe in capture."""
        with self._lock:
            capture.check_unsafe("cudaEventQuery")
            state = self._event("cudaEventQuery", event)
            if isinstance(state, _CaptureMark):
                # CUDA 13 on the H200: refused as a captured event, and a capture still underway is
                # lost; once an invalidated capture has ended, an invalid value
                cap = state.cap
                if cap.status == CAPTURE_STATUS_ACTIVE and cap in capture.ongoing():
                    capture.invalidate(cap)
                elif cap.ended and cap.status == CAPTURE_STATUS_INVALIDATED:
                    raise cuda_error("cudaEventQuery", "cudaErrorInvalidValue", "its capture failed")
                raise cuda_error("cudaEventQuery", "cudaErrorCapturedEvent")
            return state is None or state.done

    def event_synchronize(self, event: int) -> None:
        with self._lock:
            capture.check_unsafe("cudaEventSynchronize")
            state = self._event("cudaEventSynchronize", event)
            if isinstance(state, _CaptureMark):
                # CUDA 13 on the H200: during the capture refused as a captured event, and the
                # capture is lost; after it ended, an invalid value
                if state.cap.status == CAPTURE_STATUS_ACTIVE and state.cap in capture.ongoing():
                    capture.invalidate(state.cap)
                    raise cuda_error("cudaEventSynchronize", "cudaErrorCapturedEvent")
                raise cuda_error("cudaEventSynchronize", "cudaErrorInvalidValue", "a captured event")
            if state is not None:
                marker = state
                self._run_until(lambda: marker.done)

    # -- capture and graphs ---------------------------------------------------
    def capture_info(self, stream: int) -> tuple[int, int]:
        with self._lock:
            cap = self._stream("cudaStreamGetCaptureInfo", stream).capture
            if cap is None:
                return CAPTURE_STATUS_NONE, 0
            return cap.status, cap.id

    def capture_query_address(self) -> int:
        """``capture_id`` as a C function (the protocol's), through ctypes: the callback takes
        the GIL itself. Made once and kept alive with the device; any error answers -1."""
        import ctypes

        if self._query_fn is None:

            def query(stream: int | None, out: Any) -> int:
                try:
                    out[0] = self.capture_id(stream or 0)
                    return 0
                except BaseException:  # (a callback must not raise into C)
                    return -1

            proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong))
            self._query_fn = proto(query)
        return int(ctypes.cast(self._query_fn, ctypes.c_void_p).value or 0)

    def capture_id(self, stream: int) -> int:
        with self._lock:
            cap = self._stream("cudaStreamGetCaptureInfo", stream).capture
            return 0 if cap is None else cap.id

    def attach_release(self, stream: int, token: int) -> None:
        """A user object moved into the graph being captured on ``stream`` (see the protocol)."""
        call = "cuGraphRetainUserObject"
        with self._lock:
            cap = self._stream(call, stream).capture
            if cap is None or cap.status != CAPTURE_STATUS_ACTIVE:
                raise cuda_error(call, "cudaErrorIllegalState", f"stream {stream} is not capturing")
            cap.tokens.append(token)
            self._token_refs[token] = self._token_refs.get(token, 0) + 1

    def take_released(self) -> list[int]:
        with self._lock:
            if self._host_tokens:  # the pinned pool's stay for take_host_released
                out = [t for t in self._released if t not in self._host_tokens]
                self._released = [t for t in self._released if t in self._host_tokens]
                return out
            out, self._released = self._released, []
            return out

    def attach_host_release(self, stream: int, token: int) -> None:
        with self._lock:
            self.attach_release(stream, token)
            self._host_tokens.add(token)

    def take_host_released(self) -> list[int]:
        with self._lock:
            out = [t for t in self._released if t in self._host_tokens]
            if out:
                self._released = [t for t in self._released if t not in self._host_tokens]
                self._host_tokens.difference_update(out)
            return out

    def _retain(self, handle: int, tokens: tuple[int, ...]) -> None:
        if tokens:
            self._holders[handle] = tokens
            for t in tokens:
                self._token_refs[t] += 1

    def _drop(self, tokens: tuple[int, ...] | list[int]) -> None:
        """Drop one reference to each token; a token no graph, exec or queued launch holds is
        released."""
        for t in tokens:
            n = self._token_refs[t] - 1
            if n:
                self._token_refs[t] = n
            else:
                del self._token_refs[t]
                self._released.append(t)

    def exchange_capture_mode(self, mode: int) -> int:
        return capture.exchange_mode(mode)

    def begin_capture(self, stream: int, mode: int) -> None:
        call = "cudaStreamBeginCapture"
        capture.check_mode(call, mode)
        with self._lock:
            if stream == LEGACY_STREAM:
                raise cuda_error(
                    call,
                    "cudaErrorStreamCaptureUnsupported",
                    "the legacy stream cannot be captured",
                )
            st = self._stream(call, stream)
            if st.capture is not None:
                raise cuda_error(
                    call,
                    "cudaErrorIllegalState",
                    f"stream {stream} is already capturing",
                )
            st.capture = capture.start(stream, mode)

    def end_capture(self, stream: int) -> int:
        call = "cudaStreamEndCapture"
        with self._lock:
            st = self._stream(call, stream)
            cap = st.capture
            if cap is None or cap.origin != stream:
                raise cuda_error(
                    call,
                    "cudaErrorIllegalState",
                    f"stream {stream} did not begin a capture",
                )
            wrong_thread = cap.mode != CAPTURE_MODE_RELAXED and cap.thread is not threading.current_thread()
            capture.finish(cap)
            for handle in cap.seq:
                member = self._streams.get(handle)
                if member is not None and member.capture is cap:
                    member.capture = None
            tokens = tuple(cap.tokens)
            if wrong_thread:
                # CUDA ends the capture all the same and gives no graph: on the H200 (driver
                # 580, CUDA 13) the stream no longer captured after this error
                # (benchmarks/results/2026-11-30-h200-run14).
                capture.invalidate(cap)
                self._drop(tokens)
                raise cuda_error(call, "cudaErrorStreamCaptureWrongThread")
            if cap.status == CAPTURE_STATUS_INVALIDATED:
                self._drop(tokens)  # the graph is discarded: its user objects go with it
                raise cuda_error(call, "cudaErrorStreamCaptureInvalidated")
            unjoined = cap.unjoined()
            if unjoined:
                capture.invalidate(cap)
                self._drop(tokens)
                raise cuda_error(call, "cudaErrorStreamCaptureUnjoined", f"streams {unjoined}")
            graph = next(_handles)
            self._graphs[graph] = tuple(cap.nodes)
            if tokens:  # the capture's references move to the graph
                self._holders[graph] = tokens
            return graph

    def graph_node_count(self, graph: int) -> int:
        with self._lock:
            return len(self._graph("cudaGraphGetNodes", graph))

    def instantiate(self, graph: int) -> int:
        with self._lock:
            capture.check_unsafe("cudaGraphInstantiate")  # "unsafe" during a capture, as in CUDA
            nodes = self._graph("cudaGraphInstantiate", graph)
            handle = next(_handles)
            self._execs[handle] = nodes
            self._retain(handle, self._holders.get(graph, ()))
            return handle

    def launch(self, graph_exec: int, stream: int) -> None:
        """Queue one replay: each node becomes its own op, so replays of different graphs on two
        streams interleave. Launches of one exec run in launch order, whatever their streams,
        as in CUDA: a launch waits for the end of the previous one. Each launch holds a
        reference to the exec's user objects until it completes, as CUDA's does, so destroying
        the exec (and its graph) with launches queued releases them only after the last one."""
        call = "cudaGraphLaunch"
        with self._lock:
            nodes = self._execs.get(graph_exec)
            if nodes is None:
                raise cuda_error(call, "cudaErrorInvalidResourceHandle", f"graph exec {graph_exec}")
            st = self._stream(call, stream)
            self._refuse_if_capturing(call, st)  # CUDA refuses a graph launch into a capture
            prev = self._last_launch.get(graph_exec)
            if prev is not None and not prev.done:
                st.queue.append(_Op("wait", marker=prev))
            for node in nodes:
                st.queue.append(_Op(node.name, node.fn, node.rounds))
            end = _Marker()
            tokens = self._holders.get(graph_exec, ())
            for t in tokens:
                self._token_refs[t] += 1
            st.queue.append(_Op("record", marker=end, tokens=tokens))
            self._last_launch[graph_exec] = end

    def destroy_graph(self, graph: int) -> None:
        with self._lock:
            self._graph("cudaGraphDestroy", graph)
            del self._graphs[graph]
            self._drop(self._holders.pop(graph, ()))

    def destroy_graph_exec(self, graph_exec: int) -> None:
        with self._lock:
            if self._execs.pop(graph_exec, None) is None:
                raise cuda_error(
                    "cudaGraphExecDestroy",
                    "cudaErrorInvalidResourceHandle",
                    f"graph exec {graph_exec}",
                )
            self._last_launch.pop(graph_exec, None)
            self._drop(self._holders.pop(graph_exec, ()))

    # -- internals ------------------------------------------------------------
    def _stream(self, call: str, stream: int) -> _Stream:
        st = self._streams.get(stream)
        if st is None or st.destroyed:
            raise cuda_error(call, "cudaErrorInvalidResourceHandle", f"stream {stream}")
        return st

    def _event(self, call: str, event: int) -> _Marker | _CaptureMark | None:
        if event not in self._events:
            raise cuda_error(call, "cudaErrorInvalidResourceHandle", f"event {event}")
        return self._events[event]

    def _graph(self, call: str, graph: int) -> tuple[Node, ...]:
        nodes = self._graphs.get(graph)
        if nodes is None:
            raise cuda_error(call, "cudaErrorInvalidResourceHandle", f"graph {graph}")
        return nodes

    def _refuse_if_capturing(self, call: str, st: _Stream) -> None:
        """A synchronous call on a capturing stream is always illegal: invalidate and raise."""
        if st.capture is not None:
            capture.invalidate(st.capture)
            raise cuda_error(
                call,
                "cudaErrorStreamCaptureUnsupported",
                f"stream {st.handle} is capturing",
            )

    def _refuse_if_device_capturing(self, call: str) -> None:
        """A call that waits for every stream of the device is illegal while one captures, in
        every capture mode: invalidate those captures and raise."""
        capturing = [
            st.capture for st in self._streams.values() if st.capture is not None and not st.destroyed
        ]
        if capturing:
            for cap in capturing:
                capture.invalidate(cap)
            ids = ", ".join(str(cap.id) for cap in capturing)
            raise cuda_error(
                call, "cudaErrorStreamCaptureUnsupported", f"invalidated capture {ids} of this device"
            )

    def _submit(self, call: str, stream: int, node: Node) -> None:
        """Queue ``node`` on ``stream``, or record it into its capture (dropped if invalidated)."""
        with self._lock:
            st = self._stream(call, stream)
            cap = st.capture
            if cap is None:
                st.queue.append(_Op(node.name, node.fn, node.rounds))
            elif cap.status == CAPTURE_STATUS_ACTIVE:
                cap.add(stream, node)

    def _wait_uninterrupted(self, done: Callable[[], bool] | None = None) -> BaseException | None:
        """Run all queued work for ``free`` and ``vmm_unmap``, which then give memory back; return
        the exception that interrupted the wait, for the caller to raise after that.

        CUDA waits inside cudaFree, in C: a signal that arrives meanwhile is handled once the
        call has returned, the memory freed. Here the kernels are Python code, where Python
        runs handlers: a KeyboardInterrupt (or another exception that is not an ``Exception``)
        raised by one does not stop the wait half-way; the wait goes on, the caller gives the
        memory back, and raises the first such exception after that. A kernel's own error (an
        ``Exception``) propagates at once, as before. ``done``: what to wait for instead of
        every stream being idle (``vmm_unmap`` given a stream: that stream's queue empty).
        """
        interrupted: BaseException | None = None
        target = self._idle if done is None else done
        while True:
            try:
                self._run_until(target)
                break
            except Exception:
                if interrupted is not None:
                    raise interrupted from None
                raise
            except BaseException as exc:
                if interrupted is None:
                    interrupted = exc
        return interrupted

    def _wait_for_unmap(self, stream: int | None) -> BaseException | None:
        """``vmm_unmap``'s wait, the lock held: ``stream``'s queued work where this device made
        it and it is not capturing (graphpool's CUDA device: cudaStreamSynchronize), else all
        queued work, refused while any stream captures (cudaDeviceSynchronize). What
        ``_wait_uninterrupted`` returns."""
        st = self._streams.get(stream) if stream is not None and stream in self._made else None
        if st is not None and st.capture is None and not st.destroyed:
            capture.check_unsafe("cuMemUnmap")
            return self._wait_uninterrupted(lambda: not st.queue)
        self._refuse_if_device_capturing("cudaDeviceSynchronize")
        capture.check_unsafe("cuMemUnmap")
        return self._wait_uninterrupted()

    def _idle(self) -> bool:
        return not any(st.queue for st in self._streams.values())

    def _run_until(self, target: Callable[[], bool]) -> None:
        """Advance every stream one op per round, round-robin, until ``target()`` holds.

        Runs in the calling thread with the lock held. A kernel's exception propagates
        (its op is consumed; later work stays queued).
        """
        while not target():
            progressed = False
            for st in list(self._streams.values()):
                if st.queue and self._step(st):
                    progressed = True
                if st.destroyed and not st.queue:
                    self._streams.pop(st.handle, None)
            if not progressed:
                raise RuntimeError(
                    "simulated device deadlock: every stream waits on an event that never completes"
                )

    def _step(self, st: _Stream) -> bool:
        """Run the head op of ``st``'s queue; False when it waits on an unfinished event."""
        op = st.queue[0]
        if op.marker is not None:
            if op.name == "wait":
                if not op.marker.done:
                    return False
            else:
                op.marker.done = True
                if op.tokens:  # the end of a graph launch: its user objects' references go
                    self._drop(op.tokens)
            st.queue.popleft()
            return True
        if op.fn is None:  # sleep
            op.rounds -= 1
            if op.rounds <= 0:
                st.queue.popleft()
            return True
        st.queue.popleft()
        op.fn()
        return True


class SimBackend:
    """A set of simulated devices; implements ``graphpool.device.protocol.Backend``."""

    name = "sim"

    def __init__(
        self,
        device_count: int | None = None,
        memory_bytes: int | None = None,
        host_memory_bytes: int | None = None,
    ) -> None:
        count = _defaults["device_count"] if device_count is None else device_count
        size = _defaults["memory_bytes"] if memory_bytes is None else memory_bytes
        host = _defaults["host_memory_bytes"] if host_memory_bytes is None else host_memory_bytes
        if count < 1 or size < 1 or host < 1:
            raise ValueError(
                f"need device_count, memory_bytes and host_memory_bytes >= 1, got {count}, {size}, {host}"
            )
        self._devices = [SimDevice(i, size, host) for i in range(count)]
        for dev in self._devices:
            dev._peers = self._devices  # cross-device event waits (SimDevice.stream_wait_event)
            dev._host = self._devices[0]._host  # the process's host memory: one for all devices
            dev._host_lock = self._devices[0]._host_lock
        self._current = threading.local()

    def __repr__(self) -> str:
        size = self._devices[0].memory_bytes
        return f"SimBackend(device_count={len(self._devices)}, memory_bytes={size})"

    def device_count(self) -> int:
        return len(self._devices)

    def get_device(self, index: int) -> SimDevice:
        self._check_index("cudaGetDevice", index)
        return self._devices[index]

    def set_current_device(self, index: int) -> None:
        self._check_index("cudaSetDevice", index)
        self._current.index = index

    def current_device(self) -> int:
        """The calling thread's current device index (0 until ``set_current_device``)."""
        index: int = getattr(self._current, "index", 0)
        return index

    def _check_index(self, call: str, index: int) -> None:
        if not 0 <= index < len(self._devices):
            raise cuda_error(
                call,
                "cudaErrorInvalidDevice",
                f"device {index} of {len(self._devices)}",
            )


_defaults = {
    "device_count": DEFAULT_DEVICE_COUNT,
    "memory_bytes": DEFAULT_MEMORY_BYTES,
    "host_memory_bytes": DEFAULT_HOST_MEMORY_BYTES,
}


def configure(
    device_count: int | None = None, memory_bytes: int | None = None, host_memory_bytes: int | None = None
) -> dict[str, int]:
    """Set the defaults of ``SimBackend``s made from now on (e.g. by ``set_backend("sim")``).

    Returns the defaults now in force. Backends already made are unchanged.
    """
    if device_count is not None:
        if device_count < 1:
            raise ValueError(f"device_count must be >= 1, got {device_count}")
        _defaults["device_count"] = device_count
    if memory_bytes is not None:
        if memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {memory_bytes}")
        _defaults["memory_bytes"] = memory_bytes
    if host_memory_bytes is not None:
        if host_memory_bytes < 1:
            raise ValueError(f"host_memory_bytes must be >= 1, got {host_memory_bytes}")
        _defaults["host_memory_bytes"] = host_memory_bytes
    return dict(_defaults)
