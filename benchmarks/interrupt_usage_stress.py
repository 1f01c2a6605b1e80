"""Interrupt real use of graphpool and count what the interrupts leave behind, mode by mode.

A SIGALRM timer fires every ``--period`` seconds (1 ms by default) while the main thread runs
``gp.alloc`` + (optionally) ``record_stream`` on another stream + ``free`` of a random held
buffer, and (optionally) drops everything and calls ``gp.empty_cache()`` now and then; with
``threads``, four worker threads do the same without being interrupted (signals reach the main
thread only). The handler raises KeyboardInterrupt, one-shot while the loop is armed, so the
loop catches every one; it is installed through ``gp.guard_signal_handler`` (``guarded``) or
as is (``unguarded``). After each caught interrupt the allocator's invariants are checked.

At the end every buffer is freed, the device synchronized and the cache emptied; then a mode
reports the invariant failures seen, the bytes still reserved (stranded: nothing is
allocated any more, so empty_cache should give back everything), the bytes still allocated
(allocations whose owner was lost), and the simulated device's bytes in use. Each mode runs
in a fresh interpreter.

    PYTHONPATH=src python benchmarks/interrupt_usage_stress.py [--seconds S] [--period P]
        [--expandable] [--history] [--modes guarded,unguarded] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

MODE_KEYS = ("handler", "record_stream", "empty_cache", "threads")


def child(opts: dict[str, Any]) -> dict[str, Any]:
    """One mode, in this interpreter: the loop, then the accounting."""
    import gc
    import random
    import signal
    import threading

    import graphpool as gp
    from graphpool import runtime

    gp.set_backend(os.environ.get("GRAPHPOOL_BACKEND", "sim"))  # cuda on a GPU machine
    if opts["expandable"]:
        gp.set_allocator_config("expandable_segments:True")
    if opts["history"]:
        gp.record_memory_history(True, max_entries=10_000)
    dev = runtime.get().device(0)
    free0 = dev.mem_info()[0]
    armed = [False]

    def on_alarm(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    guarded = opts["handler"] == "guarded"
    signal.signal(signal.SIGALRM, gp.guard_signal_handler(on_alarm) if guarded else on_alarm)
    sizes = [512, 4096, 1 << 20, 5 << 20]
    stop = threading.Event()
    worker_errors: list[str] = []

    def worker(i: int) -> None:
        rnd = random.Random(i)
        s = gp.Stream() if i % 2 else None
        other = gp.Stream()
        held: list[Any] = []
        try:
            while not stop.is_set():
                b = gp.alloc(rnd.choice(sizes), stream=s)
                if opts["record_stream"] and rnd.random() < 0.3:
                    b.record_stream(other)
                held.append(b)
                if len(held) > 8:
                    held.pop(rnd.randrange(len(held))).free()
        except BaseException as e:
            worker_errors.append(repr(e)[:120])
        finally:
            for b in held:
                if not b.freed:
                    b.free()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4 if opts["threads"] else 0)]
    for t in threads:
        t.start()
    side = gp.Stream()
    rnd = random.Random(0)
    held: list[Any] = []
    caught = 0
    other: dict[str, int] = {}
    broken: list[str] = []
    signal.setitimer(signal.ITIMER_REAL, opts["period"], opts["period"])
    t_end = time.time() + opts["seconds"]
    while time.time() < t_end:
        try:
            armed[0] = True
            while time.time() < t_end:
                b = gp.alloc(rnd.choice(sizes))
                if opts["record_stream"]:
                    b.record_stream(side)
                held.append(b)
                del b
                if len(held) > 6:
                    held.pop(rnd.randrange(len(held))).free()
                if opts["empty_cache"] and rnd.random() < 0.01:
                    held.clear()
                    gp.empty_cache()
            armed[0] = False
        except KeyboardInterrupt:
            caught += 1
            armed[0] = False
            try:
                gp.check_invariants()
            except AssertionError as e:
                broken.append(str(e)[:160])
        except Exception as e:
            armed[0] = False
            key = repr(e)[:100]
            other[key] = other.get(key, 0) + 1
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    stop.set()
    for t in threads:
        t.join()
    for b in held:
        if not b.freed:
            b.free()
    held.clear()
    gc.collect()
    final = "ok"
    try:
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()
    except BaseException as e:
        final = repr(e)[:200]
        broken.append(final)
    st = gp.memory_stats()
    return {
        **{k: opts[k] for k in MODE_KEYS},
        "compiled": gp.compiled(),
        "interrupts": caught,
        "invariant_failures": len(broken),
        "first_failure": broken[0] if broken else "",
        "final_check": final,
        "stranded_reserved": st["reserved_bytes.all.current"],
        "lost_allocated": st["allocated_bytes.all.current"],
        "device_in_use": free0 - dev.mem_info()[0],
        "other_exceptions": other,
        "worker_errors": worker_errors[:3],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--period", type=float, default=0.001)
    ap.add_argument("--expandable", action="store_true", help="expandable_segments:True")
    ap.add_argument("--history", action="store_true", help="record the memory history")
    ap.add_argument("--modes", default="guarded,unguarded", help="handlers to run, comma-separated")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    rows = []
    handlers = args.modes.split(",")
    print(
        f"{'handler':10} {'rs':>3} {'ec':>3} {'thr':>3} {'interrupts':>10} {'inv.fail':>8} "
        f"{'stranded B':>11} {'lost B':>9} {'device B':>10}  notes",
        flush=True,
    )
    for handler, rs, ec, thr in itertools.product(handlers, (False, True), (False, True), (False, True)):
        opts = dict(
            handler=handler, record_stream=rs, empty_cache=ec, threads=thr, seconds=args.seconds,
            period=args.period, expandable=args.expandable, history=args.history,
        )  # fmt: skip
        r = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(opts)],
            capture_output=True, text=True, env={**os.environ},
        )  # fmt: skip
        try:
            row = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            row = {**{k: opts[k] for k in MODE_KEYS}, "crashed": (r.stdout + r.stderr)[-300:]}
            print(row, flush=True)
            rows.append(row)
            continue
        rows.append(row)
        notes = "; ".join(
            x
            for x in (
                row["first_failure"],
                ", ".join(f"{k} x{v}" for k, v in row["other_exceptions"].items()),
                ", ".join(row["worker_errors"]),
            )
            if x
        )
        yn = {True: "y", False: "-"}
        print(
            f"{handler:10} {yn[rs]:>3} {yn[ec]:>3} {yn[thr]:>3} {row['interrupts']:>10} "
            f"{row['invariant_failures']:>8} {row['stranded_reserved']:>11} {row['lost_allocated']:>9} "
            f"{row['device_in_use']:>10}  {notes[:150]}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    bad = sum(
        1
        for r in rows
        if "crashed" in r or r["invariant_failures"] or r["stranded_reserved"] or r["lost_allocated"]
    )
    print(f"{len(rows)} modes, {bad} with invariant failures, stranded or lost bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
