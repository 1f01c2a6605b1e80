"""A second process for the IPC tests (tests/test_ipc.py): it runs commands from a queue and
answers on another, so one spawned process serves many checks (spawning costs ~0.5 s).

Commands are tuples; every answer is ``("ok", value)`` or ``("error", class name, message)``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any


def serve(backend: str, commands: Any, answers: Any) -> None:
    """Run commands until ("exit",): open, take, read, write, close, drop, mappings, export,
    cupy, pid."""
    import graphpool as gp
    from graphpool import runtime

    gp.set_backend(backend)
    held: dict[int, Any] = {}
    serial = 0
    while True:
        buf = arr = cmd = None  # nothing of the last command stays referenced here
        cmd = commands.get()
        op = cmd[0]
        try:
            if op == "exit":
                answers.put(("ok", None))
                return
            if op == "pid":
                out: Any = os.getpid()
            elif op in ("open", "take"):  # a handle to open, or an IpcBuffer that arrived as one
                buf = gp.open_ipc(cmd[1]) if op == "open" else cmd[1]
                serial += 1
                held[serial] = buf
                out = (serial, type(buf).__name__, buf.nbytes)
            elif op == "read":
                buf = held[cmd[1]]
                out = runtime.get().device(buf.device).read(buf.ptr, cmd[2], 0)
            elif op == "write":
                buf = held[cmd[1]]
                dev = runtime.get().device(buf.device)
                dev.write(buf.ptr, cmd[2], 0)
                dev.stream_synchronize(0)
                out = None
            elif op == "close":
                held.pop(cmd[1]).close()
                out = None
            elif op == "drop":  # forget it without closing: its finalizer closes it
                del held[cmd[1]]
                out = None
            elif op == "mappings":  # segments this process has mapped (checked against the sim's)
                from graphpool import ipc

                out = len(ipc._maps)
                dev = runtime.get().device(0)
                mem = getattr(dev, "_mem", None)
                if mem is not None and len(mem._imports) != out:
                    raise AssertionError(f"{len(mem._imports)} simulated mappings for {out} segments")
            elif op == "export":  # a buffer of cmd[1] bytes of cmd[2], kept here; its handle
                buf = gp.alloc(cmd[1])
                dev = runtime.get().device(buf.device)
                dev.write(buf.ptr, cmd[2] * cmd[1], buf.stream.handle)
                buf.stream.synchronize()
                serial += 1
                held[serial] = buf
                out = buf.ipc_handle()
            elif op == "cupy":  # read as CuPy sees it, then double it in place
                import cupy

                buf = held[cmd[1]]
                arr = cupy.asarray(buf).view(cmd[2])
                out = arr.get().tobytes()
                arr *= 2
                cupy.cuda.runtime.deviceSynchronize()
            else:
                raise ValueError(f"unknown command {op!r}")
            answers.put(("ok", out))
        except BaseException as exc:  # answered, never fatal: the test reads it
            answers.put(("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
