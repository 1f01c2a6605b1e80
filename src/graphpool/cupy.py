"""CuPy integration: graphpool as CuPy's allocator, and CuPy's stream kept in step.

``install()`` makes every CuPy allocation come from graphpool, on CuPy's current stream
and device, so arrays made inside ``gp.graph(...)`` land in the graph's private pool
and a block freed by CuPy is reused only as docs/behaviour.rst allows. Where CuPy has
``cupy.cuda.memory.PythonFunctionAllocator`` (CuPy 9 and later), CuPy builds its memory
objects in Cython and calls graphpool's compiled hooks (graphpool.hooks) with the size and
device, and frees by address when it drops the memory. Where CuPy also has
``cupy.cuda.memory.CFunctionAllocator`` and graphpool's compiled shim is installed (the
default, ``use_c_allocator``; ``GRAPHPOOL_CUPY_C=0`` opts out), CuPy calls the shim's C
functions instead, which read CuPy's current stream in C, hand a block graphpool parked to the
next array of its size and stream without calling Python (graphpool.lanes), and otherwise call
the same hooks. Elsewhere ``malloc`` below serves
(CuPy's ``UnownedMemory`` over a graphpool DeviceBuffer). It also registers a
stream follower (``graphpool.routing``) so that ``gp.stream(s)`` and ``gp.graph(g)`` make
``s`` (or the capturing stream) CuPy's current stream too, and give CuPy back its own on
exit: CuPy kernels launched inside ``gp.graph`` are captured. And it hooks CuPy's own
``Stream.begin_capture``/``end_capture``: a capture begun through CuPy's API is registered
with graphpool at once (before its first allocation or free) and served from a private
pool of its own, which lives as long as the returned ``cupy.cuda.Graph`` (a CUDA user
object in the graph releases it). Captures begun any other way are still caught by
detection (``gp.set_capture_detection``). ``uninstall()`` restores the allocator and the
methods CuPy had before. ``using_allocator()`` does both around a ``with`` block (as CuPy's
own ``cupy.cuda.using_allocator``); ``is_installed()`` says whether graphpool is CuPy's
allocator now. ``installed`` and ``using`` are older names of ``using_allocator``. All are
idempotent.

``install_pinned()`` / ``uninstall_pinned()`` do the same for pinned host memory: graphpool's
pinned pool (``gp.alloc_pinned``) becomes CuPy's pinned memory allocator
(``cupy.cuda.set_pinned_memory_allocator``), independently of ``install()``.

CuPy is imported on ``install()``, never at module import. Needs the "cuda" backend.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import threading
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from graphpool import lanes, routing, runtime
from graphpool.buffer import DeviceBuffer
from graphpool.device.protocol import LEGACY_STREAM
from graphpool.errors import OutOfMemoryError
from graphpool.framework_captures import CaptureHooks
from graphpool.hooks import CupyHooks
from graphpool.memory import alloc
from graphpool.pinned import PinnedBuffer, alloc_pinned
from graphpool.routing import Route
from graphpool.streams import Stream, current_stream, resolve_handle

_cp: Any = None
"""The cupy module, once ``install()`` imported it."""


def _not_installed(*args: object) -> Any:
    raise RuntimeError(
        "graphpool.cupy.malloc serves CuPy only after graphpool.cupy.install() (which binds it "
        "to CuPy and makes it CuPy's allocator): call install() first"
    )


_calls: Any = (_not_installed,) * 4
"""CuPy's calls ``malloc`` makes, bound by ``install()``: (``runtime.getDevice``,
``get_current_stream``, ``UnownedMemory``, ``MemoryPointer``); one global read instead of a
chain of attribute lookups for each. Before ``install()``, a call that says so (no test on
``malloc``'s path)."""
_lock = threading.Lock()
_installed = False
_pinned_installed = False
_previous: Any = None
"""CuPy's allocator before ``install()``."""
_allocator: Any = None
"""What ``install()`` handed ``cupy.cuda.set_allocator``: the ``malloc`` of a CuPy
``CFunctionAllocator`` over the shim (``_c_allocator``) or of a ``PythonFunctionAllocator``
over ``_hooks`` where CuPy has those classes, else ``malloc``."""
_hooks: CupyHooks | None = None
"""The compiled hooks (graphpool.hooks) that CuPy's allocator reaches: through the shim's C
functions (CuPy's ``CFunctionAllocator``) or directly (its ``PythonFunctionAllocator``)."""
use_c_allocator = True
"""True (the default): ``install()`` hands CuPy a ``CFunctionAllocator`` over the compiled
shim's C entry points where CuPy has that class and the shim is installed; False: the
``PythonFunctionAllocator`` over the compiled hooks. ``GRAPHPOOL_CUPY_C`` in the environment,
where set, decides instead ("1": the C path, "0": the hooks path). Read at ``install()``.
On an H100 (benchmarks/results/2026-12-05-h100-run15/, one allocator per process, 8
processes a side, two runs) a ``cupy.empty`` + drop at 512 B-64 MiB cost 0.77-0.96x CuPy's own
pool on the C path (min over processes) against 1.28-1.53x on the hooks path, and two CuPy
programs 0.84-1.11x against 0.93-1.52x (medians). Run 16 (three 8-process runs on two more
H100 hosts) read the repeated array at 0.62-1.06x on the C path against 0.77-1.82x (medians),
but the programs at 1.11-1.44x against 1.02-1.16x: there every array misses the lane, and the
C path's misses cost more than the hooks path's by more than its glue explains (not known
why). Programs that make arrays of many sizes may run faster with ``GRAPHPOOL_CUPY_C=0``, the
way back."""
_c_hooks: CupyHooks | None = None
"""The hooks the shim's C entry points call, once made (``_c_allocator``)."""
use_function_allocator = False
"""True: ``install()`` hands CuPy ``malloc`` (a Python function building CuPy's memory objects
around a DeviceBuffer) even where CuPy has ``PythonFunctionAllocator``; for comparisons
(graphpool.tools.frameworks_bench). Read at ``install()``."""
_gp_streams: weakref.WeakValueDictionary[tuple[int, int], Stream] = weakref.WeakValueDictionary()
"""graphpool Stream objects wrapping CuPy's stream handles, by (device, handle); an entry
lives while a buffer of that stream does, so the cache never outgrows what is in use."""
_cp_streams: dict[tuple[int, int], Any] = {}
"""CuPy stream objects wrapping graphpool's stream handles, by (device, handle)."""


def _require_cuda() -> None:
    name = runtime.get().name
    if name != "cuda":
        raise RuntimeError(
            f"graphpool's CuPy allocator needs the 'cuda' backend, but the {name!r} backend is in "
            "use: call graphpool.set_backend('cuda') (and keep it) while CuPy allocates through graphpool"
        )


_last: tuple[int, int, Stream, int] | None = None
"""The CuPy stream ``malloc`` served last: (device, handle, graphpool's wrapper, the routing
generation read before the backend was checked to be "cuda" and the wrapper made; valid
while ``routing.routes.generation`` is that, so a wrapper cached across a concurrent
set_backend is never used). A run of allocations on one stream then makes no key, no
weak-dictionary lookup and no backend check (about half of this module's cost per
allocation). It keeps that one wrapper alive, as ``gp.alloc`` keeps the last stream it was
given."""

_routes = routing.routes


def malloc(nbytes: int) -> Any:
    """CuPy's allocator where CuPy lacks ``PythonFunctionAllocator``: ``nbytes`` on CuPy's
    current stream (usable as ``cupy.cuda.set_allocator(graphpool.cupy.malloc)`` after
    ``install()``).

    Returns a ``cupy.cuda.MemoryPointer`` over ``UnownedMemory`` whose owner is the
    graphpool DeviceBuffer, so the block goes back to graphpool when CuPy drops it.
    """
    get_device, current, unowned, pointer = _calls
    device = get_device()
    handle = current(device).ptr
    last = _last
    if last is not None and last[1] == handle and last[0] == device and last[3] == _routes.generation:
        s = last[2]  # the backend was "cuda" when it was made, and no set_backend ran since
    else:
        s = _wrapper(device, int(handle))
    if nbytes == 0:  # as CuPy's own pools: a null pointer that holds nothing
        return pointer(_cp.cuda.Memory(0), 0)
    buf = alloc(nbytes, stream=s)
    return pointer(unowned(buf.ptr, nbytes, buf, device), 0)


def buffer_of(array: Any) -> DeviceBuffer:
    """The graphpool DeviceBuffer behind a CuPy array (or ``cupy.cuda.MemoryPointer``) that
    was allocated while graphpool was CuPy's allocator: to share it with another process
    (``buffer_of(a).ipc_handle()``), or to ``record_stream`` it. The array may start inside
    the buffer (a view): its offset is ``a.data.ptr - buffer_of(a).ptr``. TypeError otherwise,
    also for arrays served through CuPy's ``CFunctionAllocator`` or ``PythonFunctionAllocator``
    (the fast paths, which keep no DeviceBuffer): set ``use_function_allocator = True`` before
    ``install()`` to share arrays."""
    pointer = getattr(array, "data", array)
    owner = getattr(getattr(pointer, "mem", None), "_owner", None)
    if not isinstance(owner, DeviceBuffer):
        if _installed and _hooks is not None:
            raise TypeError(
                f"{type(array).__name__} has no DeviceBuffer behind it: graphpool serves CuPy through "
                "CuPy's CFunctionAllocator or PythonFunctionAllocator, which keep none; set "
                "graphpool.cupy.use_function_allocator = True before install() to share CuPy arrays"
            )
        raise TypeError(
            f"{type(array).__name__} was not allocated by graphpool (install graphpool.cupy before "
            "allocating the array)"
        )
    return owner


def _wrapper(device: int, handle: int) -> Stream:
    """graphpool's Stream for CuPy's stream ``handle`` of ``device``, kept as ``_last``.

    The legacy handle (1) is the legacy stream; the per-thread default stream (2, CuPy's
    ``Stream.ptds`` or ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) is refused (ValueError), as
    by every entry point (``streams.resolve_handle``); it is never cached, so it never
    reaches the fast path."""
    global _last
    generation = _routes.generation  # read first: a set_backend from now on makes it stale
    _require_cuda()
    key = (device, handle)
    s = _gp_streams.get(key)
    if s is None or s._space is not runtime.space():  # (one made before a set_backend)
        s = Stream._wrap(device, resolve_handle(handle, "graphpool.cupy.malloc", "CuPy's current stream"))
        _gp_streams[key] = s
    _last = (device, handle, s, generation)
    return s


def _find(device: int, raw: int) -> Route:
    """The route for CuPy's stream ``raw`` of ``device`` (``CupyHooks``' slow path): the backend
    checked to be "cuda" and the handle resolved as every entry point resolves one
    (``streams.resolve_handle``: the per-thread default stream refused)."""
    generation = _routes.generation  # read first: a set_backend from now on makes it stale
    _require_cuda()
    handle = resolve_handle(raw, "graphpool.cupy", "CuPy's current stream")
    return Route(handle, runtime.allocator(device), generation)


def cupy_stream(s: Stream) -> Any:
    """The CuPy stream object for graphpool stream ``s`` (cached; ``Stream.null`` for handle 0)."""
    cp = _cp
    if cp is None:  # usable before install() too
        import cupy

        cp = cupy
    key = (s.device, s.handle)
    cs = _cp_streams.get(key)
    if cs is None:
        if s.handle == LEGACY_STREAM:
            cs = cp.cuda.Stream.null
        else:
            with warnings.catch_warnings():
                # CuPy 14 deprecates ExternalStream in favour of Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                cs = cp.cuda.ExternalStream(s.handle, s.device)
        cs = _cp_streams.setdefault(key, cs)
    return cs


def _follow(s: object) -> None:
    """Make graphpool's new current stream CuPy's current stream."""
    if not isinstance(s, Stream) or runtime.get().name != "cuda":
        return
    cs = cupy_stream(s)
    cp = _cp
    if cp.cuda.runtime.getDevice() == s.device:
        cs.use()
    else:
        with cp.cuda.Device(s.device):
            cs.use()


class _Follower:
    """CuPy's current stream following graphpool's (a ``routing.StreamFollower``), registered
    while graphpool is CuPy's allocator."""

    framework = "cupy"

    def follow(self, stream: Stream) -> None:
        _follow(stream)

    def save(self, device: int) -> Any:
        """CuPy's current stream of ``device`` (on the "cuda" backend; else None)."""
        if runtime.get().name != "cuda":
            return None
        with _cp.cuda.Device(device):
            return _cp.cuda.get_current_stream()

    def restore(self, saved: Any, device: int) -> None:
        with _cp.cuda.Device(device):
            saved.use()


_FOLLOWER = _Follower()
"""What ``install()`` registers with ``routing.add_follower``."""


def _stream_key(cs: Any) -> tuple[int, int]:
    device = int(cs.device_id)
    if device < 0:
        device = int(_cp.cuda.runtime.getDevice())
    return device, int(cs.ptr)


_HOOKS = CaptureHooks(
    "begin_capture",
    "end_capture",
    "CuPy capture",
    key=_stream_key,
    active=lambda: (_installed or _pinned_installed) and runtime.get().name == "cuda",
    register=lambda: _installed,
)
"""CuPy's ``Stream.begin_capture``/``end_capture``, wrapped while graphpool is CuPy's allocator
or its pinned allocator (the pinned pool hears of each capture; the device pool registers it
only while graphpool is CuPy's allocator)."""


def _hook(cupy: Any) -> None:
    """Wrap CuPy's begin_capture/end_capture on the class that defines them."""
    owner: Any = next((k for k in type(cupy.cuda.Stream.null).__mro__ if "begin_capture" in vars(k)), None)
    if owner is not None:
        _HOOKS.install(owner)


def hooked() -> bool:
    """Whether CuPy's ``Stream.begin_capture``/``end_capture`` are graphpool's wrappers now."""
    return _HOOKS.hooked


def _c_allocator(cupy: Any) -> tuple[CupyHooks, Any] | None:
    """The hooks and the ``malloc`` of a CuPy ``CFunctionAllocator`` over the shim's C entry
    points (graphpool._torch_shim: ``graphpool_cupy_malloc``/``free``, which read CuPy's
    current stream with CuPy's own exported C function and take a parked block from the
    device's lane without calling Python), or None where CuPy, the compiled shim or CuPy's
    exported stream function is missing (``PythonFunctionAllocator`` then serves).

    The hooks are the process's, made once: the shim calls one free hook for every block it
    handed CuPy, also for arrays that outlive an ``uninstall()``."""
    global _c_hooks
    cuda = cupy.cuda
    cfa = getattr(getattr(cuda, "memory", None), "CFunctionAllocator", None)
    if cfa is None:
        return None
    stream_module = getattr(cuda, "stream", None)
    if not isinstance(stream_module, types.ModuleType):
        try:
            stream_module = importlib.import_module(f"{getattr(cuda, '__name__', 'cupy.cuda')}.stream")
        except ImportError:
            return None
    capi = getattr(stream_module, "__pyx_capi__", None)
    capsule = capi.get("get_current_stream_ptr") if isinstance(capi, dict) else None
    if capsule is None:
        return None
    try:
        shim = lanes.shim("graphpool.cupy")
    except RuntimeError:
        return None
    if not hasattr(shim, "set_cupy_hooks"):
        return None
    hooks = _c_hooks
    if hooks is None:
        hooks = CupyHooks(cuda.get_current_stream, _find, lanes.binder("graphpool.cupy"))
    try:
        shim.set_cupy_hooks(hooks.malloc_on, hooks.free, capsule)
    except TypeError:  # CuPy's stream function has another signature than the one the shim calls
        return None
    if _c_hooks is None:
        atexit.register(shim.close)  # arrays CuPy drops after Python is gone are left alone
    _c_hooks = hooks
    entry_malloc, entry_free = shim.cupy_entry_points()
    return hooks, cfa(0, entry_malloc, entry_free, shim).malloc


def install() -> None:
    """Make graphpool CuPy's allocator and keep CuPy's current stream in step with graphpool's.

    Idempotent. Raises ImportError without CuPy, RuntimeError unless the backend is "cuda".
    """
    global _cp, _calls, _installed, _previous, _allocator, _hooks
    import cupy

    _require_cuda()
    with _lock:
        if _installed:
            return
        _cp = cupy
        cuda = cupy.cuda
        _calls = (cuda.runtime.getDevice, cuda.get_current_stream, cuda.UnownedMemory, cuda.MemoryPointer)
        _previous = cupy.cuda.get_allocator()
        native = getattr(getattr(cuda, "memory", None), "PythonFunctionAllocator", None)
        env = os.environ.get("GRAPHPOOL_CUPY_C")
        c_ok = use_c_allocator if env is None else env != "0"
        c_path = _c_allocator(cupy) if c_ok and not use_function_allocator else None
        if c_path is not None:
            _hooks, _allocator = c_path
        elif native is not None and not use_function_allocator:
            # CuPy builds its memory objects in Cython and calls the compiled hooks with the
            # size and device (CuPy's current device); the hooks read CuPy's current stream
            _hooks = CupyHooks(cuda.get_current_stream, _find)
            _allocator = native(_hooks.malloc, _hooks.free).malloc
        else:
            _hooks, _allocator = None, malloc
        cupy.cuda.set_allocator(_allocator)
        _hook(cupy)
        routing.add_follower(_FOLLOWER)
        _installed = True
    s = current_stream()
    if s.handle != LEGACY_STREAM:
        _follow(s)  # installed inside `with gp.stream(...)`: CuPy follows from now on


def uninstall() -> None:
    """Give CuPy back the allocator it had before ``install()`` and stop following streams.

    Idempotent. CuPy arrays allocated through graphpool stay valid and are freed to
    graphpool when CuPy drops them.
    """
    global _installed, _previous, _allocator
    with _lock:
        if not _installed:
            return
        routing.remove_follower(_FOLLOWER)
        if _cp.cuda.get_allocator() is _allocator:
            _cp.cuda.set_allocator(_previous)
        if not _pinned_installed:  # the pinned pool still needs CuPy's captures announced
            _HOOKS.uninstall()
        _previous = _allocator = None
        _installed = False


def is_installed() -> bool:
    """True between ``install()`` and ``uninstall()``."""
    return _installed


@contextlib.contextmanager
def using_allocator() -> Iterator[None]:
    """A context manager: graphpool is CuPy's allocator inside the ``with`` block (installed
    on entry, uninstalled on exit unless it was installed before)."""
    was = _installed
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


installed = using_allocator
"""The older name of ``using_allocator`` (a context manager, not a question: that is
``is_installed()``)."""
using = using_allocator
"""The older short name of ``using_allocator``."""

__all__ = [
    "buffer_of",
    "cupy_stream",
    "hooked",
    "install",
    "installed",
    "is_installed",
    "malloc",
    "uninstall",
    "using",
    "using_allocator",
]


# ------------------------------------------------------------------ pinned memory
class _PinnedMemory:
    """What a CuPy ``PinnedMemoryPointer`` made by ``pinned_malloc`` points into (its ``mem``:
    ``ptr`` and ``size``, as CuPy's ``PinnedMemory``): it owns the graphpool PinnedBuffer, which
    goes back to graphpool's pinned pool when CuPy drops the pointer."""

    __slots__ = ("ptr", "size", "buffer")

    def __init__(self, buffer: PinnedBuffer) -> None:
        self.ptr = buffer.ptr
        self.size = buffer.nbytes
        self.buffer = buffer

    def __int__(self) -> int:
        return self.ptr


def pinned_malloc(nbytes: int) -> Any:
    """The allocator handed to ``cupy.cuda.set_pinned_memory_allocator``: ``nbytes`` of pinned
    host memory from graphpool's pinned pool, for CuPy's current stream and device, as a
    ``cupy.cuda.PinnedMemoryPointer``. Out of pinned memory it raises CuPy's
    ``CUDARuntimeError`` (cudaErrorMemoryAllocation), on which CuPy falls back to a synchronous
    copy, as with its own pool."""
    cp = _cp
    if cp is None or not _pinned_installed:
        raise RuntimeError(
            "graphpool.cupy.pinned_malloc serves CuPy only after graphpool.cupy.install_pinned()"
        )
    device = int(cp.cuda.runtime.getDevice())
    s = _wrapper(device, int(cp.cuda.get_current_stream(device).ptr))
    try:
        buf = alloc_pinned(nbytes, stream=s)
    except OutOfMemoryError as exc:
        rt = cp.cuda.runtime
        err = getattr(rt, "CUDARuntimeError", None)
        if err is None:
            raise
        raise err(getattr(rt, "errorMemoryAllocation", 2)) from exc
    return cp.cuda.PinnedMemoryPointer(_PinnedMemory(buf), 0)


def install_pinned() -> None:
    """Make graphpool's pinned pool CuPy's pinned memory allocator
    (``cupy.cuda.set_pinned_memory_allocator``): CuPy's staging buffers, ``cupyx.empty_pinned``
    and ``cupy.cuda.alloc_pinned_memory`` then follow graphpool's rules (reuse after their
    stream's work, blocks freed during a capture kept for its graph; docs/behaviour.rst,
    "Pinned host memory"). Also hooks CuPy's ``Stream.begin_capture``/``end_capture`` so the
    pool hears of CuPy's captures. Independent of ``install()``. Idempotent; ImportError
    without CuPy, RuntimeError unless the backend is "cuda"."""
    global _cp, _pinned_installed
    import cupy

    _require_cuda()
    with _lock:
        if _pinned_installed:
            return
        _cp = cupy
        cupy.cuda.set_pinned_memory_allocator(pinned_malloc)
        _hook(cupy)
        _pinned_installed = True


def uninstall_pinned() -> None:
    """Give CuPy its default pinned pool back (``cupy.get_default_pinned_memory_pool().malloc``:
    CuPy cannot tell which allocator was set before). Idempotent; buffers CuPy still holds go
    back to graphpool's pinned pool when dropped."""
    global _pinned_installed
    with _lock:
        if not _pinned_installed:
            return
        _cp.cuda.set_pinned_memory_allocator(_cp.get_default_pinned_memory_pool().malloc)
        if not _installed:
            _HOOKS.uninstall()
        _pinned_installed = False


def is_pinned_installed() -> bool:
    """True between ``install_pinned()`` and ``uninstall_pinned()``."""
    return _pinned_installed
