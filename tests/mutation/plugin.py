"""pytest plugin for the mutation run only (``-p tests.mutation.plugin``, set in pyproject's
``[tool.mutmut]``; see README.md here). A normal test run never loads it.

* Runs the quickest tests first (by the durations mutmut recorded in ``mutmut-stats.json``),
  so that with ``-x`` a mutant that a quick test kills stops early.
* Sets ``GRAPHPOOL_MUTATION=1`` before the test modules are imported: the hypothesis state
  machines of tests/property then run a quarter of their local examples (a surviving mutant
  runs every test that reaches it, so their length sets the length of the run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["GRAPHPOOL_MUTATION"] = "1"

_STATS = Path("mutmut-stats.json")  # mutmut runs the tests from its mutants/ folder
_DURATION: dict[str, float] = (
    json.loads(_STATS.read_text()).get("duration_by_test", {}) if _STATS.exists() else {}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Unknown tests (none recorded yet) go last: the slow state machines are the usual ones.
    items.sort(key=lambda item: _DURATION.get(item.nodeid, 1e9))
