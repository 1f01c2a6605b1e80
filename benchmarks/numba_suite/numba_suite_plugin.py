"""pytest plugin for numba-cuda's installed tests, run outside numba-cuda's repository.

Its test classes request a class fixture, ``initialize_from_pytest_config``, and read a
``--dump-failed-filechecks`` option, both defined by a conftest.py that lives in numba-cuda's
repository and is not installed with the package. This gives both, with the same meaning
(the option off unless given), so the installed tests run as they do there.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    why = "numba-cuda: keep reproducers of failed FileCheck tests"
    parser.addoption("--dump-failed-filechecks", action="store_true", help=why)


@pytest.fixture(scope="class")
def initialize_from_pytest_config(request: Any) -> None:
    """Hand the option to the test class, as numba-cuda's own conftest does."""
    request.cls._dump_failed_filechecks = request.config.getoption("dump_failed_filechecks")
