"""Process state: the backend, one allocator per device, and each thread's current device.

Everything above the policy reaches devices and allocators through here, so switching
backends (``set_backend``) is one assignment. Allocators are made on first use.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from graphpool import routing
from graphpool.device.protocol import Backend, Device
from graphpool.errors import BackendReplacedError, BackendUnavailableError, CaptureError, GraphpoolError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.limits import AllocConf, parse_alloc_conf
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.private_pools import CaptureWorld

if TYPE_CHECKING:
    from graphpool.streams import Stream

BACKENDS = ("cuda", "sim")
CUDA_SPACE = "cuda"
"""The handle space of every "cuda" runtime: CUDA streams and events outlive a set_backend."""


class Runtime:
    """One backend with its devices' allocators. Replaced whole by ``set_backend``."""

    def __init__(self, backend: Backend, generation: int, sizes: SizeConfig = DEFAULT) -> None:
        self.backend = backend
        self.name = backend.name
        self.generation = generation
        self.sizes = sizes
        self.count = backend.device_count()
        # The namespace of this backend's handles and addresses. CUDA's are the process's
        # own, valid under every "cuda" runtime; a simulator's belong to its backend object.
        self.space: object = CUDA_SPACE if backend.name == "cuda" else backend
        self.allocators: list[CachingAllocator | None] = [None] * self.count
        self.world = CaptureWorld()  # CUDA's capture rules are process-wide: one count for all
        self._lock = threading.Lock()

    def device(self, index: int) -> Device:
        self.check_index(index)
        return self.backend.get_device(index)

    def allocator(self, index: int) -> CachingAllocator:
        a = self.allocators[index] if 0 <= index < self.count else None
        if a is None:
            self.check_index(index)
            with self._lock:
                a = self.allocators[index]
                if a is None:
                    conf = alloc_conf()  # first: a bad GRAPHPOOL_ALLOC_CONF makes no allocator
                    a = CachingAllocator(
                        self.backend.get_device(index),
                        sizes=configured_sizes(self.sizes, conf),
                        world=self.world,
                        detect=_detect,
                    )
                    a.limits = a.limits.with_fraction(conf.per_process_memory_fraction).with_bytes(
                        conf.memory_limit
                    )
                    a.release_others = _releaser_for(conf)
                    history = _history
                    if history is not None:
                        a.record_history(*history)
                    self.allocators[index] = a
        return a

    def check_index(self, index: int) -> None:
        if type(index) is not int or not 0 <= index < self.count:
            raise ValueError(f"invalid device {index!r}: the {self.name} backend has {self.count} device(s)")


class _ThreadState(threading.local):
    """One thread's current device and streams, valid for runtime ``generation``."""

    def __init__(self) -> None:
        self.device = 0
        self.streams: dict[int, Stream] = {}  # device index -> current stream
        self.generation = -1


_tls = _ThreadState()
_runtime: Runtime | None = None
_generation = 0
_lock = threading.RLock()

limits_lock = threading.Lock()
"""Held by each setter that swaps an allocator's MemoryLimits (a read, then a write): one at a
time, so two settings changed at once never erase each other."""

_config_text = ""
"""What ``gp.set_allocator_config`` set: parsed after ``GRAPHPOOL_ALLOC_CONF``, so its keys win."""


def alloc_conf() -> AllocConf:
    """The allocator settings of ``GRAPHPOOL_ALLOC_CONF`` (``key:value,key:value``, as
    PyTorch's ``PYTORCH_CUDA_ALLOC_CONF``), read as each device's allocator is made, with
    those of ``set_allocator_config`` over them (policy/limits.py lists the keys)."""
    text = os.environ.get("GRAPHPOOL_ALLOC_CONF", "")
    try:
        parse_alloc_conf(text)
    except ValueError as exc:
        raise ValueError(f"GRAPHPOOL_ALLOC_CONF={text!r}: {exc}") from None
    return parse_alloc_conf(text + "," + _config_text)


releaser: Callable[[int, int], int] | None = None
"""What each allocator asks, before an out-of-memory error, to make the process's other caches
give memory back (graphpool.cooperate sets it when imported, which ``import graphpool`` does)."""

_release_others: bool | None = None
"""``set_release_other_caches``'s setting; None: ``release_other_caches`` of the configuration
(default on)."""


def _releaser_for(conf: AllocConf) -> Callable[[int, int], int] | None:
    on = _release_others if _release_others is not None else conf.release_other_caches is not False
    return releaser if on else None


def set_release_other_caches(on: bool) -> None:
    """Cooperation on or off for every allocator, made now or later (graphpool.cooperate)."""
    global _release_others
    if not isinstance(on, bool):
        raise TypeError(f"set_release_other_caches takes True or False, not {on!r}")
    with _lock:
        _release_others = on
        rt = _runtime
        if rt is not None:
            with rt._lock:
                for a in rt.allocators:
                    if a is not None:
                        a.release_others = releaser if on else None


def configured_sizes(sizes: SizeConfig, conf: AllocConf) -> SizeConfig:
    """``sizes`` with the policy options of ``conf`` (max_split_size_mb, ...) in it."""
    fields = conf.policy()
    return dataclasses.replace(sizes, **fields) if fields else sizes


def set_allocator_config(text: str) -> None:
    """Set allocator options as ``GRAPHPOOL_ALLOC_CONF`` does, e.g.
    ``gp.set_allocator_config("max_split_size_mb:512,roundup_power2_divisions:4")``: PyTorch's
    options and graphpool's limits (docs/behaviour.rst, "Configuration"). Its keys win over the
    variable's. Only before the current backend's first allocation (RuntimeError after one);
    ValueError for a bad text or unknown key. Kept for allocators made later, after a
    ``set_backend`` too.

    Each call changes only the keys it names: those of earlier calls stay, and so do the
    fraction and the limit set by ``set_per_process_memory_fraction`` and
    ``set_memory_limit`` unless ``text`` names ``per_process_memory_fraction`` or
    ``memory_limit``. ``""`` forgets the keys of earlier calls (the variable's values apply
    again to the options; limits already set stay)."""
    global _config_text
    if not isinstance(text, str):
        raise TypeError(f"set_allocator_config takes a str such as 'max_split_size_mb:512', not {text!r}")
    named = parse_alloc_conf(text)  # ValueError before anything changes
    with _lock:
        rt = _runtime
        made = [a for a in rt.allocators if a is not None] if rt is not None else []
        for a in made:
            if a.has_allocated():
                raise RuntimeError(
                    "set_allocator_config() must run before the first allocation: device "
                    f"{a.device.index} has already allocated (set GRAPHPOOL_ALLOC_CONF instead, or "
                    "call it first thing)"
                )
        old = _config_text
        _config_text = f"{old},{text}" if old and text else text  # a later key wins
        try:
            conf = alloc_conf()
            if rt is not None:
                for a in made:
                    a.configure(configured_sizes(rt.sizes, conf))
                if named.release_other_caches is not None and _release_others is None:
                    for a in made:
                        a.release_others = _releaser_for(conf)
                with limits_lock:  # only the caps ``text`` names change
                    for a in made:
                        if named.per_process_memory_fraction is not None:
                            a.limits = a.limits.with_fraction(named.per_process_memory_fraction)
                        if named.memory_limit is not None:
                            a.limits = a.limits.with_bytes(named.memory_limit)
        except BaseException:
            _config_text = old
            raise


def _detect_from_env() -> bool:
    value = os.environ.get("GRAPHPOOL_DETECT_CAPTURES", "1").strip().lower()
    if value not in ("0", "1", "true", "false", "on", "off", "yes", "no", ""):
        raise ValueError(f"GRAPHPOOL_DETECT_CAPTURES={value!r}: use 1 (the default) or 0")
    return value not in ("0", "false", "off", "no")


_detect = _detect_from_env()


def set_capture_detection(on: bool) -> None:
    """Turn detection of captures begun outside graphpool on (the default) or off.

    On, every allocation on a stream other than the legacy default stream (which cannot
    capture) asks the device whether its stream is capturing, so a capture begun with CuPy's
    ``Stream.begin_capture``, cuda.core's ``GraphBuilder`` or a raw
    ``cudaStreamBeginCapture`` is served from a private pool. Off, only captures begun
    through ``gp.graph``/``CUDAGraph`` or a hooked framework API (``graphpool.cupy``) are
    protected, and an allocation with no capture underway makes no driver call. Either way
    the free of a buffer used on other streams (``record_stream``) asks those streams, and
    adopts a capture it finds: its event must not go into that capture (it could not be
    queried afterwards). Also ``GRAPHPOOL_DETECT_CAPTURES=0`` in the environment. Applies to
    every device.
    """
    global _detect
    if not isinstance(on, bool):
        raise TypeError(f"set_capture_detection takes True or False, not {on!r}")
    with _lock:
        _detect = on
        rt = _runtime
        if rt is not None:
            with rt._lock:  # as in set_memory_history
                for a in rt.allocators:
                    if a is not None:
                        a.detect = on


_history: tuple[int, bool] | None = None
"""``(max_entries, stacks)`` of ``gp.record_memory_history`` for every allocator, made now
or later (after a ``set_backend`` too); None while not recording."""


def set_memory_history(max_entries: int | None, stacks: bool = True) -> None:
    """Record allocator events on every device (``max_entries`` each), or stop (None)."""
    global _history
    with _lock:
        _history = None if max_entries is None else (max_entries, stacks)
        rt = _runtime
        if rt is not None:
            with rt._lock:  # an allocator made meanwhile read the setting before: reach it too
                for a in rt.allocators:
                    if a is not None:
                        a.record_history(max_entries, stacks)


def capture_detection() -> bool:
    """Whether captures begun outside graphpool are detected (see ``set_capture_detection``)."""
    return _detect


def _make_backend(name: str) -> Backend:
    if name == "cuda":
        from graphpool.device.cuda import CudaBackend

        try:
            return CudaBackend()
        except (ImportError, GraphpoolError) as exc:  # say why in one line, not a driver error
            raise BackendUnavailableError(
                f"the 'cuda' backend needs an NVIDIA GPU and its driver, and no usable CUDA driver or "
                f"GPU was found ({exc}). Use the simulator instead: gp.set_backend('sim'), "
                "GRAPHPOOL_BACKEND=sim, or --backend sim."
            ) from None
    if name == "sim":
        from graphpool.sim.device import SimBackend

        return SimBackend()
    raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


def default_backend_name() -> str:
    """GRAPHPOOL_BACKEND if set, else "cuda" when a GPU is usable, else "sim"."""
    env = os.environ.get("GRAPHPOOL_BACKEND", "").strip().lower()
    if env:
        if env not in BACKENDS:
            raise ValueError(f"GRAPHPOOL_BACKEND={env!r}: choose one of {', '.join(BACKENDS)}")
        return env
    from graphpool.device.cuda import is_available

    return "cuda" if is_available() else "sim"


def get() -> Runtime:
    """The current runtime, made on first use from the default backend."""
    rt = _runtime
    if rt is None:
        with _lock:
            if _runtime is None:
                _install(_make_backend(default_backend_name()))
            rt = _runtime
        assert rt is not None
    return rt


def _install(backend: Backend, sizes: SizeConfig = DEFAULT) -> Runtime:
    global _runtime, _generation
    rt = Runtime(backend, _generation + 1, sizes)
    # The routes gp.alloc keeps name the old runtime's allocators: stale from before the new
    # runtime is published, and again after (a route found in between names the old one).
    routing.invalidate()
    _runtime = rt
    _generation = rt.generation  # after _runtime: whoever sees the new number sees the new runtime
    routing.invalidate()
    return rt


def set_backend(name: str, *, backend: Backend | None = None, sizes: SizeConfig | None = None) -> None:
    """Switch every later call to backend ``name``. Live buffers keep their own allocator.

    ``backend`` may supply a configured backend object (tests use a small simulator);
    ``sizes`` overrides the allocator's size tunables (tests shrink them).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    with _lock:
        _refuse_during_capture()
        b = backend if backend is not None else _make_backend(name)
        if b.name != name:
            raise ValueError(f"backend object is {b.name!r}, not {name!r}")
        _install(b, sizes or DEFAULT)


def generation() -> int:
    """How many runtimes were installed so far: moves at every ``set_backend`` (0: none yet)."""
    return _generation


def space() -> object:
    """The handle space of the current runtime (see ``Runtime.space``), made on first use."""
    return get().space


def replaced(what: str, made_in: object) -> BackendReplacedError:
    """The error for ``what``, made under handle space ``made_in``, used after set_backend."""
    old = made_in if isinstance(made_in, str) else getattr(made_in, "name", repr(made_in))
    new = get().name
    return BackendReplacedError(
        f"{what} was made under the {old!r} backend, which was replaced by set_backend({new!r}); "
        "its handles and addresses mean nothing to the new backend. Make a new one after "
        "set_backend, and switch backends only when no object of the old one is in use."
    )


def _refuse_during_capture() -> None:
    """CaptureError if a capture is underway: replacing the backend would strand it.

    The capture could then never end (its stream belongs to the old backend), and its
    allocator would stay in capture mode, refusing empty_cache, for good.
    """
    rt = _runtime
    if rt is None:
        return
    for index, a in enumerate(rt.allocators):
        if a is not None and a._capturing:
            raise CaptureError(
                f"set_backend() cannot run while a graph capture is underway on device {index} of "
                f"the {rt.name!r} backend: end the capture (capture_end(), or leave the gp.graph "
                "block) or reset() its graph first"
            )


def thread_state() -> _ThreadState:
    """This thread's current device and streams, reset if the backend changed since.

    A new backend keeps the thread's device when it has one of that index (as the CUDA
    runtime keeps its per-thread current device) and starts on default streams.
    """
    tls = _tls
    if tls.generation != _generation:
        tls.generation = _generation
        tls.streams = {}  # (set_backend made every route of the old streams stale)
        if _runtime is None or tls.device >= _runtime.count:
            tls.device = 0
    return tls


def current_device_index() -> int:
    get()
    return thread_state().device


def current_device_object() -> Device:
    """The Device object of this thread's current device."""
    rt = get()
    return rt.device(thread_state().device)


def allocator(index: int | None = None) -> CachingAllocator:
    """The allocator of device ``index`` (default: current)."""
    rt = get()
    return rt.allocator(thread_state().device if index is None else index)
