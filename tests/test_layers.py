"""The import graph of src/graphpool, built from the source, has no circles and points down.

Layers, lowest first: errors, device (the protocol, the CUDA device and the
simulated one), policy, routing (which allocator and stream serve a call), the public core
(runtime, streams, buffers, memory...), graphs (capture and graphed callables, over the
core), the public API (``graphpool/__init__.py``), integrations (the frameworks, and the
CuPy-like arrays ``graphpool.sim.xp``) and tools (``graphpool.tools``: the command line,
demo, benchmarks, traces and pictures). The library is everything below the tools, and
nothing in it imports them. A module imports only its own layer or the layers below, with
no exception, and reaches no module above it by other means: no module below the
integrations looks one up in ``sys.modules`` (an integration registers what the core needs
of it, as graphpool.cupy's stream follower). The graph holds every import a module can
execute: module-level and function-level ``import`` statements and ``import_module("...")``
calls; imports under ``if TYPE_CHECKING:`` are left out (they never run). A package's own
``__init__`` running before its submodules is implied by Python, not an arrow.

Three modules outside ``graphpool/tools`` keep documented names working and only forward:
``graphpool/__main__.py`` (``python -m graphpool``), ``graphpool/traces.py`` (README's
``graphpool.traces``) in the tools layer, and ``graphpool/xp.py`` (``from graphpool import
xp``) beside the arrays it names.

Also kept: device/cuda.py is the only module that imports cuda.bindings; the policy
imports no device implementation, simulator or framework; outside the policy,
policy/allocator.py is imported for its allocator class alone (shared helpers live in
small modules of their own, such as policy/units.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import graphpool

SRC = Path(graphpool.__file__).parent
FRAMEWORKS = {"cupy", "numba", "torch", "jax", "cuda"}

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("graphpool.errors", "graphpool._warnings")),
    ("device", ("graphpool.device", "graphpool.sim")),
    ("policy", ("graphpool.policy",)),
    ("routing", ("graphpool.routing",)),
    (
        "core",
        (
            "graphpool.runtime",
            "graphpool.streams",
            "graphpool.dlpack",
            "graphpool.buffer",
            "graphpool.snapshot",
            "graphpool.ipc",
            "graphpool.memory",
            "graphpool.pinned",
            "graphpool.cooperate",
            "graphpool.build",
            "graphpool.hooks",
        ),
    ),
    ("graphs", ("graphpool.graphs", "graphpool.graphed")),
    ("api", ("graphpool",)),
    (
        "integrations",
        (
            "graphpool.framework_captures",
            "graphpool.lanes",
            "graphpool.cupy",
            "graphpool.numba",
            "graphpool.cuda_core",
            "graphpool.torch",
            "graphpool.dask",
            "graphpool.sim.xp",
            "graphpool.xp",
        ),
    ),
    ("tools", ("graphpool.tools", "graphpool.__main__", "graphpool.traces")),
]

TOOLS = "graphpool.tools"
FORWARDERS = {"graphpool.__main__", "graphpool.traces", "graphpool.xp"}
"""Modules outside graphpool/tools that keep a documented name working by forwarding."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
# A C module with a type stub (policy/_lock.c) is a module of the graph too, through its stub.
MODULES.update({module_name(p): p for p in sorted(SRC.rglob("*.pyi")) if module_name(p) not in MODULES})


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for c in child.orelse:
                yield c
                yield from _nodes(c)
            continue
        yield child
        yield from _nodes(child)


def imported_names(name: str) -> set[str]:
    """Dotted names module ``name`` imports at run time (any package, any depth)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return names_imported_by(path.read_text(), package)


def names_imported_by(source: str, package: str) -> set[str]:
    """Dotted names ``source`` (a module of ``package``) imports at run time."""
    out: set[str] = set()
    for node in _nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
    return out


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the graphpool modules it imports."""
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        targets = {_resolve(t) for t in imported_names(name) if t.split(".")[0] == "graphpool"}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(name: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level >= 0, f"{name} is in no layer: add it to LAYERS in tests/test_layers.py"
    return level


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "graphpool.runtime" in graph["graphpool.memory"]  # module level
    assert "graphpool.snapshot" in graph["graphpool.memory"]  # inside a function
    found = names_imported_by('import importlib\nimportlib.import_module("graphpool.cupy")\n', "graphpool")
    assert "graphpool.cupy" in found  # an import_module("...") string
    assert "graphpool.policy.allocator" not in graph["graphpool.buffer"]  # under TYPE_CHECKING


def test_the_import_graph_has_no_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for name, targets in import_graph().items():
        for t in targets:
            if layer_of(t) > layer_of(name):
                wrong.append(f"{name} ({LAYERS[layer_of(name)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})")
    assert wrong == []


def test_nothing_in_the_library_imports_the_tools() -> None:
    """Outside graphpool/tools only the forwarders (``python -m graphpool`` and README's
    ``graphpool.traces``) import a tool; no other module names one either."""
    wrong = []
    for name, path in MODULES.items():
        if name == TOOLS or name.startswith(TOOLS + ".") or name in FORWARDERS:
            continue
        wrong += [f"{name} -> {t}" for t in import_graph()[name] if t == TOOLS or t.startswith(TOOLS + ".")]
        if path.suffix == ".py":
            for node in _nodes(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if node.value == TOOLS or node.value.startswith(TOOLS + "."):
                        wrong.append(f"{name}: {node.value!r}")
    assert wrong == []


def test_the_tools_are_the_top_layer() -> None:
    assert LAYERS[-1][0] == "tools" and TOOLS in LAYERS[-1][1]
    assert all(layer_of(n) == len(LAYERS) - 1 for n in MODULES if n.startswith(TOOLS + "."))


def test_the_forwarders_only_forward() -> None:
    """A forwarder holds a docstring, imports, ``__all__`` taken from the module it names
    and (``__main__``) the call of its ``main``: no code of its own that could drift."""
    for name in FORWARDERS:
        tree = ast.parse(MODULES[name].read_text())
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            if isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                assert ast.unparse(node.body[0]) == "sys.exit(main())", name
                continue
            raise AssertionError(f"{name} holds {ast.unparse(node)[:60]!r}")


def test_graphpool_imports_no_tool() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, graphpool; print([m for m in sys.modules if m.startswith('graphpool.tools')])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_policy_is_plain_python() -> None:
    allowed = ("graphpool.policy", "graphpool.device.protocol", "graphpool.errors", "graphpool._warnings")
    lock = "fastrlock"  # the allocator's lock (CuPy's): no CUDA, no framework
    for name, path in MODULES.items():
        if not name.startswith("graphpool.policy"):
            continue
        for imported in imported_names(name):
            if imported.startswith("graphpool"):
                assert imported.startswith(allowed), (path.name, imported)
            else:
                top = imported.split(".")[0]
                assert top in sys.stdlib_module_names or top == lock, (path.name, imported)


def test_only_the_dask_integration_imports_dask() -> None:
    """Dask's ``distributed`` is an extra (``graphpool[dask]``): graphpool.dask imports it, and no
    other module imports graphpool.dask or Dask."""
    users = {
        name
        for name in MODULES
        if any(n.split(".")[0] in ("dask", "distributed") for n in imported_names(name))
    }
    assert users == {"graphpool.dask"}
    assert [name for name, targets in import_graph().items() if "graphpool.dask" in targets] == []


def test_only_the_cuda_module_imports_cuda_bindings() -> None:
    users = {
        MODULES[name].relative_to(SRC).as_posix()
        for name in MODULES
        if any(n == "cuda.bindings" or n.startswith("cuda.bindings.") for n in imported_names(name))
    }
    assert users == {"device/cuda.py"}


def test_cuda_is_reached_in_the_device_layer_only() -> None:
    """Besides device/cuda.py, only the C module beside it (the per-allocation capture query
    and graph user objects) talks to the CUDA driver."""
    loaders = sorted(
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*")
        if p.suffix in (".py", ".c") and "libcuda" in p.read_text(errors="ignore")
    )
    assert loaders == ["device/_capture.c"]
    users = sorted(
        n
        for n, path in MODULES.items()
        for node in _nodes(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and any(a.name == "_capture" for a in node.names)
    )
    assert users == ["graphpool.device.cuda"]


def test_core_modules_import_no_framework_at_module_level() -> None:
    core = ["__init__.py", "buffer.py", "memory.py", "streams.py", "runtime.py", "graphs.py", "errors.py"]
    for name in core:
        tree = ast.parse((SRC / name).read_text())
        for node in tree.body:  # module level only; integrations import lazily inside functions
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for m in mods:
                    assert m is None or m.split(".")[0] not in FRAMEWORKS, (name, m)


def test_graphs_do_not_reach_into_devices() -> None:
    for name in imported_names("graphpool.graphs"):
        assert not name.startswith(("graphpool.sim", "graphpool.device.cuda")), name


def test_the_replay_checker_listens_to_streams() -> None:
    """streams.py tells graphs.py about event records and waits through listeners."""
    from graphpool import graphs, streams

    assert streams.record_listeners.count(graphs.note_record) == 1
    assert streams.wait_listeners.count(graphs.note_wait) == 1


INTEGRATIONS = next(i for i, (layer, _) in enumerate(LAYERS) if layer == "integrations")


def sys_modules_reads(source: str) -> list[str | None]:
    """The names ``source`` reads from ``sys.modules``: each lookup's constant key, or None
    for a use whose key is not a constant (or that hands ``sys.modules`` itself on)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out: list[str | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "sys":
            out.extend(None for a in node.names if a.name == "modules")  # an alias hides every use
        is_modules = (
            isinstance(node, ast.Attribute)
            and node.attr == "modules"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )
        if not is_modules:
            continue
        parent = parents.get(node)
        key: ast.expr | None = None
        if isinstance(parent, ast.Subscript) and parent.value is node:
            key = parent.slice
        elif isinstance(parent, ast.Attribute) and isinstance(parents.get(parent), ast.Call):
            call = parents[parent]
            assert isinstance(call, ast.Call)
            key = call.args[0] if call.args else None
        elif isinstance(parent, ast.Compare) and isinstance(parent.ops[0], ast.In | ast.NotIn):
            key = parent.left
        out.append(key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None)
    return out


def test_the_sys_modules_finder_finds_every_kind_of_read() -> None:
    source = "\n".join(
        [
            "import sys",
            'a = sys.modules.get("graphpool.cupy")',
            'b = sys.modules["graphpool.torch"]',
            'c = "graphpool.numba" in sys.modules',
            'd = sys.modules.get("cupy")',
            "e = sys.modules.get(name)",
            "f = list(sys.modules)",
        ]
    )
    found = sys_modules_reads(source)
    assert sorted(k for k in found if k is not None) == [
        "cupy",
        "graphpool.cupy",
        "graphpool.numba",
        "graphpool.torch",
    ]
    assert found.count(None) == 2
    assert sys_modules_reads("from sys import modules") == [None]


def test_no_module_below_the_integrations_looks_graphpool_up_in_sys_modules() -> None:
    """Below the integrations a module may ask ``sys.modules`` only whether the program
    imported a framework (CuPy, to recognize its streams): a graphpool module it cannot
    import (an integration, a tool) it must not reach either. What the core needs of an
    integration the integration registers (``routing.add_follower``)."""
    wrong = []
    for name, path in MODULES.items():
        if layer_of(name) >= INTEGRATIONS or path.suffix != ".py":
            continue
        for key in sys_modules_reads(path.read_text()):
            if key is None or key.split(".")[0] == "graphpool":
                wrong.append(f"{name}: sys.modules[{key!r}]")
    assert wrong == []


ALLOCATOR_EXPORTS = {"CachingAllocator"}
"""What modules outside the policy may take from policy/allocator.py."""


def allocator_names_used(source: str) -> set[str]:
    """The names ``source`` takes from graphpool.policy.allocator: imported from it, or read
    as attributes of the module imported whole (``from graphpool.policy import allocator``)."""
    tree = ast.parse(source)
    names: set[str] = set()
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "graphpool.policy.allocator":
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "graphpool.policy":
            aliases.update(a.asname or a.name for a in node.names if a.name == "allocator")
        elif isinstance(node, ast.Import):
            # the module imported whole by its dotted name: any attribute path reaches it
            names.update("*" for a in node.names if a.name == "graphpool.policy.allocator")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names


def test_the_allocator_name_finder_sees_both_forms() -> None:
    source = "\n".join(
        [
            "from graphpool.policy.allocator import CachingAllocator, fmt_bytes",
            "from graphpool.policy import allocator as a",
            "a.__file__",
            "a._helper(1)",
        ]
    )
    assert allocator_names_used(source) == {"CachingAllocator", "fmt_bytes", "__file__", "_helper"}


def test_only_the_policy_reaches_into_the_allocator_module() -> None:
    """snapshot.py and the tools format bytes with policy/units.py, not with a helper of the
    allocator's module; build.py reads the module's ``__file__`` (which build runs)."""
    wrong = []
    for name, path in MODULES.items():
        if name.startswith("graphpool.policy") or path.suffix != ".py":
            continue
        extra = allocator_names_used(path.read_text()) - ALLOCATOR_EXPORTS - {"__file__"}
        if extra:
            wrong.append(f"{name}: {sorted(extra)}")
    assert wrong == []


def test_core_modules_look_up_no_integration_by_name() -> None:
    """No string constant below the integrations names an integration or tool module (a
    lookup by a name built elsewhere, ``importlib.import_module(NAME)``, is a reach-up too)."""
    above = {n for n in MODULES if layer_of(n) >= INTEGRATIONS}
    wrong = []
    for name, path in MODULES.items():
        if layer_of(name) >= INTEGRATIONS or path.suffix != ".py":
            continue
        for node in _nodes(ast.parse(path.read_text())):
            if not isinstance(node, ast.Constant) or node.value not in above:
                continue
            wrong.append(f"{name}: {node.value!r}")
    assert wrong == []


def test_stream_followers_are_registered_by_the_integration() -> None:
    """graphpool.cupy registers CuPy's stream follower at install and removes it at
    uninstall (the core asks the registry, never the integration's module)."""
    from graphpool import routing

    class Follower:
        framework = "fake"

        def follow(self, stream: object) -> None: ...

        def save(self, device: int) -> object:
            return None

        def restore(self, saved: object, device: int) -> None: ...

    f = Follower()
    assert not routing.following("fake")
    routing.add_follower(f)
    routing.add_follower(f)
    try:
        assert routing.followers().count(f) == 1 and routing.following("fake")
    finally:
        routing.remove_follower(f)
    assert f not in routing.followers() and not routing.following("fake")
