# ruff: noqa: E501  (the mutants are source lines, quoted whole)
"""Hand-made mutants of issue 28, item 1, each against the tests written to kill it.

Run by hand from the repository root (never by CI: no file here is a test):

    PYTHONPATH=src python tests/mutation/handmade.py            # every mutant
    PYTHONPATH=src python tests/mutation/handmade.py takeover   # those whose name has "takeover"

For each mutant: the source is checked to pass its tests, the one edit is applied in place
(its ``old`` text must occur exactly once), the tests are run (killed: they fail), and the
file is written back byte for byte, then its tests are run again (they must pass). Prints a
markdown table (tests/mutation/handmade-2026-12-04.md holds the last one).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    behaviour: str
    file: str  # relative to src/graphpool
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    label: str = ""  # the edit in words, for the table (default: old -> new)


ALLOC = "policy/allocator.py"
EXPANDABLE = "policy/expandable.py"
SEGMENTS = "policy/segments.py"
T_TAKE = "tests/policy/test_stream_takeover.py::"
T_EXP = "tests/test_expandable_rules.py::"
T_GC = "tests/policy/test_gc_and_limits.py::"
T_SB = "tests/test_streams_buffers.py::"
T_FID = "tests/sim/test_fidelity.py::"
T_CUPY = "tests/test_twin_cupy_capture.py::"
SIM = "sim/device.py"
SIM_MEMORY = "sim/memcalls.py"

MUTANTS = (
    Mutant(
        "takeover: a block freed right after its stream's idle answer counted as covered",
        EXPANDABLE,
        "return b.stream == stream or b.gc_base < done.get(b.stream, 0)",
        "return b.stream == stream or b.gc_base <= done.get(b.stream, 0)",
        (T_TAKE + "test_a_block_freed_after_its_streams_idle_answer_needs_a_new_answer",),
    ),
    Mutant(
        "takeover: an idle answer stamped one tick late",
        EXPANDABLE,
        "                        done[t] = now\n",
        "                        done[t] = now + 1\n",
        (T_TAKE + "test_a_block_freed_after_its_streams_idle_answer_needs_a_new_answer",),
    ),
    Mutant(
        "takeover: growing a segment absorbs another stream's busy free tail",
        EXPANDABLE,
        "tail.size < size and tail.stream == stream",
        "tail.size < size",
        (T_TAKE + "test_growing_a_segment_never_absorbs_another_streams_free_tail",),
    ),
    Mutant(
        "takeover: max_split_size ignored",
        EXPANDABLE,
        "                    if total < self._max_split or not self._refuses(total, size):\n"
        "                        best, best_size = first, total",
        "                    if True:\n                        best, best_size = first, total",
        (T_TAKE + "test_takeover_keeps_max_split_size",),
    ),
    Mutant(
        "expandable: the first segment of a stream skips the limits",
        EXPANDABLE,
        "if need > reserve or not self._map_allowed(need):",
        "if need > reserve:",
        (T_EXP + "test_a_limit_refuses_the_mapping_of_an_expandable_segment",),
    ),
    Mutant(
        "expandable: a mapping checked against the byte cap only (the fraction skipped)",
        SEGMENTS,
        "        limits = self.limits\n"
        '        if limits.cap is not None and self.stats.current("reserved_bytes") + nbytes > limits.cap:',
        "        limits = self.limits\n"
        "        if limits.nbytes is not None and "
        'self.stats.current("reserved_bytes") + nbytes > limits.nbytes:',
        (T_EXP + "test_a_limit_refuses_the_mapping_of_an_expandable_segment",),
        "`_map_allowed` tests `limits.nbytes` instead of `limits.cap`",
    ),
    Mutant(
        "expandable: empty_cache unmaps a free end that a graph still keeps",
        EXPANDABLE,
        "if tail.allocated or tail.holds or tail.prev is None or tail.stream in keep:",
        "if tail.allocated or tail.prev is None or tail.stream in keep:",
        (T_EXP + "test_empty_cache_keeps_a_free_end_a_graph_still_writes",),
    ),
    Mutant(
        "GC: blocks of equal age never collected (>= vs >)",
        SEGMENTS,
        "if age >= threshold_age:",
        "if age > threshold_age:",
        (T_GC + "test_segments_of_equal_age_are_collected",),
    ),
    Mutant(
        "GC: the threshold measured against the binding cap instead of the fraction's",
        SEGMENTS,
        "cap = self.limits.fraction_bytes()",
        "cap = self.limits.cap",
        (T_GC + "test_the_threshold_is_a_share_of_the_fraction_not_of_a_smaller_byte_limit",),
    ),
    Mutant(
        "limits: the fraction cap rounded up instead of truncated",
        "policy/limits.py",
        "else int(self.fraction * self.total)",
        "else math.ceil(self.fraction * self.total)",
        (
            T_GC + "test_the_fraction_cap_is_truncated",
            T_GC + "test_a_segment_one_byte_past_the_truncated_fraction_is_refused",
        ),
    ),
    Mutant(
        "streams: an invalidated capture reads as not capturing",
        "streams.py",
        "return self._dev().capture_info(self.handle)[0] != CAPTURE_STATUS_NONE",
        "return self._dev().capture_info(self.handle)[0] == 1  # ACTIVE only",
        (T_SB + "test_an_invalidated_capture_still_reads_as_capturing",),
    ),
    Mutant(
        "buffers: deepcopy copies on the legacy stream, unordered after the source's stream",
        "buffer.py",
        "self._alloc.device.memcpy(out.ptr, self._ptr, self._nbytes, self._stream.handle)",
        "self._alloc.device.memcpy(out.ptr, self._ptr, self._nbytes, 0)",
        (T_SB + "test_deepcopy_copies_after_the_work_queued_on_the_buffers_stream",),
    ),
    Mutant(
        "indirect: gp.alloc(n, s) reuses the previous stream's home",
        "memory.py",
        "if seen is not None and seen.stream is s:",
        "if seen is not None:",
        (T_SB + "test_alloc_on_a_stream_allocates_for_that_stream_whatever_came_before",),
    ),
    Mutant(
        "indirect: Event.record does not tell the replay checker",
        "streams.py",
        "        for listener in record_listeners:\n            listener(self, s)",
        "        for listener in ():\n            listener(self, s)",
        (T_SB + "test_a_recorded_event_orders_replays_for_the_checker",),
    ),
    Mutant(
        "indirect: the OOM retry releases the cache without waiting for the events first",
        EXPANDABLE,
        "        self._synchronize_events()\n        block = self._cached_fit(fl, size, stream)",
        "        block = self._cached_fit(fl, size, stream)",
        (
            "tests/policy/test_stream_events.py::test_out_of_memory_waits_for_the_events_before_it_releases_the_cache",
        ),
    ),
    Mutant(
        "integrations: the CuPy begin_capture hook does not register the capture",
        "cupy.py",
        '    active=lambda: (_installed or _pinned_installed) and runtime.get().name == "cuda",',
        "    active=lambda: False,",
        (T_CUPY + "test_cupys_begin_capture_registers_the_capture_with_detection_off",),
        "the hooks on CuPy's begin_capture never register the capture",
    ),
    Mutant(
        "integrations: the cached CuPy stream wrapper reused across devices",
        "cupy.py",
        "last[1] == handle and last[0] == device and",
        "last[1] == handle and",
        (
            T_CUPY + "test_the_stream_kept_from_the_last_call_is_not_reused_on_another_device",
            T_CUPY + "test_the_function_allocators_kept_stream_is_not_reused_on_another_device",
        ),
    ),
    # ----------------------------------------------------------------- the simulator
    Mutant(
        "simulator: stream_idle answers True for a capturing stream",
        SIM,
        "return st.capture is None and not st.queue",
        "return not st.queue",
        (T_FID + "test_stream_idle_is_false_for_a_capturing_stream_and_disturbs_no_capture",),
    ),
    Mutant(
        "simulator: vmm_unmap does not wait for queued work",
        SIM,
        '        capture.check_unsafe("cuMemUnmap")\n        return self._wait_uninterrupted()\n',
        '        capture.check_unsafe("cuMemUnmap")\n        return None\n',
        (T_FID + "test_vmm_unmap_waits_for_the_queued_work",),
    ),
    Mutant(
        "simulator: stream_synchronize_made waits for a capturing stream",
        SIM,
        '            if st.capture is not None or st.destroyed:\n                return False\n            capture.check_unsafe("cudaStreamSynchronize")',
        '            if st.destroyed:\n                return False\n            capture.check_unsafe("cudaStreamSynchronize")',
        (T_FID + "test_the_guarded_stream_calls_ask_only_streams_the_device_made",),
    ),
    Mutant(
        "simulator: stream_synchronize_made returns before the stream's work is done",
        SIM,
        "            self._run_until(lambda: not st.queue)\n            return True\n",
        "            return True\n",
        (T_FID + "test_the_guarded_stream_calls_ask_only_streams_the_device_made",),
    ),
    Mutant(
        "simulator: vmm_unmap given a stream does not wait for its work",
        SIM,
        "            return self._wait_uninterrupted(lambda: not st.queue)\n",
        "            return None\n",
        (T_FID + "test_vmm_unmap_given_a_stream_waits_for_it_and_spares_a_capture_elsewhere",),
    ),
    Mutant(
        "simulator: vmm_unmap given a capturing stream waits for its (empty) queue, not the device",
        SIM,
        "        if st is not None and st.capture is None and not st.destroyed:\n",
        "        if st is not None and not st.destroyed:\n",
        (T_FID + "test_vmm_unmap_given_a_capturing_stream_waits_for_the_device_which_the_capture_refuses",),
    ),
    Mutant(
        "simulator: a captured event aliases its stream's live dependencies (an unjoined fork accepted)",
        SIM,
        "_CaptureMark(cap, dict(cap.covers[stream]))",
        "_CaptureMark(cap, cap.covers[stream])",
        (T_FID + "test_a_captured_event_marks_the_capture_as_it_was_when_recorded",),
    ),
    Mutant(
        "simulator: a destroyed stream still counted as made",
        SIM,
        "            st.destroyed = True\n            self._made.discard(stream)\n",
        "            st.destroyed = True\n",
        (T_FID + "test_stream_idle_only_for_a_live_idle_stream_the_device_made",),
    ),
    Mutant(
        "simulator: stream_idle asks about any handle (the legacy stream, another's)",
        SIM,
        "            if stream not in self._made:\n                return False\n            st = self._streams[stream]\n"
        "            return st.capture is None and not st.queue",
        "            st = self._streams[stream]\n            return st.capture is None and not st.queue",
        (T_FID + "test_stream_idle_only_for_a_live_idle_stream_the_device_made",),
    ),
    Mutant(
        "simulator: free does not wait for queued work",
        SIM_MEMORY,
        "            interrupted = self._wait_uninterrupted()\n            self._mem.release(ptr)",
        "            interrupted = None\n            self._mem.release(ptr)",
        (T_FID + "test_free_waits_for_the_queued_work",),
    ),
    Mutant(
        "simulator: malloc past the memory's capacity",
        "sim/memory.py",
        "        if self.used + nbytes > self.capacity:\n            return None\n",
        "",
        (T_FID + "test_memory_is_finite",),
    ),
    Mutant(
        "simulator: vmm_map past the memory's capacity",
        "sim/memory.py",
        "        if self.used + nbytes > self.capacity:\n            return False\n",
        "",
        (T_FID + "test_memory_is_finite",),
    ),
    Mutant(
        "simulator: stream_wait_event does not order an eager stream",
        SIM,
        '            elif not state.done:\n                st.queue.append(_Op("wait", marker=state))',
        '            elif False:\n                st.queue.append(_Op("wait", marker=state))',
        (T_FID + "test_a_stream_waiting_on_an_event_runs_after_the_recorded_work",),
    ),
    Mutant(
        "simulator: a destroyed stream's queued work is dropped",
        SIM,
        "            if not st.queue:\n                del self._streams[stream]",
        "            if True:\n                del self._streams[stream]",
        (T_FID + "test_a_destroyed_streams_queued_work_still_runs",),
    ),
    Mutant(
        "simulator: an event on a busy stream is complete at once",
        SIM,
        "            if not st.queue:  # nothing pending: the marked work is already done",
        "            if True:  # nothing pending: the marked work is already done",
        (T_FID + "test_an_event_on_a_busy_stream_completes_with_its_work",),
    ),
    Mutant(
        "simulator: an event never recorded reads as pending",
        SIM,
        "            return state is None or state.done",
        "            return state is not None and state.done",
        (T_FID + "test_an_event_never_recorded_stands_for_no_work",),
    ),
    Mutant(
        "simulator: the legacy stream may capture",
        SIM,
        "            if stream == LEGACY_STREAM:\n                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorStreamCaptureUnsupported",\n'
        '                    "the legacy stream cannot be captured",',
        "            if False:\n                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorStreamCaptureUnsupported",\n'
        '                    "the legacy stream cannot be captured",',
        (T_FID + "test_the_legacy_stream_cannot_capture",),
        "`begin_capture`'s legacy-stream refusal removed",
    ),
    Mutant(
        "simulator: a capturing stream may begin a second capture",
        SIM,
        "            if st.capture is not None:\n                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorIllegalState",\n                    f"stream {stream} is already capturing",',
        "            if False:\n                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorIllegalState",\n                    f"stream {stream} is already capturing",',
        (T_FID + "test_a_stream_cannot_begin_a_second_capture",),
        "`begin_capture`'s already-capturing refusal removed",
    ),
    Mutant(
        "simulator: capture ids repeat",
        "sim/capture.py",
        "cap = Capture(next(_ids), origin, mode, threading.current_thread())",
        "cap = Capture(1, origin, mode, threading.current_thread())",
        (T_FID + "test_capture_ids_are_unique_and_shared_by_joined_streams",),
    ),
    Mutant(
        "simulator: a stream waiting on a captured event does not join the capture",
        SIM,
        "            mark.cap.join(st.handle, mark.covers)\n            st.capture = mark.cap",
        "            mark.cap.join(st.handle, mark.covers)",
        (
            T_FID + "test_capture_ids_are_unique_and_shared_by_joined_streams",
            T_FID + "test_a_stream_that_joined_a_capture_is_not_idle",
        ),
    ),
    Mutant(
        "simulator: an unjoined fork is accepted",
        SIM,
        "            unjoined = cap.unjoined()\n            if unjoined:",
        "            unjoined = cap.unjoined()\n            if False:",
        (T_FID + "test_an_unjoined_fork_fails_the_capture",),
    ),
    Mutant(
        "simulator: the legacy stream may join a capture",
        SIM,
        "        elif st.handle == LEGACY_STREAM:",
        "        elif False:",
        (T_FID + "test_the_legacy_stream_cannot_join_a_capture",),
    ),
    Mutant(
        "simulator: two captures merge",
        SIM,
        "        elif st.capture is not None:\n            capture.invalidate(st.capture)\n"
        '            raise cuda_error(\n                call,\n                "cudaErrorStreamCaptureMerge",',
        "        elif False:\n            capture.invalidate(st.capture)\n"
        '            raise cuda_error(\n                call,\n                "cudaErrorStreamCaptureMerge",',
        (T_FID + "test_two_captures_never_merge",),
        "`_wait_captured`'s merge refusal removed",
    ),
    Mutant(
        "simulator: a capture may wait on eager work",
        SIM,
        "            elif cap is not None:\n                capture.invalidate(cap)\n"
        "                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorStreamCaptureIsolation",\n'
        '                    f"stream {stream} is capturing",',
        "            elif False:\n                capture.invalidate(cap)\n"
        "                raise cuda_error(\n                    call,\n"
        '                    "cudaErrorStreamCaptureIsolation",\n'
        '                    f"stream {stream} is capturing",',
        (T_FID + "test_a_capture_never_waits_on_work_outside_it",),
        "`stream_wait_event`'s isolation refusal removed",
    ),
    Mutant(
        "simulator: a joined stream may end the capture",
        SIM,
        "if cap is None or cap.origin != stream:",
        "if cap is None:",
        (T_FID + "test_only_the_stream_that_began_a_capture_ends_it",),
    ),
    Mutant(
        "simulator: any thread may end a global or thread-local capture",
        SIM,
        "wrong_thread = cap.mode != CAPTURE_MODE_RELAXED and cap.thread is not threading.current_thread()",
        "wrong_thread = False",
        (T_FID + "test_only_the_capturing_thread_ends_a_capture_unless_relaxed",),
    ),
    Mutant(
        "simulator: a global capture does not refuse other threads' unsafe calls",
        "sim/capture.py",
        "            or (mode == CAPTURE_MODE_GLOBAL and cap.thread is not me and cap.mode == CAPTURE_MODE_GLOBAL)\n",
        "",
        (T_FID + "test_another_threads_unsafe_call_is_refused_only_by_a_global_capture",),
    ),
    Mutant(
        "simulator: a thread-local capture refuses other threads' unsafe calls",
        "sim/capture.py",
        "cap.thread is not me and cap.mode == CAPTURE_MODE_GLOBAL)",
        "cap.thread is not me and cap.mode != CAPTURE_MODE_RELAXED)",
        (T_FID + "test_another_threads_unsafe_call_is_refused_only_by_a_global_capture",),
    ),
    Mutant(
        "simulator: a thread in relaxed mode is refused",
        "sim/capture.py",
        "    if mode == CAPTURE_MODE_RELAXED or not _ongoing:",
        "    if not _ongoing:",
        (T_FID + "test_a_thread_in_relaxed_mode_may_make_unsafe_calls",),
    ),
    Mutant(
        "simulator: the capturing thread's own unsafe calls allowed",
        "sim/capture.py",
        "            if (cap.thread is me and cap.mode != CAPTURE_MODE_RELAXED)",
        "            if (False)",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: malloc during a capture allowed",
        SIM_MEMORY,
        '            capture.check_unsafe("cudaMalloc")\n',
        "",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: free during a capture allowed",
        SIM_MEMORY,
        '            capture.check_unsafe("cudaFree")\n',
        "",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: an event query during a capture allowed",
        SIM,
        '            capture.check_unsafe("cudaEventQuery")\n',
        "",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: an event synchronize during a capture allowed",
        SIM,
        '            capture.check_unsafe("cudaEventSynchronize")\n',
        "",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: a stream synchronize during a capture allowed",
        SIM,
        '            self._refuse_if_capturing("cudaStreamSynchronize", st)\n'
        '            capture.check_unsafe("cudaStreamSynchronize")\n            self._run_until(lambda: not st.queue)',
        '            self._refuse_if_capturing("cudaStreamSynchronize", st)\n'
        "            self._run_until(lambda: not st.queue)",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: a device synchronize during a capture allowed",
        SIM,
        '            capture.check_unsafe("cudaDeviceSynchronize")\n',
        "",
        (
            T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",
            T_FID + "test_capture_rules_are_process_wide",
        ),
    ),
    Mutant(
        "simulator: synchronizing the capturing stream itself allowed (relaxed thread)",
        SIM,
        '            self._refuse_if_capturing("cudaStreamSynchronize", st)\n',
        "",
        (T_FID + "test_synchronizing_the_capturing_stream_is_illegal_in_every_mode",),
    ),
    Mutant(
        "simulator: instantiation during a global capture allowed",
        SIM,
        '            capture.check_unsafe("cudaGraphInstantiate")',
        "            pass",
        (T_FID + "test_instantiating_during_a_global_capture_is_refused",),
    ),
    Mutant(
        "simulator: an event recorded in a capture may be queried",
        SIM,
        "            if isinstance(state, _CaptureMark):\n"
        "                # CUDA 13 on the H200: refused as a captured event, and a capture still underway is\n"
        "                # lost; once an invalidated capture has ended, an invalid value\n"
        "                cap = state.cap\n"
        "                if cap.status == CAPTURE_STATUS_ACTIVE and cap in capture.ongoing():\n"
        "                    capture.invalidate(cap)\n"
        "                elif cap.ended and cap.status == CAPTURE_STATUS_INVALIDATED:\n"
        '                    raise cuda_error("cudaEventQuery", "cudaErrorInvalidValue", "its capture failed")\n'
        '                raise cuda_error("cudaEventQuery", "cudaErrorCapturedEvent")\n'
        "            return state is None or state.done",
        "            if isinstance(state, _CaptureMark):\n                return True\n            return state is None or state.done",
        (T_FID + "test_an_event_recorded_in_a_capture_cannot_be_queried",),
        label="query_event's refusal of a captured event removed",
    ),
    Mutant(
        "simulator: an invalidated capture reads as not capturing",
        SIM,
        "            if cap is None:\n                return CAPTURE_STATUS_NONE, 0\n            return cap.status, cap.id",
        "            if cap is None or cap.status == CAPTURE_STATUS_INVALIDATED:\n"
        "                return CAPTURE_STATUS_NONE, 0\n            return cap.status, cap.id",
        (T_FID + "test_an_unsafe_call_in_a_global_capture_fails_and_invalidates_it",),
        "`capture_info` answers none for an invalidated capture",
    ),
    Mutant(
        "simulator: an invalidated capture ends with a graph",
        SIM,
        "            if cap.status == CAPTURE_STATUS_INVALIDATED:\n                self._drop(tokens)",
        "            if False:\n                self._drop(tokens)",
        (T_FID + "test_a_failed_capture_releases_its_token_at_its_end",),
    ),
    Mutant(
        "simulator: a graph launched into a capture is taken",
        SIM,
        "            self._refuse_if_capturing(call, st)  # CUDA refuses a graph launch into a capture\n",
        "",
        (T_FID + "test_a_graph_cannot_be_launched_into_a_capture",),
    ),
    Mutant(
        "simulator: device_synchronize allowed during a capture in relaxed mode",
        SIM,
        '            self._refuse_if_device_capturing("cudaDeviceSynchronize")\n            capture.check_unsafe("cudaDeviceSynchronize")',
        '            capture.check_unsafe("cudaDeviceSynchronize")',
        (T_FID + "test_synchronizing_the_device_fails_in_every_mode_while_a_stream_captures",),
    ),
    Mutant(
        "simulator: querying a captured event leaves the capture valid",
        SIM,
        "                    capture.invalidate(cap)\n                elif cap.ended",
        "                    pass\n                elif cap.ended",
        (T_FID + "test_an_event_recorded_in_a_capture_cannot_be_queried",),
    ),
    Mutant(
        "simulator: synchronizing a captured event leaves the capture valid",
        SIM,
        '                    capture.invalidate(state.cap)\n                    raise cuda_error("cudaEventSynchronize"',
        '                    pass\n                    raise cuda_error("cudaEventSynchronize"',
        (T_FID + "test_synchronizing_an_event_recorded_in_a_capture_fails_and_invalidates_it",),
    ),
    Mutant(
        "simulator: an executable holds no user object",
        SIM,
        "            self._retain(handle, self._holders.get(graph, ()))\n",
        "",
        (T_FID + "test_a_token_is_released_once_the_graph_and_every_instance_are_gone",),
    ),
    Mutant(
        "simulator: a failed capture keeps its user objects",
        SIM,
        "                self._drop(tokens)  # the graph is discarded: its user objects go with it\n",
        "",
        (T_FID + "test_a_failed_capture_releases_its_token_at_its_end",),
    ),
    Mutant(
        "simulator: attach_release on a stream that is not capturing",
        SIM,
        "            if cap is None or cap.status != CAPTURE_STATUS_ACTIVE:\n"
        '                raise cuda_error(call, "cudaErrorIllegalState", f"stream {stream} is not capturing")\n'
        "            cap.tokens.append(token)",
        "            if cap is not None:\n                cap.tokens.append(token)",
        (T_FID + "test_attach_release_needs_a_capturing_stream",),
    ),
    Mutant(
        "simulator: launches of one executable on two streams overlap",
        SIM,
        '            if prev is not None and not prev.done:\n                st.queue.append(_Op("wait", marker=prev))',
        '            if False:\n                st.queue.append(_Op("wait", marker=prev))',
        (T_FID + "test_launches_of_one_executable_run_in_launch_order_on_any_stream",),
    ),
    Mutant(
        "simulator: a host-to-device copy on the capturing stream allowed",
        SIM,
        '            self._refuse_if_capturing(\n                "cudaMemcpyAsync(HostToDevice)", self._stream("cudaMemcpyAsync", stream)\n            )\n',
        "",
        (T_FID + "test_a_host_copy_on_the_capturing_stream_is_refused",),
    ),
    Mutant(
        "simulator: a device-to-host copy on the capturing stream allowed",
        SIM,
        '            self._refuse_if_capturing("cudaMemcpy(DeviceToHost)", st)\n',
        "",
        (T_FID + "test_a_host_copy_on_the_capturing_stream_is_refused",),
    ),
)


# Stop 19 (issue 27): the CuPy C path's Python side (hooks.give_back, CupyHooks, lanes,
# cupy._c_allocator) and the replay checker's plans (graphs.py). Each runs its files whole.
HOOKS = "hooks.py"
LANES = "lanes.py"
CUPY = "cupy.py"
GRAPHS = "graphs.py"
T19_HOOKS = (
    "tests/test_twin_cupy.py",
    "tests/test_torch_lane.py",
    "tests/test_twin_cupy_capture.py",
    "tests/test_twin_cupy_pinned.py",
)
T19_GRAPHS = (
    "tests/property/test_checker_differential.py",
    "tests/scenarios/test_replay_plans.py",
    "tests/scenarios/test_replay_checker.py",
)
_S19 = "stop 19: "
STOP19 = (
    Mutant(
        _S19 + "give_back parks any freed block",
        HOOKS,
        "    if ptr == recent:\n",
        "    if True:\n",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "give_back: the last route's allocator unchecked",
        HOOKS,
        "last is not None and last.route.alloc is a and last",
        "last is not None and last",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "give_back: the last route's generation unchecked",
        HOOKS,
        "and last.route.generation == _routes.generation:\n            return a.park(ptr)",
        ":\n            return a.park(ptr)",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "give_back: never queued behind a parked block",
        HOOKS,
        "    if a.parking():\n        return a.park(ptr, False)",
        "    if False:\n        return a.park(ptr, False)",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "give_back: a non-recent block parked",
        HOOKS,
        "return a.park(ptr, False)  # queued",
        "return a.park(ptr)  # queued",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "malloc_on: the last stream unchecked",
        HOOKS,
        "if last is not None and last.raw == raw and last.device == device",
        "if last is not None and last.device == device",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "malloc_on: the last device unchecked",
        HOOKS,
        "last.raw == raw and last.device == device and size != 0",
        "last.raw == raw and size != 0",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "malloc_on: size 0 on the fast path",
        HOOKS,
        "last.raw == raw and last.device == device and size != 0",
        "last.raw == raw and last.device == device",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "malloc_on: the generation unchecked",
        HOOKS,
        "            if route.generation == _routes.generation:\n                ptr = route.alloc.malloc(size, stream=route.handle)\n                self._recent = ptr\n                return ptr\n        return self._miss",
        "            if True:\n                ptr = route.alloc.malloc(size, stream=route.handle)\n                self._recent = ptr\n                return ptr\n        return self._miss",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "malloc_on: the fast path's hand-out not noted",
        HOOKS,
        "                self._recent = ptr\n                return ptr\n        return self._miss",
        "                return ptr\n        return self._miss",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: a new allocator never bound",
        HOOKS,
        "        if old is not a:\n",
        "        if False:\n",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: a retired allocator listed again",
        HOOKS,
        "if old is not None and old not in self._retired:",
        "if old is not None:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: the replaced allocator not retired",
        HOOKS,
        "if old is not None and old not in self._retired:",
        "if False:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: no bind",
        HOOKS,
        "            if self._bind is not None:\n                self._bind(device, a)",
        "            pass",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: the hand-out not noted",
        HOOKS,
        "        self._recent = ptr\n        return ptr\n\n    def free",
        "        return ptr\n\n    def free",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_miss: size 0 to the allocator",
        HOOKS,
        "        if size == 0:\n            return 0\n        ptr = a.malloc",
        "        ptr = a.malloc",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "CupyHooks.free: a retired allocator's free block taken",
        HOOKS,
        "if block is not None and block.allocated:\n                    old.free_owned",
        "if block is not None:\n                    old.free_owned",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "CupyHooks.free: retired allocators never asked",
        HOOKS,
        "        if self._retired:\n",
        "        if False:\n",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "CupyHooks.free: never parks",
        HOOKS,
        'by graphpool")\n        return give_back(a, ptr, self._recent, self._last)',
        'by graphpool")\n        return give_back(a, ptr, 0, self._last)',
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "lanes.enabled: either variable suffices",
        LANES,
        '!= "0" and os.environ.get("GRAPHPOOL_TORCH_LANE"',
        '!= "0" or os.environ.get("GRAPHPOOL_TORCH_LANE"',
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "lanes.binder: lanes left enabled when turned off",
        LANES,
        "        mod.set_lanes_enabled(False)\n",
        "",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "lanes.binder: a stand-in shim without lanes used",
        LANES,
        'if not hasattr(mod, "lane_take"):',
        "if False:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "lanes.bind: the same allocator bound again",
        LANES,
        "            if old is a:\n                return\n",
        "",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "lanes.bind: the previous allocator not settled",
        LANES,
        "                old.set_lane(None)  # settles",
        "                pass  # settles",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: no capsule not refused",
        CUPY,
        "    if capsule is None:\n        return None\n    try:\n        shim = lanes",
        "    try:\n        shim = lanes",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: a shim without set_cupy_hooks",
        CUPY,
        'if not hasattr(shim, "set_cupy_hooks"):',
        "if False:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: new hooks at each install",
        CUPY,
        "    hooks = _c_hooks\n    if hooks is None:",
        "    hooks = None\n    if hooks is None:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: a refused capsule raises",
        CUPY,
        "    except TypeError:  # CuPy's stream function",
        "    except ValueError:  # CuPy's stream function",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: CuPy without CFunctionAllocator",
        CUPY,
        "    if cfa is None:\n        return None",
        "    if cfa is None:\n        pass",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_c_allocator: cuda.stream not imported",
        CUPY,
        "    if not isinstance(stream_module, types.ModuleType):",
        "    if False:",
        T19_HOOKS,
    ),
    Mutant(
        _S19 + "_extent: a footprint kept across a reset",
        GRAPHS,
        "if kept is not None and kept[0] is rec:",
        "if kept is not None:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_extent: touching ranges merged",
        GRAPHS,
        "if ends and ptr < ends[-1]:",
        "if ends and ptr <= ends[-1]:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_extent: a contained range shortens its merge",
        GRAPHS,
        "            if end > ends[-1]:\n                ends[-1] = end",
        "            ends[-1] = end",
        T19_GRAPHS,
    ),
    Mutant(_S19 + "_extent: not kept", GRAPHS, "    g._extent = (rec, (starts, ends))\n", "", T19_GRAPHS),
    Mutant(
        _S19 + "_meets: a range ending at ptr meets",
        GRAPHS,
        "bisect.bisect_right(ends, ptr)",
        "bisect.bisect_left(ends, ptr)",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_meets: a range starting at the end meets",
        GRAPHS,
        "starts[i] < ptr + size",
        "starts[i] <= ptr + size",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: the graph its own mate",
        GRAPHS,
        "if (h := r()) is not None and h is not g and",
        "if (h := r()) is not None and",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: a mate's every meeting range listed",
        GRAPHS,
        "                plan.meets.append((r, hit[0], hit[1]))\n                break",
        "                plan.meets.append((r, hit[0], hit[1]))",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: outputs handed out again kept",
        GRAPHS,
        "if block.serial == serial and _meets(mine, block.ptr, block.size)",
        "if _meets(mine, block.ptr, block.size)",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: outputs outside the footprint kept",
        GRAPHS,
        "if block.serial == serial and _meets(mine, block.ptr, block.size)",
        "if block.serial == serial",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: the producer among the writers",
        GRAPHS,
        "if r is not prod and _meets(_extent(h), ptr, size)",
        "if _meets(_extent(h), ptr, size)",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: every mate a writer",
        GRAPHS,
        "if r is not prod and _meets(_extent(h), ptr, size)",
        "if r is not prod",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: quiet without clobbers",
        GRAPHS,
        "not (plan.meets or plan.inputs or plan.clobbers)",
        "not (plan.meets or plan.inputs)",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_plan: quiet without inputs",
        GRAPHS,
        "not (plan.meets or plan.inputs or plan.clobbers)",
        "not (plan.meets or plan.clobbers)",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_check_replay: a stale plan used",
        GRAPHS,
        "if plan is None or mates is None or plan.version != mates.version:",
        "if plan is None or mates is None:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_check_replay: catch up on the same stream",
        GRAPHS,
        "if h is not None and h._event_stale and h._last_stream is not s:",
        "if h is not None and h._event_stale:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_check_replay: no catching up",
        GRAPHS,
        "if h is not None and h._event_stale and h._last_stream is not s:",
        "if False:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_check_replay: a quiet plan checked",
        GRAPHS,
        "    if plan.quiet:\n        return\n",
        "",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "check 2: a writer replayed with the producer",
        GRAPHS,
        "h._last_tick > prod._last_tick:",
        "h._last_tick >= prod._last_tick:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "check 3: a mate replayed at the same tick",
        GRAPHS,
        "if h is None or h._last_tick <= tick:",
        "if h is None or h._last_tick < tick:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_catch_up: a stream of another library caught up",
        GRAPHS,
        "if hs is not None and hs != s and hs._source is None:",
        "if hs is not None and hs != s:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_catch_up: same stream caught up",
        GRAPHS,
        "if hs is not None and hs != s and hs._source is None:",
        "if hs is not None and hs._source is None:",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_catch_up: the pool never marked as on two streams",
        GRAPHS,
        "        if key not in _streams_of:\n            with _checks_lock:\n                _streams_of.add(key)\n",
        "",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "gone: a collected mate leaves the version",
        GRAPHS,
        "                del mates[ident]\n                mates.version = next(_versions)\n",
        "                del mates[ident]\n",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_register: a new mate leaves the version",
        GRAPHS,
        "        mates[ident] = weakref.ref(g, gone)\n        mates.version = next(_versions)\n",
        "        mates[ident] = weakref.ref(g, gone)\n",
        T19_GRAPHS,
    ),
    Mutant(
        _S19 + "_unregister: the plan kept", GRAPHS, "        g._plan = g._extent = None\n", "", T19_GRAPHS
    ),
    Mutant(
        _S19 + "_unregister: a leaving mate leaves the version",
        GRAPHS,
        "                del mates[id(g)]\n                mates.version = next(_versions)\n",
        "                del mates[id(g)]\n",
        T19_GRAPHS,
    ),
)
MUTANTS = (*MUTANTS, *STOP19)


# Stop 21, a second review of the out-of-memory retry beside an unseen capture (and of the
# collection of garbage_collection_threshold, which also runs inside an allocation).
T_UNMAP = "tests/test_cuda_unmap_wait.py::"
_R21 = "stop 21 review: "
STOP21_REVIEW = (
    Mutant(
        _R21 + "the retry unmaps legacy/other libraries' memory while a known stream captures",
        EXPANDABLE,
        "            if answer is None or bool(answer):  # not the device's, or capturing\n",
        "            if answer is not None and bool(answer):  # not the device's, or capturing\n",
        (T_EXP + "test_the_out_of_memory_retry_spares_a_known_capture_when_it_frees_legacy_stream_memory",),
    ),
    Mutant(
        _R21 + "only the streams of free blocks are asked whether they capture",
        EXPANDABLE,
        "        if not free or not bool(device.made_streams_capturing()):\n",
        "        if not free or not any(s != LEGACY and device.stream_capturing(s) for s in free):\n",
        (T_EXP + "test_the_out_of_memory_retry_spares_a_known_capture_when_it_frees_legacy_stream_memory",),
    ),
    Mutant(
        _R21 + "the retry keeps legacy memory with no capture underway",
        EXPANDABLE,
        "        if not free or not bool(device.made_streams_capturing()):\n            return frozenset()\n",
        "",
        (T_EXP + "test_the_out_of_memory_retry_gives_back_legacy_stream_memory_with_no_capture",),
    ),
    Mutant(
        _R21 + "the retry gives a taken block home to a destroyed or capturing segment stream",
        EXPANDABLE,
        "                        if not home_ok:\n                            break\n",
        "",
        (
            T_EXP
            + "test_the_out_of_memory_retry_leaves_a_taken_block_with_its_taker_when_home_cannot_be_waited_for",
        ),
    ),
    Mutant(
        _R21 + "the collection keeps no capturing stream's segment",
        SEGMENTS,
        "        keep = self._capturing_streams() if self._exp else frozenset()\n",
        "        keep: frozenset[int] = frozenset()\n",
        (
            T_EXP
            + "test_garbage_collection_in_an_allocation_leaves_the_free_memory_of_a_stream_capturing_unseen",
        ),
    ),
    Mutant(
        _R21 + "CUDA: stream_synchronize_made waits after releasing the made-streams lock",
        "device/cuda.py",
        '                return False\n            _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(stream)[0])\n'
        "            return True\n",
        '                return False\n        _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(stream)[0])\n'
        "        return True\n",
        (T_UNMAP + "test_the_wait_holds_the_made_streams_lock_throughout",),
        "cudaStreamSynchronize dedented out of `with self._made_lock:`",
    ),
    Mutant(
        _R21 + "CUDA: stream_capturing queries after releasing the made-streams lock",
        "device/cuda.py",
        "                return None\n            return bool(self.capture_id(stream))\n",
        "                return None\n        return bool(self.capture_id(stream))\n",
        (T_UNMAP + "test_the_capture_query_holds_the_made_streams_lock",),
        "the capture query dedented out of `with self._made_lock:`",
    ),
    Mutant(
        _R21 + "simulator: stream_capturing answers for a destroyed stream it still tracks",
        SIM,
        "            if stream not in self._made:\n                return None\n            return self._streams[stream].capture is not None\n",
        "            st = self._streams.get(stream)\n            if st is None or stream == LEGACY_STREAM:\n"
        "                return None\n            return st.capture is not None\n",
        (T_FID + "test_the_guarded_stream_calls_ask_only_streams_the_device_made",),
    ),
)
MUTANTS = (*MUTANTS, *STOP21_REVIEW)

T_CORE = "tests/test_twin_numba_cuda_core.py::"
_S22 = "stop 22: "
STOP22 = (
    Mutant(
        _S22 + "cuda.core: a close on another stream goes back at once, without waiting for that stream",
        "hooks.py",
        "            if handle != route.handle:\n                route.alloc.defer_free(ptr, handle)\n",
        "            if False:\n                route.alloc.defer_free(ptr, handle)\n",
        (T_CORE + "test_deallocate_on_another_stream_orders_reuse",),
    ),
    Mutant(
        _S22 + "cuda.core: a close on the per-thread default stream is taken for a stream of its own",
        "hooks.py",
        "            if handle == CU_STREAM_LEGACY or handle == CU_STREAM_PER_THREAD:\n",
        "            if handle == CU_STREAM_LEGACY:\n",
        (T_CORE + "test_deallocate_on_the_per_thread_default_stream_waits_for_the_legacy_stream",),
    ),
    Mutant(
        _S22 + "cuda.core: the kept route outlives a set_backend",
        "hooks.py",
        "        if last is not None and last.raw == raw and last.route.generation == _routes.generation:\n"
        "            route = last.route\n        else:  # raises: a refused stream or backend\n",
        "        if last is not None and last.raw == raw:\n"
        "            route = last.route\n        else:  # raises: a refused stream or backend\n",
        (T_CORE + "test_a_closed_buffer_is_reused_on_its_stream_and_the_route_follows_the_stream",),
    ),
    Mutant(
        _S22 + "cuda.core: the protocol's fast path takes any version",
        "hooks.py",
        "        if type(version) is int and version == 0 and type(handle) is int and handle >= 0:\n",
        "        if type(handle) is int and handle >= 0:\n",
        (T_CORE + "test_a_close_on_a_stream_that_cannot_be_read_loses_nothing",),
    ),
    Mutant(
        _S22 + "cuda.core: a buffer whose creation failed keeps its block",
        "hooks.py",
        "        route = self.blocks.pop(ptr, None)\n        if route is not None:\n            route.alloc.drop(ptr)\n",
        "        route = self.blocks.get(ptr)\n",
        (T_CORE + "test_a_buffer_that_cannot_be_made_gives_its_block_back",),
        "forget leaves the block out",
    ),
)
STOP22 = (
    *STOP22,
    Mutant(
        _S22 + "cuda.core: a graphpool Stream of another device is taken",
        "hooks.py",
        "            if stream.device != self._device:\n",
        "            if False:\n",
        (T_CORE + "test_a_graphpool_stream_of_another_device_is_refused",),
    ),
    Mutant(
        _S22 + "cuda.core: a null buffer's close frees address 0",
        "hooks.py",
        "        if address == 0:  # a null buffer holds nothing\n            return\n",
        "",
        (T_CORE + "test_zero_bytes_are_a_null_buffer_of_this_resource",),
    ),
)
MUTANTS = (*MUTANTS, *STOP22)


def run(tests: tuple[str, ...]) -> bool:
    """Whether ``tests`` pass."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest could not run {tests}: rc {done.returncode}\n{done.stdout[-2000:]}")
    return done.returncode == 0


def main(selector: str = "") -> int:
    rows = ["| behaviour | test(s) | mutant | killed |", "| --- | --- | --- | --- |"]
    bad = 0
    for m in MUTANTS:
        if selector and selector not in m.behaviour:
            continue
        path = ROOT / "src" / "graphpool" / m.file
        original = path.read_bytes()
        text = original.decode()
        if text.count(m.old) != 1:
            found = text.count(m.old)
            raise RuntimeError(f"{m.behaviour}: the mutant's text occurs {found} times in {m.file}")
        if not run(m.tests):
            raise RuntimeError(f"{m.behaviour}: the tests fail on the unmutated source")
        try:
            path.write_text(text.replace(m.old, m.new))
            killed = not run(m.tests)
        finally:
            path.write_bytes(original)
        if not run(m.tests):
            raise RuntimeError(f"{m.behaviour}: the tests fail after the source was restored")
        bad += not killed
        names = "<br>".join(f"`{t.rsplit('::', 1)[-1]}`" for t in m.tests)
        edit = f"{m.file}: " + (m.label or f"`{_one_line(m.old)}` -> `{_one_line(m.new)}`")
        rows.append(f"| {m.behaviour} | {names} | {edit} | {'yes' if killed else '**no**'} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 1 if bad else 0


def _one_line(code: str) -> str:
    return " ".join(code.split()).replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
