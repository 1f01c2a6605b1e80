"""Count the mutation run's results per module (tests/mutation/README.md).

Usage, from the repository root after ``mutmut run``:
``python tests/mutation/report.py [--list] [--uniform] SPEC ...`` with the same specs (and
``--uniform`` flag) as select_mutants.py (``--list``: every mutant's status, one a line,
instead). Reads mutmut's results (``mutants/**/*.meta``) and ``equivalent.txt`` here (one
``name  # why`` a line); prints per module the counts, the score (killed + timeout over the
mutants run, less the equivalent ones) with, for a sample, the Wilson 95 % lower bound and the
score weighted by each function's share of the module's mutants (the stratified sample takes
one mutant of every function, so small functions weigh more in its plain score), and the
survivors.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

from select_mutants import function_of, mutant_names, select

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}
STATUS.update(dict.fromkeys((36, -24, 24, 152, 255), "timeout"))


def results(module: str) -> dict[str, int | None]:
    meta = Path("mutants/src", *module.split(".")).with_suffix(".py.meta")
    out: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    return out


def equivalent() -> dict[str, str]:
    path = Path(__file__).with_name("equivalent.txt")
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name, _, why = line.partition("#")
        if name.strip():
            out[name.strip()] = why.strip()
    return out


def wilson_lower(p: float, n: int, z: float = 1.96) -> float:
    """Lower end of the Wilson score interval of a proportion ``p`` seen in ``n`` draws
    (sensible at p = 1, where the normal interval has no width)."""
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n)


def weighted_score(module: str, status: dict[str, str]) -> float:
    """The stratified estimate: each function's sampled score weighted by its mutant count."""
    size: dict[str, int] = {}
    for name in mutant_names(module):
        size[function_of(name)] = size.get(function_of(name), 0) + 1
    killed: dict[str, int] = {}
    judged: dict[str, int] = {}
    for name, s in status.items():
        if s in ("killed", "timeout", "survived", "no tests"):
            f = function_of(name)
            judged[f] = judged.get(f, 0) + 1
            killed[f] = killed.get(f, 0) + (s in ("killed", "timeout"))
    total = sum(size[f] for f in judged)
    return sum(size[f] * killed[f] / judged[f] for f in judged) / total if total else float("nan")


def main(argv: list[str]) -> None:
    eq = equivalent()
    overall: list[tuple[int, float]] = []
    listing = argv[:1] == ["--list"]
    argv = argv[1:] if listing else argv
    uniform = argv[:1] == ["--uniform"]
    for spec in argv[1:] if uniform else argv:
        module = spec.partition("=")[0]
        names = select(spec, uniform)
        population = len(mutant_names(module))
        codes = results(module)
        status = {n: STATUS.get(codes.get(n), "other") for n in names}
        for n in names:
            if status[n] != "killed" and status[n] != "timeout" and n in eq:
                status[n] = "equivalent"
        if listing:
            for n in sorted(names):
                print(f"{status[n]}\t{n}")
            continue
        c = Counter(status.values())
        run = len(names) - c["equivalent"] - c["not checked"]
        score = (c["killed"] + c["timeout"]) / run if run else float("nan")
        bound = ""
        if len(names) < population and run:
            bound = f" (a sample: 95 % lower bound {wilson_lower(score, run):.1%}"
            if not uniform:
                bound += f"; weighted by function {weighted_score(module, status):.1%}"
            bound += ")"
        print(f"{module}: {len(names)} of {population} mutants, {dict(sorted(c.items()))}")
        print(f"    score {score:.1%}{bound}")
        overall.append((population, score))
        for n in sorted(names):
            if status[n] not in ("killed", "timeout", "equivalent"):
                print(f"    {status[n]}: {n}")
    if len(overall) > 1:
        total = sum(pop for pop, _ in overall)
        weighted = sum(pop * score for pop, score in overall) / total
        print(f"all modules, weighted by their mutant counts: {weighted:.1%}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
