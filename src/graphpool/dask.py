"""Dask integration: graphpool on every worker of a ``distributed`` cluster.

``GraphpoolSetup`` is a worker plugin (``client.register_plugin(GraphpoolSetup(...))``) that
configures graphpool in each worker before its first allocation, as Dask-CUDA's
``rmm_pool_size=`` sets RMM up: the backend, ``GRAPHPOOL_ALLOC_CONF`` options, a memory
fraction, and the integrations (CuPy, Numba, ...) the worker can import. The scheduler
keeps it, so a worker that joins later or comes back from ``client.restart()`` gets it too.
``memory_stats(client)`` and ``memory_summary(client)`` read every worker's allocator.

A ``DeviceBuffer`` is device memory of one process. A task result that another worker (or
the client) needs travels through CUDA IPC where graphpool has it, as graphpool's
``multiprocessing`` reducer sends it: it arrives as an ``IpcBuffer``. Otherwise the worker
gets a ``RefusedBuffer`` and the task using it fails with ``TransferError`` (or the export's
``IpcError``), saying what to send instead. Without this module's serializer Dask would retry
such a transfer for ever. Device memory is never spilled to disk (the spill refuses it and
keeps it in memory). Both ends need this module imported: the plugin imports it on every
worker.

Importing this module imports ``distributed`` (``pip install 'graphpool[dask]'``); nothing
else in graphpool imports it.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import os
import pickle
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

try:
    from distributed import Client, WorkerPlugin
    from distributed.protocol.serialize import dask_deserialize, dask_serialize
except ImportError as _exc:  # pragma: no cover - the extra brings it
    raise ImportError(
        f"graphpool.dask needs Dask's distributed package ({_exc}): pip install 'graphpool[dask]'"
    ) from _exc

import graphpool as gp
from graphpool import runtime
from graphpool.buffer import DeviceBuffer
from graphpool.errors import GraphpoolError
from graphpool.policy.limits import parse_alloc_conf
from graphpool.policy.units import fmt_bytes

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("distributed.worker.graphpool")
"""Below ``distributed.worker``: its records land in the worker's log (``client.get_worker_logs()``)."""


class TransferError(GraphpoolError, TypeError):
    """A ``DeviceBuffer`` cannot go to another Dask worker or to the client (no CUDA IPC here)."""


# --------------------------------------------------------------------------- integrations
def _install_cupy() -> None:
    import graphpool.cupy

    graphpool.cupy.install()


def _install_numba() -> None:
    import graphpool.numba

    graphpool.numba.install()


def _install_torch() -> None:
    import graphpool.torch

    graphpool.torch.install()


def _install_cuda_core() -> None:
    import graphpool.cuda_core

    graphpool.cuda_core.install_hooks()


INTEGRATIONS: dict[str, tuple[str, Callable[[], None]]] = {
    "cupy": ("cupy", _install_cupy),
    "numba": ("numba.cuda", _install_numba),
    "torch": ("torch", _install_torch),
    "cuda_core": ("cuda.core", _install_cuda_core),
}
"""Integration name -> (the framework module the worker must import, what installs it)."""


def install_integrations(
    names: Iterable[str],
    backend: str,
    *,
    import_framework: Callable[[str], object] = importlib.import_module,
    installers: dict[str, Callable[[], None]] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Install the integrations ``names`` whose framework imports: ``(installed, skipped)``,
    ``skipped`` mapping a name to why (its framework does not import, or ``backend`` is not
    "cuda": the simulator serves no framework). An install that fails otherwise raises."""
    installed: list[str] = []
    skipped: dict[str, str] = {}
    for name in names:
        framework, install = INTEGRATIONS[name]
        if installers is not None:
            install = installers[name]
        try:
            import_framework(framework)
        except ImportError as exc:
            skipped[name] = f"{framework} cannot be imported here ({type(exc).__name__}: {exc})"
            continue
        if backend != "cuda":
            skipped[name] = f"graphpool's {backend!r} backend serves no framework (it needs 'cuda')"
            continue
        install()
        installed.append(name)
    return installed, skipped


# --------------------------------------------------------------------------- the plugin
@dataclass(frozen=True)
class Settings:
    """What a ``GraphpoolSetup`` applies, validated; ``alloc_conf`` includes the fraction."""

    backend: str | None
    alloc_conf: str
    integrations: tuple[str, ...]


@dataclass
class WorkerState:
    """What the plugins did in this process (read it with ``client.run(graphpool.dask.worker_state)``)."""

    applied: list[Settings] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)
    address: str | None = None  # the worker's, once a GraphpoolSetup ran here


_state = WorkerState()
_state_lock = threading.Lock()


def worker_state() -> WorkerState:
    """What ``GraphpoolSetup`` applied in this process: each distinct setting once, in order,
    the integrations installed and those skipped with the reason."""
    return _state


def _settings(backend: object, alloc_conf: object, memory_fraction: object, integrations: object) -> Settings:
    """Validate GraphpoolSetup's arguments (TypeError or ValueError naming the argument)."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"GraphpoolSetup(backend=...) takes 'cuda', 'sim' or None, not {backend!r}")
        if backend not in runtime.BACKENDS:
            raise ValueError(
                f"GraphpoolSetup(backend={backend!r}): choose one of {', '.join(runtime.BACKENDS)}, "
                "or None for the worker's default"
            )
    text = ""
    if alloc_conf is not None:
        if not isinstance(alloc_conf, str):
            raise TypeError(
                f"GraphpoolSetup(alloc_conf=...) takes GRAPHPOOL_ALLOC_CONF text such as "
                f"'max_split_size_mb:512', not {alloc_conf!r}"
            )
        try:
            named = parse_alloc_conf(alloc_conf)
        except ValueError as exc:
            raise ValueError(f"GraphpoolSetup(alloc_conf={alloc_conf!r}): {exc}") from None
        if memory_fraction is not None and named.per_process_memory_fraction is not None:
            raise ValueError(
                "GraphpoolSetup: memory_fraction and alloc_conf's per_process_memory_fraction both "
                "set the memory fraction; give one"
            )
        text = alloc_conf
    if memory_fraction is not None:
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, int | float):
            raise TypeError(
                f"GraphpoolSetup(memory_fraction=...) takes a float in (0, 1], not {memory_fraction!r}"
            )
        value = float(memory_fraction)
        if math.isnan(value) or not 0.0 < value <= 1.0:
            raise ValueError(
                f"GraphpoolSetup(memory_fraction={memory_fraction!r}): the fraction of each worker's "
                "device that graphpool may reserve must be in (0, 1]"
            )
        text = (
            f"{text},per_process_memory_fraction:{value!r}"
            if text
            else f"per_process_memory_fraction:{value!r}"
        )
    if isinstance(integrations, str) or not isinstance(integrations, Iterable):
        raise TypeError(
            "GraphpoolSetup(integrations=...) takes a sequence of names such as ('cupy',), "
            f"not {integrations!r}"
        )
    names = tuple(integrations)
    for name in names:
        if name not in INTEGRATIONS:
            raise ValueError(
                f"GraphpoolSetup(integrations=...): unknown integration {name!r}; choose among "
                f"{', '.join(INTEGRATIONS)}"
            )
    return Settings(backend, text, tuple(dict.fromkeys(names)))


class GraphpoolSetup(WorkerPlugin):
    """Configure graphpool in every Dask worker before its first allocation.

    ``client.register_plugin(GraphpoolSetup(backend="cuda", alloc_conf="expandable_segments:True",
    memory_fraction=0.45))``. In each worker, once per process and before anything allocates:

    * ``backend``: ``gp.set_backend(backend)`` ("cuda" or "sim"; None keeps the worker's default,
      ``GRAPHPOOL_BACKEND`` or "cuda" when a GPU is usable);
    * ``alloc_conf``: ``gp.set_allocator_config(alloc_conf)``, ``GRAPHPOOL_ALLOC_CONF``'s text;
    * ``memory_fraction``: a cap on what graphpool reserves, a fraction in (0, 1] of the worker's
      device (``gp.set_per_process_memory_fraction``): give each of several workers sharing one
      GPU its share;
    * ``integrations``: installs each named integration whose framework the worker imports
      ("cupy", "numba", "torch", "cuda_core"); one it cannot import, or that the simulator
      cannot serve, is named in the worker's log and skipped.

    Bad arguments raise TypeError or ValueError here, naming the argument. Idempotent: the
    plugin's name is derived from its settings, so registering the same settings again does
    nothing, and a worker applies each distinct setting once. A worker that has already
    allocated refuses new ``alloc_conf`` options (the registration raises RuntimeError
    naming the worker; ``client.restart()`` applies them to fresh workers). The scheduler
    keeps the plugin: a worker that starts later or restarts gets it before its first task.
    """

    idempotent = True

    def __init__(
        self,
        *,
        backend: str | None = None,
        alloc_conf: str | None = None,
        memory_fraction: float | None = None,
        integrations: Iterable[str] = ("cupy", "numba"),
    ) -> None:
        self.settings = _settings(backend, alloc_conf, memory_fraction, integrations)
        digest = hashlib.sha1(repr(self.settings).encode()).hexdigest()[:12]
        self.name = f"graphpool-setup-{digest}"

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"GraphpoolSetup(backend={s.backend!r}, alloc_conf={s.alloc_conf!r}, "
            f"integrations={s.integrations!r})"
        )

    def setup(self, worker: Worker) -> None:
        """Apply the settings in this worker's process (once per distinct setting)."""
        _state.address = worker.address
        apply(self.settings, where=f"worker {worker.address}")


def apply(settings: Settings, *, where: str = "this process") -> bool:
    """Configure graphpool in this process as ``settings`` say, unless they were applied
    already (False then). RuntimeError if the options cannot apply any more."""
    with _state_lock:
        if settings in _state.applied:
            return False
        if settings.alloc_conf:
            try:
                gp.set_allocator_config(settings.alloc_conf)  # refuses before changing anything
            except RuntimeError as exc:
                raise RuntimeError(
                    f"GraphpoolSetup on {where}: {exc}. Register the plugin before the workers "
                    "allocate, or restart them (client.restart()) to apply it"
                ) from None
        # Switch only to another backend: a new runtime would strand what the worker holds.
        # runtime._runtime is None until graphpool's first use here (runtime.get() would make
        # one of the default backend, initializing CUDA on a GPU machine for nothing).
        current = runtime._runtime
        if settings.backend is not None and (current is None or current.name != settings.backend):
            gp.set_backend(settings.backend)
        installed, skipped = install_integrations(settings.integrations, gp.backend())
        for name, why in skipped.items():
            logger.warning("graphpool: integration %r not installed on %s: %s", name, where, why)
        _state.applied.append(settings)
        _state.installed.extend(n for n in installed if n not in _state.installed)
        _state.skipped.update(skipped)
        for name in installed:
            _state.skipped.pop(name, None)
        logger.info(
            "graphpool: %s configured: backend %s, options %r, integrations installed: %s",
            where,
            gp.backend(),
            settings.alloc_conf,
            ", ".join(installed) or "none",
        )
        return True


# --------------------------------------------------------------------------- memory across workers
def _check_client(client: object, what: str) -> Client:
    if not isinstance(client, Client):
        raise TypeError(f"graphpool.dask.{what} takes a distributed.Client, not {type(client).__name__}")
    if client.asynchronous:
        raise TypeError(f"graphpool.dask.{what} needs a synchronous Client (asynchronous=False)")
    return client


def _worker_stats() -> dict[str, int]:
    return gp.memory_stats()


def memory_stats(client: Client) -> dict[str, dict[str, int]]:
    """``gp.memory_stats()`` of every worker, by worker address (each worker's current
    device: Dask-CUDA gives each worker one GPU)."""
    stats: dict[str, dict[str, int]] = _check_client(client, "memory_stats").run(_worker_stats)
    return stats


def _worker_figures() -> dict[str, Any]:
    """This worker's row of ``memory_summary``: statistics, and what graphs hold (from the snapshot)."""
    stats = gp.memory_stats()
    segments = gp.memory_snapshot()
    pools = {tuple(s["segment_pool_id"]) for s in segments if s["segment_pool_id"] is not None}
    graphs = 0
    for pid in pools:
        graphs += gp.memory_stats(pool=pid).get("use_count", 0)
    return {
        "backend": gp.backend(),
        "device": gp.current_device(),
        "reserved": stats["reserved_bytes.all.current"],
        "peak reserved": stats["reserved_bytes.all.peak"],
        "allocated": stats["allocated_bytes.all.current"],
        "peak allocated": stats["allocated_bytes.all.peak"],
        "OOMs": stats["num_ooms"],
        "graphs": graphs,
        "graph pools": sum(s["total_size"] for s in segments if s["segment_pool_id"] is not None),
        "kept for graphs": sum(b["size"] for s in segments for b in s["blocks"] if b["kept_for"]),
    }


_BYTES = ("reserved", "peak reserved", "allocated", "peak allocated", "graph pools", "kept for graphs")
_COLUMNS = (
    "reserved",
    "peak reserved",
    "allocated",
    "peak allocated",
    "OOMs",
    "graphs",
    "graph pools",
    "kept for graphs",
)


def format_summary(rows: dict[str, dict[str, Any]]) -> str:
    """The table of ``memory_summary`` from each worker's figures (worker address -> figures)."""
    header = ["worker", "backend", *_COLUMNS]
    table = [header]
    totals = dict.fromkeys(_COLUMNS, 0)
    for address in sorted(rows):
        row = rows[address]
        cells = [address, f"{row['backend']}:{row['device']}"]
        for col in _COLUMNS:
            totals[col] += row[col]
            cells.append(fmt_bytes(row[col]) if col in _BYTES else str(row[col]))
        table.append(cells)
    table.append(
        [f"all {len(rows)} workers", ""]
        + [fmt_bytes(totals[c]) if c in _BYTES else str(totals[c]) for c in _COLUMNS]
    )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for i, r in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if i == 0 or i == len(table) - 2:
            lines.append("-" * len(lines[0]))
    lines.append(
        "backend: the worker's graphpool backend and device. graphs: captured graphs holding a "
        "private pool; graph pools: bytes reserved in those pools; kept for graphs: bytes of "
        "ordinary blocks freed during a capture, held until its graph goes. The last row sums "
        "the workers (its peaks bound the cluster's peak from above)."
    )
    return "\n".join(lines)


def memory_summary(client: Client) -> str:
    """One readable table across the workers: reserved and allocated bytes with their peaks,
    out-of-memory errors, captured graphs and the memory their pools hold, and ordinary
    blocks kept for graphs."""
    rows: dict[str, dict[str, Any]] = _check_client(client, "memory_summary").run(_worker_figures)
    return format_summary(rows)


# --------------------------------------------------------------------------- DeviceBuffer transfers
class RefusedBuffer:
    """What a worker receives in place of a ``DeviceBuffer`` that could not be sent to it: any
    use (an attribute, ``__cuda_array_interface__``, DLPack) raises the sender's reason, a
    ``TransferError`` (or the ``IpcError`` of a failed export).

    Why not raise on arrival: Dask takes an error while a worker fetches a task's input for
    a failure of that input's copy, which the scheduler ignores (the original is fine), and
    the task waiting for it waits for ever. The task that uses the placeholder fails
    instead, with the reason. A client that fetches one gets the error itself."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException) -> None:
        object.__setattr__(self, "_error", error)

    def _raise(self) -> Any:
        error: BaseException = object.__getattribute__(self, "_error")
        raise error.with_traceback(None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # protocols probe these: stay an object
            raise AttributeError(name)
        return self._raise()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Raises the reason the buffer was not sent."""
        return self._raise()  # type: ignore[no-any-return]

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """Raises the reason the buffer was not sent."""
        return self._raise()

    def __dlpack_device__(self) -> tuple[int, int]:
        """Raises the reason the buffer was not sent."""
        return self._raise()  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        return (RefusedBuffer, (object.__getattribute__(self, "_error"),))

    def __repr__(self) -> str:
        return f"<graphpool.dask.RefusedBuffer: {object.__getattribute__(self, '_error')}>"


def _refusal(exc: BaseException) -> tuple[dict[str, Any], list[bytes]]:
    try:
        frame = pickle.dumps(exc)
    except Exception:  # an exception that does not pickle travels as its text
        frame = pickle.dumps(TransferError(f"{type(exc).__name__}: {exc}"))
    return {"graphpool": "refused"}, [frame]


_IpcBuffer: Any = getattr(gp, "IpcBuffer", None)
"""graphpool's IpcBuffer where graphpool has IPC (memory another process exported), else None."""


def _serialize_buffer(buf: Any, context: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[bytes]]:
    """Send a DeviceBuffer to another process of this machine through CUDA IPC, or send the
    reason it cannot go. Never fail here: a sender that fails to serialize a task's result
    makes Dask retry the transfer for ever. Without a ``context`` (spilling to disk, not a
    transfer) decline: device memory stays in the worker's memory, not on its disk.

    The buffer goes as graphpool's ``multiprocessing`` reducer sends it (registered with
    ``ForkingPickler`` where graphpool has IPC): its stream synchronized, its IPC handle held
    for the receiver until opened; it arrives as an IpcBuffer. An IpcBuffer goes on as its
    handle, a RefusedBuffer as its reason."""
    if context is None:
        raise NotImplementedError("graphpool device memory is not written to disk")
    if isinstance(buf, RefusedBuffer):
        return _refusal(object.__getattribute__(buf, "_error"))
    if _IpcBuffer is not None and isinstance(buf, _IpcBuffer):
        try:
            return {"graphpool": "handle"}, [pickle.dumps(buf.handle)]
        except Exception as exc:
            return _refusal(exc)
    where = f"worker {_state.address}" if _state.address else "this process"
    what = f"a graphpool DeviceBuffer ({buf.nbytes} B on device {buf.device}) held by {where}"
    advice = (
        "Return host data from the task (a NumPy copy), or a CuPy array (Dask sends those), or run "
        "the tasks that use the buffer on the worker that holds it (client.submit(..., workers=[address]))"
    )
    if not hasattr(buf, "ipc_handle"):
        return _refusal(
            TransferError(
                f"{what} cannot be sent to another process: device memory crosses processes only "
                f"through CUDA IPC, which this graphpool does not have (DeviceBuffer.ipc_handle). {advice}"
            )
        )
    try:
        frame = bytes(ForkingPickler.dumps(buf))
    except GraphpoolError as exc:  # IpcError: memory that cannot be shared, and why
        return _refusal(exc)
    except Exception as exc:
        return _refusal(
            TransferError(
                f"{what} could not be exported through CUDA IPC ({type(exc).__name__}: {exc}). {advice}"
            )
        )
    return {"graphpool": "ipc"}, [frame]


def _deserialize_buffer(header: dict[str, Any], frames: list[bytes]) -> Any:
    """Open what arrived (an IpcBuffer); or, for a refusal or a failed open, a
    ``RefusedBuffer`` in a worker (see its docstring) and the error itself anywhere else (the
    client)."""
    kind = header.get("graphpool")
    try:
        payload = pickle.loads(frames[0])
        if kind == "ipc":
            return payload  # the reducer's receiving side opened it
        if kind == "handle":
            open_ipc = getattr(gp, "open_ipc", None)
            if open_ipc is None:
                raise TransferError("a graphpool IPC handle arrived, but this graphpool has no open_ipc")
            return open_ipc(payload)
    except Exception as exc:
        payload = exc
    if not isinstance(payload, BaseException):
        payload = TransferError(
            f"a graphpool transfer arrived in a form this graphpool cannot read ({kind!r})"
        )
    if _state.address is not None:
        return RefusedBuffer(payload)
    raise payload


def _register() -> None:
    """Make Dask send DeviceBuffers with the functions above (its registries are untyped)."""
    serializers: Any = dask_serialize
    deserializers: Any = dask_deserialize
    for cls in (DeviceBuffer, RefusedBuffer, _IpcBuffer):
        if cls is not None:
            serializers.register(cls)(_serialize_buffer)
            deserializers.register(cls)(_deserialize_buffer)


_register()

__all__ = [
    "GraphpoolSetup",
    "RefusedBuffer",
    "TransferError",
    "WorkerState",
    "memory_stats",
    "memory_summary",
    "worker_state",
]
