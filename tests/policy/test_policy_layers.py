"""The allocator's layers (policy/allocator.py lists them): each module of the chain imports
only the layers below it, the class chain is the one the docs describe, and no module of the
policy grows past the size a reader can hold (about 900 lines)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from graphpool.policy import allocator, captures, expandable, heap, reports, segments, stream_uses

POLICY = Path(__file__).resolve().parents[2] / "src" / "graphpool" / "policy"
CHAIN = ("heap", "captures", "stream_uses", "segments", "expandable", "reports", "allocator")
"""The layers, lowest first: each module's class is the base of the next one's."""
MAX_LINES = 950


def policy_imports(source: str) -> set[str]:
    """The modules of graphpool.policy that ``source`` imports (by their last name)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("graphpool.policy."):
                out.add(node.module.rsplit(".", 1)[1])
            elif node.module == "graphpool.policy":
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("graphpool.policy."))
    return out


def upward_imports(name: str, source: str) -> set[str]:
    """The layers above ``name`` in CHAIN that ``source`` (module ``name``) imports."""
    return policy_imports(source) & set(CHAIN[CHAIN.index(name) + 1 :])


def test_the_import_finder_sees_every_form() -> None:
    source = "\n".join(
        [
            "from graphpool.policy.captures import Captures",
            "from graphpool.policy import logs, segments",
            "import graphpool.policy.reports",
        ]
    )
    assert policy_imports(source) == {"captures", "logs", "segments", "reports"}
    assert upward_imports("heap", source) == {"captures", "segments", "reports"}
    assert upward_imports("reports", source) == set()


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = {}
    for name in CHAIN:
        up = upward_imports(name, (POLICY / f"{name}.py").read_text())
        if up:
            wrong[name] = sorted(up)
    assert wrong == {}


def test_the_class_chain_is_the_documented_one() -> None:
    classes = [
        heap.Heap,
        captures.Captures,
        stream_uses.StreamUses,
        segments.Segments,
        expandable.Expandable,
        reports.Reports,
        allocator.CachingAllocator,
    ]
    for below, above in itertools.pairwise(classes):
        assert above.__bases__ == (below,), above
    assert heap.Heap.__bases__ == (object,)


def test_no_policy_module_is_too_long_to_read() -> None:
    long = {p.name: n for p in POLICY.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
