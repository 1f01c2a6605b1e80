"""The API reference: it builds with Sphinx (warnings are errors), names every public name,
and every public name has a real docstring in both builds (mypyc drops them unless told)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphpool as gp

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FILLER = "mypyc filler docstring"


def _docs() -> Path:
    if not (DOCS / "conf.py").exists():
        pytest.skip("not run from a source checkout")
    return DOCS


@pytest.mark.skipif(importlib.util.find_spec("sphinx") is None, reason="sphinx is not installed")
def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    docs = _docs()
    env = {k: v for k, v in os.environ.items() if k != "GRAPHPOOL_BACKEND"}
    r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(docs), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    api = (tmp_path / "api.html").read_text()
    assert "Allocate" in api and "make_graphed_callables" in api  # docstrings made it in


def test_api_reference_names_every_public_name() -> None:
    text = (_docs() / "api.rst").read_text()
    documented = {
        line.split("::", 1)[1].strip().split("(")[0].removeprefix("graphpool.")
        for line in text.splitlines()
        if line.startswith(".. auto") and "::" in line
    }
    assert sorted(set(gp.__all__) - documented) == []


def test_readme_does_not_point_outside_the_repository() -> None:
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("not run from a source checkout")
    assert "../shared" not in readme.read_text()


POINTERS = re.compile(r"\bentr(y|ies) [0-9]|NOTES|\bSPEC\b|DESIGN\.md|\.\./shared")
"""What a comment writes when it sends the reader to the lab notebook (benchmarks/NOTES.md,
"entry 31") or to a file outside the repository, instead of saying what and why in place."""


def test_source_and_tests_need_no_lab_notebook_or_outside_file() -> None:
    if not (ROOT / "src").is_dir():
        pytest.skip("not run from a source checkout")
    wrong = []
    for path in sorted([*(ROOT / "src").rglob("*"), *(ROOT / "tests").rglob("*")]):
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix not in (".py", ".pyi", ".c", ".cpp"):
            continue
        if path.resolve() == Path(__file__).resolve() or rel == "tests/mutation/report.py":
            continue  # this test names the patterns; report.py's SPEC is a mutant selector
        for i, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if POINTERS.search(line):
                wrong.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert wrong == []


def _public_objects() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for name in gp.__all__:
        obj = getattr(gp, name)
        out.append((name, obj))
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and callable(value):
                    out.append((f"{name}.{attr}", getattr(obj, attr)))
    return out


@pytest.mark.parametrize(("name", "obj"), _public_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_public_names_have_docstrings(name: str, obj: object) -> None:
    """help(gp.alloc) and friends show a real docstring, compiled or not."""
    doc = obj.__doc__ or ""
    assert doc.strip(), f"{name} has no docstring (compiled: {gp.compiled()})"
    assert FILLER not in doc, name


def test_the_compiled_pool_id_docstring_matches_the_source() -> None:
    source = ROOT / "src" / "graphpool" / "policy" / "private_pools.py"
    if not source.exists():
        pytest.skip("not run from a source checkout")
    tree = ast.parse(source.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PoolId"]
    assert ast.get_docstring(cls) == gp.PoolId.__doc__
