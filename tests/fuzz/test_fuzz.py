"""The byte-checking fuzz programs (tests/fuzz/fuzzkit.py) under every allocator configuration.

By default (CI) each program runs once per configuration, the i-th configuration on seed
i: the same fixed programs on every run, about 20 s in all on a 2-core machine.
``GRAPHPOOL_FUZZ_SEEDS=N`` runs seeds K to K+N-1 of both programs under every
configuration instead (K: ``GRAPHPOOL_FUZZ_FIRST``, default 0; steps per program:
``GRAPHPOOL_FUZZ_STEPS``). A failure names its program, configuration and seed, and shows
the steps that led to it; rerun that one alone with, e.g.,
``GRAPHPOOL_FUZZ_FIRST=7 GRAPHPOOL_FUZZ_SEEDS=1 pytest tests/fuzz -k graphs-expandable-7``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from fuzzkit import CONFIGS, run_program

PROGRAMS = ("streams", "graphs")
STEPS = 150


def _cases() -> list[Any]:
    count = os.environ.get("GRAPHPOOL_FUZZ_SEEDS")
    first = int(os.environ.get("GRAPHPOOL_FUZZ_FIRST", "0"))
    cases: list[Any] = []
    for program in PROGRAMS:
        for i, config in enumerate(CONFIGS):
            seeds = range(first, first + int(count)) if count else (i,)
            cases += [pytest.param(program, config, seed, id=f"{program}-{config}-{seed}") for seed in seeds]
    return cases


# Graphs that capture nothing (every step of the body found nothing to do) warn, as documented.
@pytest.mark.filterwarnings("ignore:graph#\\d+ captured no work")
@pytest.mark.parametrize(("program", "config", "seed"), _cases())
def test_fuzz(program: str, config: str, seed: int) -> None:
    run_program(program, config, seed, int(os.environ.get("GRAPHPOOL_FUZZ_STEPS", STEPS)))
