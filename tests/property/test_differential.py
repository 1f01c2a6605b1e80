"""Differential test: the compiled policy against the plain-Python reference, step by step.

The install compiles the policy (``graphpool.compiled()``); the same ``.py`` files run
uncompiled are the executable reference. This test loads a second, uncompiled copy of
the package beside the compiled one (``_reference``), drives one random program of
allocator calls through both (malloc with odd sizes and types, free of live, freed and
foreign pointers, PyTorch's parking free and the request that takes the parked block back,
the owned calls a DeviceBuffer makes (``malloc_owned``, its Block freed, queued or freed
twice), record_stream, stream completion, captures begun through graphpool and
adopted by detection, ended, aborted and released, empty_cache, out-of-memory, peak and
counter resets; MemPools: pools made for a registered spec, use_mem_pool's entries and exits
in and out of order, captures into them, drops, and user upstreams that serve or fail), and
after every step demands the same outcome: the same addresses, the same error (class name,
message and cause), the same ``memory_stats`` and the same snapshot of segments and blocks.
A difference is a compiler semantics gap (mypyc's int and bool handling has produced two) or
a reference that no longer describes the compiled code.

Runs only where the compiled build is installed (CI's install is); uncompiled there is
nothing to compare.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import graphpool

FAKEDEVICE = Path(__file__).resolve().parents[1] / "policy" / "fakedevice.py"
TOTAL = 400_000  # a small device: out-of-memory happens in most programs


def _load_fakedevice(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, FAKEDEVICE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _package_modules() -> dict[str, ModuleType]:
    return {k: v for k, v in sys.modules.items() if k == "graphpool" or k.startswith("graphpool.")}


class Side:
    """One implementation: its allocator module, private-pool module and fake device module,
    and its ``graphpool`` modules (installed in ``sys.modules`` while it runs: the allocator
    imports its invariant checker lazily)."""

    def __init__(self, alloc: ModuleType, pools: ModuleType, fake: ModuleType) -> None:
        self.alloc_mod = alloc
        self.pools_mod = pools
        self.fake_mod = fake
        self.modules = _package_modules()

    @contextmanager
    def active(self) -> Iterator[None]:
        saved = _package_modules()
        for k in saved:
            del sys.modules[k]
        sys.modules.update(self.modules)
        try:
            yield
        finally:
            for k in _package_modules():
                del sys.modules[k]
            sys.modules.update(saved)


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    """(compiled, reference): the installed policy and an uncompiled copy of its sources."""
    if not graphpool.compiled():
        pytest.skip("the compiled build is not installed: nothing to compare the reference with")
    pkg = Path(graphpool.__file__).resolve().parent
    root = tmp_path_factory.mktemp("reference")
    shutil.copytree(
        pkg,
        root / "graphpool",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "_compiled_sources.json"),
    )
    importlib.import_module("graphpool.policy.check")
    compiled = Side(
        importlib.import_module("graphpool.policy.allocator"),
        importlib.import_module("graphpool.policy.private_pools"),
        _load_fakedevice("_gp_fake_compiled"),
    )
    saved = _package_modules()
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        ref_alloc = importlib.import_module("graphpool.policy.allocator")
        ref_pools = importlib.import_module("graphpool.policy.private_pools")
        ref_fake = _load_fakedevice("_gp_fake_reference")  # raises the reference's CUDAError
        importlib.import_module("graphpool.policy.check")
        reference = Side(ref_alloc, ref_pools, ref_fake)
        assert not hasattr(ref_alloc, "__mypyc_attrs__") and ref_alloc.__file__.endswith(".py")
        assert Path(ref_alloc.__file__).resolve().is_relative_to(root)
    finally:
        sys.path.remove(str(root))
        for k in _package_modules():
            del sys.modules[k]
        sys.modules.update(saved)
    assert not str(compiled.alloc_mod.__file__).endswith(".py"), "the installed policy is not compiled"
    yield compiled, reference


class Upstream:
    """A MemPool's user upstream over one side's fake device; ``mode`` makes malloc fail."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.mode = "ok"
        self.live: dict[int, int] = {}

    def malloc(self, nbytes: int, device: int, stream: int) -> object:
        if self.mode == "raise":
            raise RuntimeError("upstream: registered memory exhausted")
        if self.mode == "zero":
            return 0
        if self.mode == "str":
            return "0x1000"
        if self.mode == "overlap":
            return min(self.dev.live) + 512 if self.dev.live else None
        ptr = self.dev.malloc(nbytes)
        if ptr is not None:
            self.live[ptr] = nbytes
        return ptr

    def free(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        assert self.live.pop(ptr) == nbytes
        self.dev.free(ptr)

    def __repr__(self) -> str:  # (in the OOM message: the same on both sides)
        return "Upstream()"


class Run:
    """One implementation's allocator and device, and the handles a program refers to by index."""

    def __init__(self, side: Side, conf: dict[str, Any] | None = None, managed: bool = False) -> None:
        self.side = side
        self.conf = conf or {}  # SizeConfig options (PyTorch's GRAPHPOOL_ALLOC_CONF keys)
        self.managed = managed  # the device has managed memory (from its own budget here)
        with side.active():
            self._make()

    def _make(self) -> None:
        side = self.side
        # Pool ids and release tokens come from process-wide counters, one per copy of the
        # package, which earlier tests advanced differently: restart both at the same place.
        for name in ("_graph_ids", "_handle_ids", "_tokens"):
            setattr(side.pools_mod, name, itertools.count(1_000_000))
        fake = side.fake_mod.FakeDevice
        if self.managed:

            class ManagedFake(fake):  # type: ignore[misc,valid-type]
                def malloc_managed(self, nbytes: int) -> int | None:
                    ptr: int | None = self.malloc(nbytes)
                    return ptr

            fake = ManagedFake
        self.dev = fake(TOTAL, streams=True)
        sizes = dataclasses.replace(side.fake_mod.SHRUNK, **self.conf)
        self.a = side.alloc_mod.CachingAllocator(self.dev, sizes=sizes)
        if sizes.garbage_collection_threshold:  # collects only under a memory fraction
            self.a.limits = self.a.limits.with_fraction(0.8)
        self.ptrs: list[int] = []  # every address handed out, live or not
        self.live: list[int] = []  # those not freed by the program yet
        self.owned: list[Any] = []  # live Blocks of malloc_owned (a DeviceBuffer's kind)
        self.owned_all: list[Any] = []  # every Block malloc_owned returned, live or freed
        self.recs: list[Any] = []  # capture records, in the order begun
        self.mps: list[Any] = []  # MemPool ids registered (this side's mempools), in order
        self.ups: list[Upstream] = []

    def close(self) -> None:
        """Unregister the program's MemPools from this side's registry."""
        for pid in self.mps:
            self.side.pools_mod.mempools.pop(pid, None)

    def step(self, op: tuple[Any, ...]) -> Any:
        """Carry out one operation; return its outcome (a value, or the error's name and text)."""
        with self.side.active():
            try:
                return ("ok", self._do(op))
            except Exception as e:  # the same failure on both sides is part of the outcome
                return ("error", type(e).__name__, str(e), type(e.__cause__).__name__)

    def _ptr(self, i: int) -> int:
        return self.ptrs[i % len(self.ptrs)] if self.ptrs else 12345

    def _take_live(self, i: int) -> int:
        return self.live.pop(i % len(self.live)) if self.live else self._ptr(i)

    def _take_owned(self, i: int) -> Any:
        """A live owned Block (removed from the live ones), else any address (a wrong call)."""
        if self.owned:
            return self.owned.pop(i % len(self.owned))
        return self.owned_all[i % len(self.owned_all)] if self.owned_all else self._ptr(i)

    def _do(self, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        a, dev = self.a, self.dev
        if kind == "malloc":
            ptr = a.malloc(op[1], stream=op[2])
            self.ptrs.append(ptr)
            self.live.append(ptr)
            return ptr
        if kind == "malloc_owned":  # gp.alloc's call: the Block, not filed by address
            block = a.malloc_owned(op[1], stream=op[2])
            self.ptrs.append(block.ptr)
            self.owned.append(block)
            self.owned_all.append(block)
            return block.ptr
        if kind == "free_owned":  # DeviceBuffer.free, or a Block freed already
            return a.free_owned(self._take_owned(op[1]))
        if kind == "defer_owned":  # DeviceBuffer's finalizer (and _free_after)
            return a.defer_free(self._take_owned(op[1]), op[2])
        if kind == "record_owned":
            return a.record_stream(self.owned[op[1] % len(self.owned)] if self.owned else 7, op[2])
        if kind == "free":
            return a.free(self._take_live(op[1]))
        if kind == "park":  # PyTorch's free (policy/heap.py, Note [Parking]), then maybe the
            # parked block's request (op[2]: on its stream; else on another), before any other call
            requested = a.park(self._take_live(op[1]))
            parked = a._parked
            if op[2] is None or parked is None:
                return requested
            ptr = a.malloc(parked.requested, stream=parked.stream if op[2] else parked.stream % 3 + 1)
            self.ptrs.append(ptr)
            self.live.append(ptr)
            return requested, ptr
        if kind == "park_any":  # live, parked, freed or queued already
            return a.park(self._ptr(op[1]))
        if kind == "free_any":  # live, freed or queued already
            return a.free(self._ptr(op[1]))
        if kind == "free_foreign":
            return a.free(op[1])
        if kind == "defer_free":
            return a.defer_free(self._take_live(op[1]), op[2])
        if kind == "record_stream":
            return a.record_stream(self._ptr(op[1]), op[2])
        if kind == "work":
            dev.queue_work(op[1])
            return None
        if kind == "finish":
            dev.finish_work(op[1])
            return None
        if kind == "empty_cache":
            return a.empty_cache()
        if kind == "reset_peak":
            return a.reset_peak()
        if kind == "reset_accumulated":
            return a.reset_accumulated()
        if kind == "begin":
            stream, share = op[1], op[2]
            pools = self.side.pools_mod
            if share and self.recs:
                pool = self.recs[-1].pool.id
            else:
                pool = pools.new_graph_pool_id()
            rec = a.begin_capture(pool, lambda: dev.begin(stream), stream=stream)
            self.recs.append(rec)
            return len(self.recs) - 1
        if kind == "foreign_begin":
            dev.begin(op[1])  # detected at the next malloc on that stream
            return None
        if kind in ("end", "abort", "release"):
            if not self.recs:
                return None
            rec = self.recs[op[1] % len(self.recs)]
            if kind == "end":
                dev.end_capture(rec.stream)
                return a.end_capture(rec)
            if kind == "abort":
                dev.end(rec.stream)
                return a.abort_capture(rec)
            return a.release_capture(rec)
        if kind == "foreign_end":
            if op[1] in dev.capturing:
                dev.end_capture(op[1])
            return None
        if kind == "release_tokens":
            for token in list(dev.attached):
                dev.release(token)
            return None
        return self._do_mempool(op)

    def _mp(self, i: int) -> Any:
        pools = self.side.pools_mod
        return self.mps[i % len(self.mps)] if self.mps else pools.PoolId(0, 999)

    def _do_mempool(self, op: tuple[Any, ...]) -> Any:
        """The MemPool operations (graphpool.mempool's calls, on this side's modules)."""
        kind = op[0]
        a, pools = self.a, self.side.pools_mod
        if kind == "mempool":  # gp.MemPool(upstream=..., use_on_oom=...)
            up: Any = None
            if op[1] == "user":
                up = Upstream(self.dev)
                self.ups.append(up)
            elif op[1] == "managed":
                up = pools.MANAGED
            pid = pools.new_shared_pool_id()
            pools.mempools[pid] = pools.PoolSpec(up, op[2])
            self.mps.append(pid)
            return tuple(a.ensure_pool(pid).id)
        if kind == "ensure":
            return tuple(a.ensure_pool(self._mp(op[1])).id)
        if kind == "enter":  # a MemPool's id, or a graph pool's (refused)
            pid = self.recs[op[1] % len(self.recs)].pool.id if op[2] and self.recs else self._mp(op[1])
            return a.enter_pool(pid)
        if kind == "exit":  # any MemPool's: refused unless it is the innermost
            return a.exit_pool(self._mp(op[1]))
        if kind == "exit_inner":  # the innermost, if any
            stack = a._thread_pools.get(threading.get_ident())
            return a.exit_pool(stack[-1].id) if stack else None
        if kind == "drop":  # the MemPool's finalizer (graphpool.mempool._drop)
            pid = self._mp(op[1])
            spec = pools.mempools.pop(pid, None)
            for al in [] if spec is None else spec.places:
                al.defer_mempool_drop(pid)
            return None
        if kind == "upstream":
            if self.ups:
                self.ups[op[1] % len(self.ups)].mode = op[2]
            return None
        if kind == "begin_mp":  # a capture into a MemPool
            stream, pid = op[1], self._mp(op[2])
            rec = a.begin_capture(pid, lambda: self.dev.begin(stream), stream=stream)
            self.recs.append(rec)
            return len(self.recs) - 1
        raise AssertionError(op)

    def observe(self) -> tuple[Any, ...]:
        """What must agree after every step: statistics, the segment/block picture, invariants."""
        with self.side.active():
            return self._observe()

    def _observe(self) -> tuple[Any, ...]:
        self.a.check_invariants()
        stats = self.a.memory_stats()
        snap = self.a.snapshot()
        pools = sorted(
            (str(p.id), p.use_count, p.stats.as_dict()["reserved_bytes.all.current"], p.held)
            for p in self.a.private_pools()
        )
        entered = {k: [tuple(p.id) for p in v] for k, v in self.a._thread_pools.items()}
        ups = [sorted(up.live.items()) for up in self.ups]
        return stats, snap, pools, sorted(self.dev.live.items()), dict(self.dev.capturing), entered, ups


STREAMS = st.sampled_from((1, 2, 3))
SIZES = st.one_of(
    st.integers(0, 3000),
    st.integers(3000, 60_000),
    st.sampled_from((512, 4096, 4097, 20480, 40960, 300_000, TOTAL + 1, 1 << 62)),
)
ODD_SIZES = st.sampled_from((-1, True, 2.0, "8", None, np.int64(1024), np.uint16(700), 1 << 70))
MALLOC = st.tuples(st.just("malloc"), SIZES, STREAMS)
FREE = st.tuples(st.just("free"), st.integers(0, 50))
MALLOC_OWNED = st.tuples(st.just("malloc_owned"), SIZES, STREAMS)
FREE_OWNED = st.tuples(st.just("free_owned"), st.integers(0, 50))
OPS = st.one_of(
    MALLOC,
    MALLOC,
    MALLOC,
    MALLOC,
    st.tuples(st.just("malloc"), ODD_SIZES, STREAMS),
    MALLOC_OWNED,
    MALLOC_OWNED,
    st.tuples(st.just("malloc_owned"), ODD_SIZES, STREAMS),
    FREE,
    FREE,
    FREE,
    st.tuples(st.just("park"), st.integers(0, 50), st.sampled_from((None, True, True, False))),
    st.tuples(st.just("park"), st.integers(0, 50), st.sampled_from((None, True, True, False))),
    st.tuples(st.just("park_any"), st.integers(0, 50)),
    FREE_OWNED,
    FREE_OWNED,
    st.tuples(st.just("defer_owned"), st.integers(0, 50), st.sampled_from((None, 4))),
    st.tuples(st.just("record_owned"), st.integers(0, 50), st.sampled_from((1, 4, 5))),
    st.tuples(st.just("free_any"), st.integers(0, 50)),
    st.tuples(st.just("free_foreign"), st.sampled_from((0, -8, 7, 1 << 40, "x", None, 2.5))),
    st.tuples(st.just("defer_free"), st.integers(0, 50), st.sampled_from((None, 4))),
    st.tuples(st.just("record_stream"), st.integers(0, 50), st.sampled_from((1, 4, 5))),
    st.tuples(st.just("work"), st.sampled_from((4, 5))),
    st.tuples(st.just("finish"), st.sampled_from((4, 5))),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("reset_peak")),
    st.tuples(st.just("reset_accumulated")),
    st.tuples(st.just("begin"), STREAMS, st.booleans()),
    st.tuples(st.just("foreign_begin"), STREAMS),
    st.tuples(st.sampled_from(("end", "end", "abort", "release")), st.integers(0, 10)),
    st.tuples(st.just("foreign_end"), STREAMS),
    st.tuples(st.just("release_tokens")),
    # MemPools
    st.tuples(st.just("mempool"), st.sampled_from(("device", "managed", "user", "user")), st.booleans()),
    st.tuples(st.just("mempool"), st.sampled_from(("device", "managed", "user", "user")), st.booleans()),
    st.tuples(st.just("ensure"), st.integers(0, 5)),
    st.tuples(st.just("enter"), st.integers(0, 5), st.sampled_from((False, False, False, True))),
    st.tuples(st.just("enter"), st.integers(0, 5), st.just(False)),
    st.tuples(st.just("enter"), st.integers(0, 5), st.just(False)),
    st.tuples(st.just("exit"), st.integers(0, 5)),
    st.tuples(st.just("exit_inner")),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(
        st.just("upstream"), st.integers(0, 5), st.sampled_from(("ok", "raise", "zero", "str", "overlap"))
    ),
    st.tuples(st.just("begin_mp"), STREAMS, st.integers(0, 5)),
)


CONFS = st.sampled_from(
    (
        {},
        {},
        {"max_split_size": 40960},  # SHRUNK's large segment: oversize blocks are common
        {"max_split_size": 65536, "max_non_split_rounding": 49152, "roundup_power2_divisions": (4,) * 16},
        {"roundup_power2_divisions": (2,) * 16},
        {"garbage_collection_threshold": 0.3, "max_split_size": 49152},
        {"expandable_segments": True},
        {"expandable_segments": True, "roundup_power2_divisions": (2,) * 16},
        {"expandable_segments": True, "max_split_size": 40960},
    )
)
"""The configurations a program runs under, both sides the same (the default most often)."""


@pytest.mark.filterwarnings("ignore:graphpool. deferred work failed:RuntimeWarning")  # both sides alike
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(program=st.lists(OPS, min_size=20, max_size=120), conf=CONFS, managed=st.booleans())
def test_compiled_policy_matches_the_reference(
    sides: tuple[Side, Side], program: list[Any], conf: dict[str, Any], managed: bool
) -> None:
    compiled, reference = Run(sides[0], conf, managed), Run(sides[1], conf, managed)
    try:
        for n, op in enumerate(program):
            got, want = compiled.step(op), reference.step(op)
            assert got == want, f"step {n} {op}: compiled {got} != reference {want}"
            event(f"{op[0]}: {got[0] if got[0] == 'ok' else got[1]}")
            if op[0] in ("malloc", "malloc_owned") and compiled.a._entered:
                event(f"{op[0]} inside use_mem_pool: {got[0] if got[0] == 'ok' else got[1]}")
            assert compiled.observe() == reference.observe(), f"state differs after step {n} {op}"
    finally:
        compiled.close()
        reference.close()


def test_the_comparison_can_fail(sides: tuple[Side, Side]) -> None:
    """A changed compiled outcome is noticed: the two sides are not one module twice."""
    compiled, reference = Run(sides[0]), Run(sides[1])
    assert compiled.a.__class__ is not reference.a.__class__
    assert compiled.step(("malloc", 1000, 1)) == reference.step(("malloc", 1000, 1))
    compiled.step(("malloc", 512, 1))  # one side only
    assert compiled.observe() != reference.observe()
    bad: Callable[[], Any] = lambda: reference.a.malloc(-1, stream=1)  # noqa: E731
    with pytest.raises(ValueError):
        bad()
