"""At which of CI's fixed examples each risky path of a property machine is first reached.

    python benchmarks/results/2026-12-04-local-ci/reach.py alloc|public N [--freeze]

Runs the machine's first N examples with CI's settings (``CI=true``: derandomized), reading
``REACH`` after each example's teardown; prints JSON: examples run, CPU seconds, first
example per path, paths missed, counts. ``--freeze`` freezes what is alive before the run
out of the garbage collector, as tests/conftest.py does after collection. The sequence is
that of ``run_state_machine_as_test``, not pytest's: the counts differ, the reach does not.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["CI"] = "true"
ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "property"), str(ROOT / "src")]

import test_allocator_machine as m  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

import conftest  # noqa: E402,F401  (loads hypothesis's "ci" profile)


def main() -> None:
    which, n = sys.argv[1], int(sys.argv[2])
    machine, risky, case = {
        "alloc": (m.AllocatorMachine, m.RISKY, m.TestAllocatorMachine),
        "public": (m.PublicApiMachine, m.PUBLIC_RISKY, m.TestPublicApiMachine),
    }[which]
    first: dict[str, int] = {}
    count = [0]
    teardown = machine.teardown

    def counted(self: Any) -> None:
        teardown(self)
        count[0] += 1
        for k in risky:
            if m.REACH[k] and k not in first:
                first[k] = count[0]

    machine.teardown = counted  # type: ignore[method-assign]
    if "--freeze" in sys.argv:
        gc.collect()
        gc.freeze()
    t0 = time.process_time()
    run_state_machine_as_test(machine, settings=settings(case.settings, max_examples=n))
    print(
        json.dumps(
            {
                "examples": count[0],
                "cpu_s": round(time.process_time() - t0, 1),
                "first": first,
                "missing": [k for k in risky if k not in first],
                "counts": {k: m.REACH[k] for k in risky},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
