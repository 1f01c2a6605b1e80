"""graphpool.dask: GraphpoolSetup on every worker, memory across workers, DeviceBuffer transfers.

The cluster tests run a real ``distributed.LocalCluster`` of two worker processes (one
thread each) on the simulated device: one cluster for the module, on one pytest-xdist
worker (its processes are the slow part: about 2 s to start, 2 s to restart).
"""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool.policy.units import fmt_bytes

pytest.importorskip("distributed", reason="graphpool.dask needs distributed (the test extra brings it)")

import dask
import distributed
from distributed.protocol.serialize import deserialize, serialize

import graphpool.dask as gd

MiB = 1 << 20
CONF = "max_split_size_mb:64,garbage_collection_threshold:0.6"
FRACTION = 0.25
TIMEOUT = 60  # a transfer that hangs fails the test instead of the suite

on_the_cluster = pytest.mark.xdist_group("dask")  # one pytest-xdist worker runs the cluster's tests


# --------------------------------------------------------------------------- no cluster
@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"backend": "gpu"}, ValueError, "backend='gpu'"),
        ({"backend": 1}, TypeError, "backend"),
        ({"alloc_conf": "max_split_size_mb"}, ValueError, "alloc_conf='max_split_size_mb'"),
        ({"alloc_conf": "colour:blue"}, ValueError, "alloc_conf='colour:blue'"),
        ({"alloc_conf": "expandable_segments:maybe"}, ValueError, "alloc_conf"),
        ({"alloc_conf": 512}, TypeError, "alloc_conf"),
        ({"memory_fraction": 0.0}, ValueError, "memory_fraction=0.0"),
        ({"memory_fraction": 1.5}, ValueError, "memory_fraction=1.5"),
        ({"memory_fraction": -0.1}, ValueError, "memory_fraction"),
        ({"memory_fraction": float("nan")}, ValueError, "memory_fraction"),
        ({"memory_fraction": True}, TypeError, "memory_fraction"),
        ({"memory_fraction": "0.5"}, TypeError, "memory_fraction"),
        ({"integrations": ("cupy", "tensorflow")}, ValueError, "'tensorflow'"),
        ({"integrations": "cupy"}, TypeError, "integrations"),
        ({"integrations": 3}, TypeError, "integrations"),
        (
            {"memory_fraction": 0.5, "alloc_conf": "per_process_memory_fraction:0.4"},
            ValueError,
            "memory_fraction",
        ),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], error: type, names: str) -> None:
    with pytest.raises(error, match="GraphpoolSetup") as info:
        gd.GraphpoolSetup(**kwargs)
    assert names in str(info.value)


def test_settings_name_the_plugin_and_travel_intact() -> None:
    a = gd.GraphpoolSetup(backend="sim", alloc_conf=CONF, memory_fraction=FRACTION)
    assert a.settings == gd.Settings("sim", f"{CONF},per_process_memory_fraction:0.25", ("cupy", "numba"))
    assert isinstance(a, distributed.WorkerPlugin) and a.idempotent is True
    same = gd.GraphpoolSetup(backend="sim", alloc_conf=CONF, memory_fraction=FRACTION)
    assert same.name == a.name  # registered twice: the scheduler keeps one
    assert gd.GraphpoolSetup(backend="sim", alloc_conf=CONF).name != a.name
    b = pickle.loads(pickle.dumps(a))
    assert (b.settings, b.name) == (a.settings, a.name)
    only = gd.GraphpoolSetup(memory_fraction=1, integrations=["numba", "numba"])
    assert only.settings == gd.Settings(None, "per_process_memory_fraction:1.0", ("numba",))
    assert gd.GraphpoolSetup(integrations=()).settings == gd.Settings(None, "", ())


def test_integrations_install_what_imports_on_cuda_and_name_the_rest() -> None:
    calls: list[str] = []

    def importer(framework: str) -> object:
        if framework == "cupy":
            raise ModuleNotFoundError("No module named 'cupy'")
        return object()

    installers = {name: (lambda name=name: calls.append(name)) for name in gd.INTEGRATIONS}
    installed, skipped = gd.install_integrations(
        ("cupy", "numba", "cuda_core"), "cuda", import_framework=importer, installers=installers
    )
    assert installed == ["numba", "cuda_core"] == calls
    assert list(skipped) == ["cupy"] and "cupy cannot be imported" in skipped["cupy"]

    calls.clear()
    installed, skipped = gd.install_integrations(
        ("cupy", "numba"), "sim", import_framework=importer, installers=installers
    )
    assert installed == [] == calls
    assert "cannot be imported" in skipped["cupy"] and "'sim' backend" in skipped["numba"]

    def broken() -> None:
        raise RuntimeError("PyTorch already allocated")

    with pytest.raises(RuntimeError, match="already allocated"):  # a real failure is not swallowed
        gd.install_integrations(("torch",), "cuda", import_framework=importer, installers={"torch": broken})


def test_summary_table_names_every_worker_and_sums_them() -> None:
    row = dict.fromkeys(("reserved", "peak reserved", "allocated", "peak allocated"), 0)
    row.update(
        {"OOMs": 0, "graphs": 0, "graph pools": 0, "kept for graphs": 0, "backend": "sim", "device": 0}
    )
    rows = {
        "tcp://10.0.0.1:1": {**row, "reserved": 20 * MiB, "allocated": 3 * MiB, "OOMs": 2, "graphs": 1},
        "tcp://10.0.0.2:2": {**row, "reserved": 2 * MiB, "kept for graphs": 512, "graph pools": 4 * MiB},
    }
    text = gd.format_summary(rows)
    lines = text.splitlines()
    one = next(line for line in lines if line.startswith("tcp://10.0.0.1:1"))
    two = next(line for line in lines if line.startswith("tcp://10.0.0.2:2"))
    assert one.split()[1:4] == ["sim:0", "20.00", "MiB"] and " 2 " in one
    assert "512 B" in two and "4.00 MiB" in two
    total = next(line for line in lines if line.startswith("all 2 workers"))
    assert "22.00 MiB" in total and "3.00 MiB" in total
    assert all(h in lines[0] for h in ("reserved", "peak allocated", "OOMs", "graphs", "kept for graphs"))


def test_memory_across_workers_wants_a_client() -> None:
    for call in (gd.memory_stats, gd.memory_summary):
        with pytest.raises(TypeError, match=r"takes a distributed\.Client, not str"):
            call("tcp://127.0.0.1:8786")  # type: ignore[arg-type]


def test_refused_buffer_raises_the_reason_on_any_use() -> None:
    why = gd.TransferError("no IPC here")
    r = gd.RefusedBuffer(why)
    for use in (
        lambda: r.ptr,
        lambda: r.nbytes,
        lambda: r.__cuda_array_interface__,
        lambda: hasattr(r, "__cuda_array_interface__"),  # a framework's probe fails loudly too
        lambda: r.__dlpack__(),
        lambda: r.__dlpack_device__(),
    ):
        with pytest.raises(gd.TransferError, match="no IPC here"):
            use()
    assert not hasattr(r, "__setstate__")  # other protocols still see a plain object
    again = pickle.loads(pickle.dumps(r))
    with pytest.raises(gd.TransferError, match="no IPC here"):
        again.ptr  # noqa: B018
    assert "no IPC here" in repr(r)


def test_a_workers_row_counts_graphs_their_pools_and_kept_blocks(sim: Any) -> None:
    from graphpool import xp

    a = xp.ones(1000)
    t = xp.ones(100)  # an ordinary block, freed during the capture: kept for the graph
    s = gp.Stream()
    s.wait_stream(gp.current_stream())
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        b = a + 1
        del t
    row = gd._worker_figures()
    stats = gp.memory_stats()
    assert (row["backend"], row["device"]) == ("sim", 0)
    assert row["reserved"] == stats["reserved_bytes.all.current"] and row["OOMs"] == 0
    assert row["peak allocated"] == stats["allocated_bytes.all.peak"]
    assert row["graphs"] == 1 and row["graph pools"] == 2 * MiB and row["kept for graphs"] == 512
    del g
    gc.collect()
    row = gd._worker_figures()
    assert row["graphs"] == 0 and row["kept for graphs"] == 0 and row["graph pools"] == 2 * MiB  # b lives
    del a, b


def test_serializer_never_fails_on_the_sender_and_never_spills(sim: Any) -> None:
    buf = gp.alloc(4096)
    context = {"sender": {"address": "tcp://a"}, "recipient": {"address": "tcp://b"}}
    header, frames = serialize(buf, serializers=("dask", "pickle"), on_error="raise", context=context)
    assert header["serializer"] == "dask"
    if header["sub-header"]["graphpool"] == "refused":
        assert not hasattr(buf, "ipc_handle")  # refused only where graphpool has no IPC
        with pytest.raises(gd.TransferError, match="CUDA IPC") as info:
            deserialize(header, frames)  # outside a worker (the client): the error itself
        assert "4096 B" in str(info.value) and "NumPy" in str(info.value)
    else:  # sent through IPC: it opens here too (and is claimed, so nothing stays held)
        assert header["sub-header"]["graphpool"] == "ipc"
        opened = deserialize(header, frames)
        assert type(opened).__name__ == "IpcBuffer" and opened.nbytes == 4096
        opened.close()
    # without a context (a worker spilling to disk) device memory is refused, not written
    with pytest.raises(TypeError, match="DeviceBuffer"):
        serialize(buf, serializers=("dask", "pickle"), on_error="raise")
    buf.free()


class _Unshareable:
    """Stands for a DeviceBuffer whose IPC export fails (graphpool's reducer raising)."""

    nbytes = 1024
    device = 0

    def __init__(self, error: Exception) -> None:
        self.error = error

    def ipc_handle(self) -> None:
        raise self.error

    def __reduce_ex__(self, protocol: object) -> Any:
        raise self.error


def test_a_failed_export_travels_as_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    context = {"sender": {}, "recipient": {}}
    header, frames = gd._serialize_buffer(
        _Unshareable(gp.GraphpoolError("in an expandable segment")), context
    )
    assert header == {"graphpool": "refused"}
    with pytest.raises(gp.GraphpoolError, match="in an expandable segment"):
        gd._deserialize_buffer(header, frames)  # the client: graphpool's own error, as it was
    header, frames = gd._serialize_buffer(_Unshareable(ValueError("odd")), context)
    with pytest.raises(gd.TransferError, match=r"could not be exported through CUDA IPC \(ValueError: odd\)"):
        gd._deserialize_buffer(header, frames)
    monkeypatch.setattr(gd._state, "address", "tcp://here:1")  # in a worker: a placeholder
    got = gd._deserialize_buffer(header, frames)
    assert isinstance(got, gd.RefusedBuffer)
    with pytest.raises(gd.TransferError, match="odd"):
        got.ptr  # noqa: B018
    header, frames = gd._serialize_buffer(got, context)  # and onward, still refused
    with pytest.raises(gd.TransferError, match="odd"):
        gd._deserialize_buffer(header, frames).nbytes  # noqa: B018


# --------------------------------------------------------------------------- one cluster
def _state() -> dict[str, Any]:
    """What a worker's graphpool looks like (runs in the worker)."""
    from graphpool import runtime

    s = gd.worker_state()
    return {
        "pid": os.getpid(),
        "applied": list(s.applied),
        "skipped": dict(s.skipped),
        "backend": gp.backend(),
        "conf": runtime.alloc_conf(),
        "fraction": gp.get_per_process_memory_fraction(),
    }


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[distributed.Client]:
    """Two worker processes with GraphpoolSetup registered twice (the second changes nothing).
    Dask's active memory manager is off: it may drop either replica of a buffer whose transfer
    was refused, the original included (docs/behaviour.rst), and the transfer test checks
    that the original is intact."""
    with (
        dask.config.set({"distributed.scheduler.active-memory-manager.start": False}),
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            local_directory=str(tmp_path_factory.mktemp("dask")),
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        setup = gd.GraphpoolSetup(backend="sim", alloc_conf=CONF, memory_fraction=FRACTION)
        c.register_plugin(setup)
        c.register_plugin(gd.GraphpoolSetup(backend="sim", alloc_conf=CONF, memory_fraction=FRACTION))
        c.plugin = setup  # type: ignore[attr-defined]
        yield c


def _check_configured(states: dict[str, dict[str, Any]], setup: gd.GraphpoolSetup) -> None:
    assert len(states) == 2 and len({s["pid"] for s in states.values()}) == 2
    for s in states.values():
        assert s["applied"] == [setup.settings]  # once per process, though registered twice
        assert s["backend"] == "sim"
        assert s["conf"].max_split_size == 64 * MiB
        assert s["conf"].garbage_collection_threshold == 0.6
        assert s["conf"].per_process_memory_fraction == FRACTION
        assert s["fraction"] == FRACTION


@on_the_cluster
def test_setup_runs_once_per_worker_with_its_settings(client: distributed.Client) -> None:
    setup = client.plugin  # type: ignore[attr-defined]
    _check_configured(client.run(_state), setup)
    assert set(client.run(gd.apply, setup.settings).values()) == {False}  # applied already


@on_the_cluster
def test_integrations_a_worker_cannot_import_are_logged_not_fatal(client: distributed.Client) -> None:
    states = client.run(_state)
    logs = client.get_worker_logs()
    assert set(logs) == set(states)
    for address, s in states.items():
        assert set(s["skipped"]) == {"cupy", "numba"}  # not importable here, or the simulator
        text = "\n".join(message for _, message in logs[address])
        for name in ("cupy", "numba"):
            assert f"integration '{name}' not installed on worker {address}" in text
    assert client.submit(sum, [1, 2], pure=False).result(timeout=TIMEOUT) == 3  # the workers work


def _alloc(nbytes: int) -> gp.DeviceBuffer:
    return gp.alloc(nbytes)


@on_the_cluster
def test_memory_stats_and_summary_cover_every_worker(client: distributed.Client) -> None:
    workers = sorted(client.scheduler_info()["workers"])
    before = gd.memory_stats(client)
    assert sorted(before) == workers
    sizes = {w: (i + 1) * 3 * MiB for i, w in enumerate(workers)}
    held = {w: client.submit(_alloc, n, workers=[w], pure=False) for w, n in sizes.items()}
    distributed.wait(list(held.values()), timeout=TIMEOUT)
    stats = gd.memory_stats(client)
    assert sorted(stats) == workers
    for w, n in sizes.items():
        grew = stats[w]["allocated_bytes.all.current"] - before[w]["allocated_bytes.all.current"]
        assert grew == n, (w, grew, n)
        assert all(isinstance(v, int) for v in stats[w].values())
    text = gd.memory_summary(client)
    for w in workers:
        line = next(line for line in text.splitlines() if line.startswith(w))
        assert fmt_bytes(stats[w]["allocated_bytes.all.current"]) in line
        assert fmt_bytes(stats[w]["reserved_bytes.all.peak"]) in line
    assert "all 2 workers" in text
    del held


def _make_patterned(nbytes: int) -> gp.DeviceBuffer:
    from graphpool import runtime

    buf = gp.alloc(nbytes)
    runtime.get().device(buf.device).write(buf.ptr, bytes(range(256)) * (nbytes // 256), buf.stream.handle)
    return buf


def _read_bytes(buf: Any) -> tuple[str, bytes]:
    from graphpool import runtime

    data = runtime.get().device(buf.device).read(buf.ptr, buf.nbytes, gp.current_stream(buf.device).handle)
    return type(buf).__name__, data


@on_the_cluster
def test_a_device_buffer_sent_to_another_worker_arrives_or_is_refused_clearly(
    client: distributed.Client,
) -> None:
    w0, w1 = sorted(client.scheduler_info()["workers"])
    made = client.submit(_make_patterned, 4096, workers=[w0], pure=False)
    used = client.submit(_read_bytes, made, workers=[w1], allow_other_workers=False, pure=False)
    pattern = bytes(range(256)) * 16
    ipc_error: tuple[type[BaseException], ...] = (gd.TransferError,)
    if hasattr(gp, "open_ipc"):
        ipc_error += (getattr(gp, "IpcError", gd.TransferError),)
        try:
            kind, data = used.result(timeout=TIMEOUT)
        except ipc_error as exc:  # a refusal must still say why
            assert "IPC" in str(exc), exc
        else:
            assert kind == "IpcBuffer" and data == pattern
        return
    with pytest.raises(gd.TransferError, match="CUDA IPC") as info:
        used.result(timeout=TIMEOUT)  # promptly: not a transfer retried for ever
    assert f"held by worker {w0}" in str(info.value) and "NumPy" in str(info.value)
    with pytest.raises(gd.TransferError, match="CUDA IPC"):
        made.result(timeout=TIMEOUT)  # to the client: refused as clearly
    assert client.submit(_read_bytes, made, workers=[w0], pure=False).result(timeout=TIMEOUT) == (
        "DeviceBuffer",
        pattern,
    )  # on its own worker the buffer is intact and usable


@on_the_cluster
def test_new_options_after_an_allocation_are_refused_with_the_way_out(client: distributed.Client) -> None:
    w0 = sorted(client.scheduler_info()["workers"])[0]
    held = client.submit(_alloc, 1024, workers=[w0], pure=False)
    distributed.wait(held, timeout=TIMEOUT)
    allocated = gd.memory_stats(client)[w0]["allocated_bytes.all.current"]
    same = gd.GraphpoolSetup(backend="sim", integrations=())  # the backend it has: nothing replaced
    try:
        client.register_plugin(same)
        assert client.run(_state, workers=[w0])[w0]["applied"][-1] == same.settings
        assert gd.memory_stats(client)[w0]["allocated_bytes.all.current"] == allocated
    finally:
        client.unregister_worker_plugin(same.name)
    late = gd.GraphpoolSetup(backend="sim", alloc_conf="max_split_size_mb:128", integrations=())
    try:
        with pytest.raises(RuntimeError, match=f"worker {w0}.*before the first allocation.*client.restart"):
            client.register_plugin(late)
    finally:
        client.unregister_worker_plugin(late.name)
    states = client.run(_state, workers=[w0])
    assert states[w0]["conf"].max_split_size == 64 * MiB  # nothing changed where it was refused
    del held


@on_the_cluster
def test_a_restart_applies_the_setup_again(client: distributed.Client) -> None:
    old = {s["pid"] for s in client.run(_state).values()}
    client.restart()
    states = client.run(_state)
    assert not old & {s["pid"] for s in states.values()}  # fresh processes
    _check_configured(states, client.plugin)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- on the GPU
def _cupy_array(n: int) -> Any:
    import cupy

    return cupy.arange(n, dtype=cupy.float64)


def _cupy_sum(a: Any) -> float:
    return float(a.sum())


@pytest.mark.gpu
def test_on_the_gpu_cupy_arrays_come_from_graphpool_and_travel(tmp_path: Any) -> None:
    """GraphpoolSetup(backend="cuda") installs graphpool as CuPy's allocator on each worker; a
    CuPy array made there counts in that worker's graphpool statistics, and travels to another
    worker (Dask copies CuPy arrays through the host: what TransferError advises)."""
    from gpu_guard import cuda_unusable

    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("cupy")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            local_directory=str(tmp_path),
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        c.register_plugin(gd.GraphpoolSetup(backend="cuda", memory_fraction=0.2, integrations=("cupy",)))
        w0, w1 = sorted(c.scheduler_info()["workers"])
        for s in c.run(gd.worker_state).values():
            assert s.installed == ["cupy"] and "cupy" not in s.skipped
        before = gd.memory_stats(c)[w0]["allocated_bytes.all.current"]
        n = 3 * MiB // 8  # float64: the sum below is exact
        made = c.submit(_cupy_array, n, workers=[w0], pure=False)
        distributed.wait(made, timeout=TIMEOUT)
        assert gd.memory_stats(c)[w0]["allocated_bytes.all.current"] - before == 3 * MiB
        total = c.submit(_cupy_sum, made, workers=[w1], allow_other_workers=False, pure=False)
        assert total.result(timeout=TIMEOUT) == float(n * (n - 1) // 2)
        assert w0 in gd.memory_summary(c) and w1 in gd.memory_summary(c)
