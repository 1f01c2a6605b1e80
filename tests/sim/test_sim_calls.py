"""The simulator's errors read as CUDA's: each call names itself (``CUDAError.call``), the
error and its detail, as a program run on a GPU would see them."""

from __future__ import annotations

import threading

import pytest

from graphpool.device.protocol import CAPTURE_MODE_GLOBAL, CAPTURE_MODE_RELAXED
from graphpool.errors import CUDAError
from graphpool.sim import SimBackend, SimDevice

BAD = 0xDEAD


def refused(fn: object, *args: object) -> CUDAError:
    with pytest.raises(CUDAError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda d: d.memcpy(0, 0, 8, BAD), "cudaMemcpyAsync"),
        (lambda d: d.memcpy_host(0, 0, 8, BAD), "cudaMemcpyAsync"),
        (lambda d: d.memset(0, 0, 8, BAD), "cudaMemsetAsync"),
        (lambda d: d.launch_sleep(BAD), "cudaLaunchKernel"),
        (lambda d: d.destroy_event(BAD), "cudaEventDestroy"),
        (lambda d: d.destroy_stream(BAD), "cudaStreamDestroy"),
        (lambda d: d.destroy_stream(0), "cudaStreamDestroy"),  # the legacy stream
        (lambda d: d.launch(BAD, 0), "cudaGraphLaunch"),
        (lambda d: d.ipc_close(BAD), "cudaIpcCloseMemHandle"),
        (lambda d: d.host_malloc(0), "cudaHostAlloc"),
    ],
)
def test_each_call_names_itself_in_its_error(dev: SimDevice, call: object, expected: str) -> None:
    assert refused(call, dev).call == expected


def test_a_launch_on_a_bad_stream_names_the_launch(dev: SimDevice) -> None:
    s = dev.create_stream()
    dev.begin_capture(s, CAPTURE_MODE_GLOBAL)
    dev.launch_sleep(s, 1)
    exe = dev.instantiate(dev.end_capture(s))
    assert refused(dev.launch, exe, BAD).call == "cudaGraphLaunch"


def test_the_details_of_bad_host_sizes_and_ipc_handles(dev: SimDevice) -> None:
    assert refused(dev.host_malloc, 0).meaning == "invalid argument (size 0)"
    for handle in (b"\xff" * 64, b"short", "not bytes"):  # undecodable, wrong size, wrong type
        err = refused(dev.ipc_open, handle)
        assert (err.call, err.name) == ("cudaIpcOpenMemHandle", "cudaErrorInvalidValue")


def test_host_memory_info_is_free_then_total(dev: SimDevice) -> None:
    free, total = dev.host_mem_info()
    ptr = dev.host_malloc(4096)
    assert ptr is not None
    now_free, now_total = dev.host_mem_info()
    assert now_total == total and now_free < free and free - now_free >= 4096
    dev.host_free(ptr)


def test_a_view_reaches_the_last_byte_of_an_allocation(dev: SimDevice) -> None:
    ptr = dev.malloc(4096)
    assert ptr is not None
    dev.view(ptr + 4095, 1)[:] = 7
    assert bytes(dev.view(ptr + 4095, 1)) == b"\x07"
    dev.free(ptr)


def test_captured_event_errors_name_their_call(dev: SimDevice) -> None:
    s, other = dev.create_stream(), dev.create_stream()
    e = dev.create_event()
    dev.begin_capture(s, CAPTURE_MODE_RELAXED)
    dev.record_event(e, s)
    err = refused(dev.event_synchronize, e)  # during the capture: refused, the capture is lost
    assert (err.call, err.name) == ("cudaEventSynchronize", "cudaErrorCapturedEvent")
    with pytest.raises(CUDAError):
        dev.end_capture(s)
    err = refused(dev.query_event, e)  # the capture ended invalidated: an invalid value
    assert (err.call, err.name, err.meaning) == (
        "cudaEventQuery",
        "cudaErrorInvalidValue",
        "invalid argument (its capture failed)",
    )
    err = refused(dev.event_synchronize, e)
    assert (err.call, err.meaning) == ("cudaEventSynchronize", "invalid argument (a captured event)")
    dev.begin_capture(s, CAPTURE_MODE_RELAXED)
    dev.record_event(e, s)
    err = refused(dev.query_event, e)
    assert (err.call, err.name) == ("cudaEventQuery", "cudaErrorCapturedEvent")
    with pytest.raises(CUDAError):
        dev.end_capture(s)
    a = dev.create_event()
    dev.begin_capture(s, CAPTURE_MODE_RELAXED)
    dev.begin_capture(other, CAPTURE_MODE_RELAXED)
    dev.record_event(a, s)
    err = refused(dev.stream_wait_event, other, a)  # a stream of another capture
    assert (err.call, err.name) == ("cudaStreamWaitEvent", "cudaErrorStreamCaptureMerge")
    with pytest.raises(CUDAError):
        dev.end_capture(other)  # invalidated by the merge
    dev.destroy_graph(dev.end_capture(s))


def test_host_released_tokens_are_taken_once(dev: SimDevice) -> None:
    s = dev.create_stream()
    dev.begin_capture(s, CAPTURE_MODE_GLOBAL)
    dev.launch_sleep(s, 1)
    dev.attach_host_release(s, 41)
    graph = dev.end_capture(s)
    dev.destroy_graph(graph)
    assert dev.take_host_released() == [41]
    assert dev.take_host_released() == []


def test_the_backend_says_its_size_and_a_new_thread_starts_on_device_0() -> None:
    b = SimBackend(device_count=2, memory_bytes=32 * 1024 * 1024)
    assert repr(b) == "SimBackend(device_count=2, memory_bytes=33554432)"
    b.set_current_device(1)
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(b.current_device()))
    t.start()
    t.join()
    assert seen == [0] and b.current_device() == 1


def test_graph_calls_name_themselves_and_say_what_is_wrong(dev: SimDevice) -> None:
    assert refused(dev.destroy_graph, BAD).call == "cudaGraphDestroy"
    err = refused(dev.destroy_event, BAD)
    assert (err.name, err.meaning) == (
        "cudaErrorInvalidResourceHandle",
        f"invalid resource handle (event {BAD})",
    )
    s = dev.create_stream()
    err = refused(dev.end_capture, s)
    assert (err.call, err.name, err.meaning) == (
        "cudaStreamEndCapture",
        "cudaErrorIllegalState",
        f"the operation cannot be performed in the present state (stream {s} did not begin a capture)",
    )
    assert refused(dev.vmm_reserve, 0).call == "cuMemAddressReserve"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda d, g, va: d.instantiate(g), "cudaGraphInstantiate"),
        (lambda d, g, va: d.vmm_map(va, 2 * 1024 * 1024), "cuMemMap"),
        (lambda d, g, va: d.vmm_unmap(va, 2 * 1024 * 1024), "cuMemUnmap"),
    ],
)
def test_calls_unsafe_in_a_global_capture_name_themselves(
    backend: SimBackend, call: object, expected: str
) -> None:
    """This thread captures in global mode on another device: the call is refused by name."""
    dev, other = backend.get_device(0), backend.get_device(1)
    s, t = dev.create_stream(), other.create_stream()
    dev.begin_capture(s, CAPTURE_MODE_GLOBAL)
    dev.launch_sleep(s, 1)
    graph = dev.end_capture(s)
    va = dev.vmm_reserve(2 * 1024 * 1024)
    assert dev.vmm_map(va, 2 * 1024 * 1024)
    other.begin_capture(t, CAPTURE_MODE_GLOBAL)
    err = refused(call, dev, graph, va)
    assert (err.call, err.name) == (expected, "cudaErrorStreamCaptureUnsupported")
    with pytest.raises(CUDAError):
        other.end_capture(t)  # invalidated by the refused call
    dev.destroy_graph(graph)
    if dev.reservations()[0][2]:
        dev.vmm_unmap(va, 2 * 1024 * 1024)
    dev.vmm_release(va, 2 * 1024 * 1024)


def test_a_token_attached_twice_is_released_with_its_last_graph(dev: SimDevice) -> None:
    s = dev.create_stream()
    graphs = []
    for _ in range(2):
        dev.begin_capture(s, CAPTURE_MODE_GLOBAL)
        dev.launch_sleep(s, 1)
        dev.attach_release(s, 77)
        graphs.append(dev.end_capture(s))
    dev.destroy_graph(graphs[0])
    assert 77 not in dev.take_released()
    dev.destroy_graph(graphs[1])
    assert dev.take_released() == [77]


def test_managed_memory_calls_name_themselves(backend: SimBackend) -> None:
    dev, other = backend.get_device(0), backend.get_device(1)
    err = refused(dev.malloc_managed, 0)
    assert (err.call, err.name, err.meaning) == (
        "cudaMallocManaged",
        "cudaErrorInvalidValue",
        "invalid argument (size 0)",
    )
    ptr = dev.malloc_managed(4096)
    assert ptr is not None
    err = refused(dev.host_view, ptr + 4000, 200)  # past the allocation
    assert (err.call, err.name) == ("host_view", "cudaErrorIllegalAddress")
    t = other.create_stream()
    other.begin_capture(t, CAPTURE_MODE_GLOBAL)  # unsafe in a global capture of this thread
    err = refused(dev.malloc_managed, 4096)
    assert (err.call, err.name) == ("cudaMallocManaged", "cudaErrorStreamCaptureUnsupported")
    with pytest.raises(CUDAError):
        other.end_capture(t)
    dev.free(ptr)


def test_the_legacy_stream_and_an_ended_captures_event_are_refused_with_why(dev: SimDevice) -> None:
    err = refused(dev.destroy_stream, 0)
    assert err.meaning == "invalid resource handle (legacy stream)"
    s, other = dev.create_stream(), dev.create_stream()
    e = dev.create_event()
    dev.begin_capture(s, CAPTURE_MODE_GLOBAL)
    dev.record_event(e, s)
    dev.destroy_graph(dev.end_capture(s))
    err = refused(dev.stream_wait_event, other, e)  # its capture has ended
    assert (err.call, err.name, err.meaning) == (
        "cudaStreamWaitEvent",
        "cudaErrorCapturedEvent",
        "operation not permitted on an event last recorded in a capturing stream (its capture has ended)",
    )


def test_a_host_copy_on_a_capturing_stream_names_its_direction(dev: SimDevice) -> None:
    ptr = dev.malloc(64)
    assert ptr is not None
    s = dev.create_stream()
    dev.begin_capture(s, CAPTURE_MODE_RELAXED)
    err = refused(dev.read, ptr, 64, s)
    assert (err.call, err.name) == ("cudaMemcpy(DeviceToHost)", "cudaErrorStreamCaptureUnsupported")
    with pytest.raises(CUDAError):
        dev.end_capture(s)
    dev.free(ptr)


def test_a_user_object_for_a_stream_not_capturing_is_refused_by_name(dev: SimDevice) -> None:
    err = refused(dev.attach_release, dev.create_stream(), 5)
    assert (err.call, err.name) == ("cuGraphRetainUserObject", "cudaErrorIllegalState")


def test_the_legacy_stream_cannot_join_a_capture(dev: SimDevice) -> None:
    s = dev.create_stream()
    e = dev.create_event()
    dev.begin_capture(s, CAPTURE_MODE_RELAXED)
    dev.record_event(e, s)
    err = refused(dev.stream_wait_event, 0, e)
    assert (err.call, err.name) == ("cudaStreamWaitEvent", "cudaErrorStreamCaptureUnsupported")
    assert err.meaning.endswith("(the legacy stream cannot join a capture)")
    with pytest.raises(CUDAError):
        dev.end_capture(s)  # invalidated


def test_a_host_allocation_viewed_past_its_end_is_refused_by_host_view(dev: SimDevice) -> None:
    ptr = dev.host_malloc(4096)
    assert ptr is not None
    err = refused(dev.host_view, ptr + 4000, 200)
    assert (err.call, err.name) == ("host_view", "cudaErrorIllegalAddress")
    dev.host_free(ptr)
