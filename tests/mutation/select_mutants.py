"""Print the names of the mutants to run, for ``mutmut run`` (tests/mutation/README.md).

Usage: ``python tests/mutation/select_mutants.py MODULE[=N] ...`` from the repository root,
after ``mutmut`` has generated its mutants (``mutants/``). ``MODULE`` is a dotted module
(``graphpool.policy.stats``); ``=N`` takes a uniform random sample of N of its mutants
(seed 14, from the sorted names), else all of them.
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


def select(spec: str) -> list[str]:
    module, _, n = spec.partition("=")
    names = mutant_names(module)
    return random.Random(SEED).sample(names, int(n)) if n else names


def main(argv: list[str]) -> None:
    for spec in argv:
        for name in select(spec):
            print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
