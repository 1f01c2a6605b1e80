"""Run named mutmut mutants when ``mutmut run``'s own stats pass maps no test to any function.

On 2026-12-05 (branch mut3) ``mutmut run NAME...`` ran its whole stats pass (1,319 tests
passed) and then stopped: "could not find any test case for any mutant". This does what mutmut
does with the mutants it generated (``mutants/``), with its own trampoline switch
(``set_mutant_under_test``): a stats pass over the test files given (without ``-x``), which
maps each function to the tests that reach it, then each mutant in a forked child running only
those tests with ``-x`` (pytest's exit code 1: killed; 0: survived). The deselections of
pyproject's ``[tool.mutmut]`` apply.

Usage, from ``mutants/`` (after ``mutmut run`` generated the mutants), one worker::

    unset PYTHONPATH; export PYTHONPATH=$PWD/src
    nice -n 19 python ../tests/mutation/run_named.py NAMES.txt OUT.tsv TESTFILE...

``NAMES.txt``: one mutant name a line. ``OUT.tsv``: status, tab, name (as report.py's lists).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import tomllib

sys.path.insert(0, os.getcwd())  # tests.mutation.plugin, as mutmut's runs find it

import pytest
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.state import state

TIMEOUT_S = int(os.environ.get("RUN_NAMED_TIMEOUT", "120"))  # then "timeout" (killed)
BASE = ["-q", "-p", "no:cacheprovider", "-p", "tests.mutation.plugin", "--hypothesis-seed=0"]


def deselections() -> list[str]:
    """pyproject's ``--deselect``, ``--ignore`` and ``-k`` options of the mutation run."""
    with open("pyproject.toml", "rb") as fh:
        sel = tomllib.load(fh)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
    out: list[str] = []
    for i, arg in enumerate(sel):
        if arg in ("--deselect", "--ignore", "-k"):
            out += [arg, sel[i + 1]]
    return out


def stats(args: list[str], files: list[str]) -> dict[str, list[str]]:
    """Function (mutmut's mangled name) -> the tests reaching it, from a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        set_mutant_under_test("stats")
        hits: dict[str, set[str]] = {}

        class Collector:
            def pytest_runtest_teardown(self, item: Any, nextitem: Any) -> None:
                for f in state()._stats:
                    hits.setdefault(f, set()).add(item.nodeid)
                state()._stats.clear()

        rc = pytest.main(args + files, plugins=[Collector()])
        with os.fdopen(w, "w") as fh:
            json.dump({"rc": int(rc), "hits": {k: sorted(v) for k, v in hits.items()}}, fh)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        data = json.loads(fh.read())
    os.waitpid(pid, 0)
    if data["rc"] != 0:
        raise SystemExit(f"the stats pass failed (pytest exit code {data['rc']})")
    return dict(data["hits"])


def run_one(args: list[str], name: str, tests: list[str]) -> str:
    """``killed``, ``survived``, ``timeout`` (after ``TIMEOUT_S``), or ``exit N`` for another
    pytest exit code."""
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        set_mutant_under_test(name)
        signal.alarm(TIMEOUT_S)  # SIGALRM's default action ends the child
        os._exit(int(pytest.main([*args, "-x", *tests])))
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    return {0: "survived", 1: "killed", -signal.SIGALRM: "timeout"}.get(rc, f"exit {rc}")


def main(argv: list[str]) -> None:
    names_file, out_file, *files = argv
    with open(names_file) as fh:
        names = [line.strip() for line in fh if line.strip()]
    args = BASE + deselections()
    hits = stats(args, files)
    with open(out_file, "w") as out:
        for name in names:
            tests = hits.get(name.rsplit("__mutmut_", 1)[0], [])
            t0 = time.time()
            status = run_one(args, name, tests) if tests else "no tests"
            out.write(f"{status}\t{name}\n")
            out.flush()
            print(f"{status}\t{name}\t{len(tests)} tests\t{time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
