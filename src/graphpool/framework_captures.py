"""Captures begun through a framework's own API, registered with graphpool as they begin.

CuPy's ``Stream.begin_capture``/``end_capture`` and cuda.core's
``GraphBuilder.begin_building``/``end_building`` start and end CUDA stream captures that
graphpool did not begin. Detection (``gp.set_capture_detection``) finds such a capture at
its first allocation or free; hooking the framework's methods registers it earlier, at
once, so that the capture gets a private pool of its own before anything is allocated or
freed in it. The rule, written once here for every framework:

* after the framework's begin call returns, ``runtime.allocator(device).adopt_capture``
  registers the capture on that stream (a failure only warns: the user's capture goes
  on, and detection still covers it);
* when the framework's end call returns (or raises), ``end_adopted`` stops routing to the
  capture's pool; the pool itself lives until the graph and every executable made from it
  are destroyed (a CUDA user object in the graph releases it);
* the pinned host memory pool (graphpool.pinned) hears of both, so that pinned buffers
  freed during the capture are kept for its graph.

An integration makes one ``CaptureHooks`` for its framework and installs it on the class
that defines the two methods; a class that cannot be patched (an extension type) is left
alone, and detection covers its captures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphpool import _warnings, pinned, runtime

StreamKey = tuple[int, int]
"""(device index, stream handle) of a capture."""


class CaptureHooks:
    """A framework's begin/end capture methods, wrapped to register each capture with graphpool.

    ``begin``/``end``: the names of the two methods on the framework's class. ``what``: the
    capture in words, for the pool's label and the warning (``"CuPy capture"``). ``key``:
    the (device, stream handle) of the object the methods are called on. ``active``: whether
    to register a capture now (the "cuda" backend, and the integration installed).
    ``register``: whether the device pool registers it too (default: whenever ``active``);
    the pinned pool is told of it whenever ``active``.
    """

    def __init__(
        self,
        begin: str,
        end: str,
        what: str,
        key: Callable[[Any], StreamKey],
        active: Callable[[], bool],
        register: Callable[[], bool] | None = None,
    ) -> None:
        self.begin = begin
        self.end = end
        self.what = what
        self._key = key
        self._active = active
        self._register = register
        self._owner: Any = None
        self._originals: tuple[Any, Any] | None = None
        self._own: dict[str, Any] = {}
        """What the owner class itself held under each name before (None: inherited)."""
        self._adopted: dict[StreamKey, Any] = {}
        """(device, stream handle) -> the allocator's record of a capture registered here."""

    @property
    def hooked(self) -> bool:
        """Whether the framework's methods are the wrappers now."""
        return self._originals is not None

    @property
    def owner(self) -> Any:
        """The class whose methods are wrapped (None when not hooked)."""
        return self._owner

    def install(self, owner: Any) -> bool:
        """Wrap ``owner``'s two methods (idempotent). False when ``owner`` cannot be patched."""
        if self._originals is not None:
            return True
        try:
            originals = (getattr(owner, self.begin), getattr(owner, self.end))
        except AttributeError:
            return False
        own = {name: vars(owner).get(name) for name in (self.begin, self.end)}
        try:
            setattr(owner, self.begin, self._begin_wrapper(originals[0]))
            setattr(owner, self.end, self._end_wrapper(originals[1]))
        except (AttributeError, TypeError):  # an extension type: detection covers its captures
            self._restore(owner, own)
            return False
        self._owner, self._originals, self._own = owner, originals, own
        return True

    def uninstall(self) -> None:
        """Give the framework's class its own methods back (idempotent)."""
        if self._originals is not None:
            self._restore(self._owner, self._own)
        self._owner, self._originals, self._own = None, None, {}

    @staticmethod
    def _restore(owner: Any, own: dict[str, Any]) -> None:
        """Put back what ``owner`` itself defined under each name (or inherited: nothing)."""
        for name, value in own.items():
            try:
                if value is not None:
                    setattr(owner, name, value)
                elif name in vars(owner):
                    delattr(owner, name)
            except (AttributeError, TypeError):
                pass

    def adopt(self, obj: Any) -> None:
        """Register the capture that ``obj`` (the framework's stream or builder) just began."""
        if not self._active():
            return
        key = self._key(obj)
        if self._register is None or self._register():
            try:
                self._adopted[key] = runtime.allocator(key[0]).adopt_capture(
                    key[1], label=f"{self.what} on stream 0x{key[1]:x}"
                )
            except Exception as exc:  # never break the user's capture; detection still covers it
                _warnings.warn(f"graphpool could not register the {self.what}: {exc}", RuntimeWarning)
        pinned.capture_begun(*key)  # pinned buffers freed during it are kept for its graph

    def ended(self, obj: Any) -> None:
        """The capture ``obj`` began has ended: stop routing to its pool (which its graph keeps)."""
        key = self._key(obj)
        rec = self._adopted.pop(key, None) if self._adopted else None
        if rec is not None:
            runtime.allocator(key[0]).end_adopted(rec)
        pinned.capture_ended(*key)  # the pinned pool stops keeping frees for it

    def _begin_wrapper(self, original: Any) -> Callable[..., Any]:
        hooks = self

        def begin(obj: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(obj, *args, **kwargs)
            hooks.adopt(obj)
            return out

        begin.__name__ = begin.__qualname__ = self.begin
        begin.__doc__ = (
            f"The framework's {self.begin}, then graphpool registers the capture (a private pool)."
        )
        return begin

    def _end_wrapper(self, original: Any) -> Callable[..., Any]:
        hooks = self

        def end(obj: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(obj, *args, **kwargs)
            finally:
                hooks.ended(obj)

        end.__name__ = end.__qualname__ = self.end
        end.__doc__ = f"The framework's {self.end}; graphpool stops routing to the capture's pool."
        return end
