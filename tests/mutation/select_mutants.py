"""Print the names of the mutants to run, for ``mutmut run`` (tests/mutation/README.md).

Usage: ``python tests/mutation/select_mutants.py [--uniform] MODULE[=N] ...`` from the
repository root, after ``mutmut`` has generated its mutants (``mutants/``). ``MODULE`` is a
dotted module (``graphpool.policy.stats``); without ``=N`` every mutant of it.

``=N`` takes a stratified random sample (seed 14, a fresh generator per module, over the
sorted names): first one mutant of every function that has any (mutmut names them
``module.x_func__mutmut_K`` and ``module.xǁClassǁmethod__mutmut_K``), so that no function
goes unsampled, then a uniform sample of the rest up to N mutants in all (more than N when
the module has more functions than N). ``--uniform`` takes the plain uniform sample of N
instead (``random.Random(14).sample``), the design of the 2026-11-30 run.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 14


def mutant_names(module: str) -> list[str]:
    meta = Path("mutants/src", *module.split(".")).with_suffix(".py.meta")
    names = json.loads(meta.read_text())["exit_code_by_key"]
    return sorted(names)


def function_of(name: str) -> str:
    """The function a mutant is of: its name less the ``__mutmut_K`` suffix."""
    return name.rsplit("__mutmut_", 1)[0]


def stratified(names: list[str], n: int, rng: random.Random) -> list[str]:
    """One mutant per function, then a uniform sample of the others up to ``n`` in all."""
    by_function: dict[str, list[str]] = {}
    for name in names:
        by_function.setdefault(function_of(name), []).append(name)
    chosen = [rng.choice(group) for _, group in sorted(by_function.items())]
    taken = set(chosen)
    rest = [name for name in names if name not in taken]
    chosen += rng.sample(rest, max(0, min(n - len(chosen), len(rest))))
    return sorted(chosen)


def select(spec: str, uniform: bool = False) -> list[str]:
    module, _, n = spec.partition("=")
    names = mutant_names(module)
    if not n:
        return names
    rng = random.Random(SEED)
    return rng.sample(names, int(n)) if uniform else stratified(names, int(n), rng)


def main(argv: list[str]) -> None:
    uniform = argv[:1] == ["--uniform"]
    for spec in argv[1:] if uniform else argv:
        for name in select(spec, uniform):
            print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
