"""Build hook: compile the allocator's hot path with mypyc, or ship it as plain Python.

The policy (``graphpool/policy``) and the allocation call with its handle (``memory.py``,
``buffer.py``) are plain, fully typed Python that runs as is. Compiled by mypyc the same
source runs a cached malloc+free about 3.4x faster (benchmarks/NOTES.md), so an install
compiles them when it can: mypy comes from the build requirements, the C compiler from
the machine. Without a compiler, or with ``GRAPHPOOL_COMPILE=0``, the install is pure
Python and behaves identically. ``graphpool.compiled()`` says which one runs;
``graphpool.build.COMPILED`` names the same modules as ``COMPILED`` here (a test checks).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "src/graphpool/policy/block.py",
    "src/graphpool/policy/freelist.py",
    "src/graphpool/policy/pools.py",
    "src/graphpool/policy/stats.py",
    "src/graphpool/policy/private_pools.py",
    "src/graphpool/policy/logs.py",
    "src/graphpool/policy/heap.py",
    "src/graphpool/policy/captures.py",
    "src/graphpool/policy/stream_uses.py",
    "src/graphpool/policy/segments.py",
    "src/graphpool/policy/expandable.py",
    "src/graphpool/policy/reports.py",
    "src/graphpool/policy/allocator.py",
    "src/graphpool/routing.py",
    "src/graphpool/memory.py",
    "src/graphpool/buffer.py",
    "src/graphpool/hooks.py",
]


NATIVE = "src/graphpool/device/_capture"  # the C capture query and user objects (device layer)
LOCK = "src/graphpool/policy/_lock"  # the allocator's reentrant lock, in C (compiled builds only)
# PyTorch's allocator entry points (graphpool.torch): C++, and optional on its own, so a
# machine without a C++ compiler still gets the compiled policy.
TORCH_SHIM = "src/graphpool/_torch_shim"

RECORD = "src/graphpool/_compiled_sources.json"  # read by graphpool.build.stale()


def _clear_in_tree() -> None:
    """Remove compiled modules an earlier editable install left next to the sources."""
    stems = [path[: -len(".py")] for path in COMPILED]
    stems += ["src/graphpool/_native__mypyc", NATIVE, LOCK, TORCH_SHIM]
    for stem in stems:
        for path in glob.glob(f"{stem}.*.so") + glob.glob(f"{stem}.*.pyd"):
            os.remove(path)
    if os.path.exists(RECORD):
        os.remove(RECORD)


def _record_sources() -> None:
    """Compiled modules now sit next to their sources: note what they were built from."""
    digests = {}
    for path in COMPILED:
        with open(path, "rb") as fh:
            name = path.removeprefix("src/graphpool/").removesuffix(".py")
            digests[name] = hashlib.sha256(fh.read()).hexdigest()
    with open(RECORD, "w") as fh:
        json.dump(digests, fh, indent=1, sort_keys=True)


class OptionalBuildExt(build_ext):
    """Build the compiled modules if possible; on any failure keep the pure-Python install.

    All or nothing: the compiled modules share one runtime library, so if any of them
    fails to build the others are removed and every module stays plain Python.
    """

    def run(self) -> None:
        in_tree = self.inplace or self.editable_mode
        try:
            super().run()
            if self.editable_mode:  # `pip install -e`: the source tree is what gets imported
                self.copy_extensions_to_source()
            if in_tree and self.extensions:
                _record_sources()
            return
        except Exception as e:  # no compiler, no headers: the .py files serve
            print(f"graphpool: not compiled ({e}); installing the pure-Python modules", file=sys.stderr)
        _clear_in_tree()
        for ext in self.extensions:
            built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
            for path in (self.get_ext_fullpath(ext.name), built):
                if os.path.exists(path):
                    os.remove(path)


def _source_docstrings() -> dict[tuple[str, str | None, str | None], str]:
    """Docstrings of the compiled modules' functions, classes and methods, read from source.

    Keyed (module, class or None, function or None).
    """
    import ast

    docs: dict[tuple[str, str | None, str | None], str] = {}

    def functions(body: list[ast.stmt], module: str, cls: str | None) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs[(module, cls, node.name)] = doc

    for path in COMPILED:
        module = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        functions(tree.body, module, None)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs[(module, node.name, None)] = doc
                functions(node.body, module, node.name)
    return docs


def _c_string(text: str) -> str:
    """``text`` as the body of a C string literal (UTF-8; octal escapes, never hex)."""
    out = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        if ch == "\\" or ch == '"':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif 32 <= byte < 127 and ch != "?":  # "?" avoids trigraphs
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return "".join(out)


_METHOD_DOC = re.compile(
    r"\(PyCFunction\)CPyPy_(?P<cname>\w+),(?P<flags>[\s\w|]+),\s*"
    r'PyDoc_STR\((?:"(?P<sig>(?:[^"\\]|\\.)*?)\\n--\\n\\n"|NULL)\)'
)
_CLASS_DOC = re.compile(
    r'\.tp_name = "(?P<name>\w+)",(?P<between>[^;]*?)\.tp_doc = '
    r'PyDoc_STR\((?:"(?P<sig>(?:[^"\\]|\\.)*?)\\n--\\n\\n"|NULL)\)'
)


def _keep_docstrings(sources: list[str]) -> None:
    """Put the docstrings back into mypyc's generated C, so help() works compiled.

    mypyc 2.4 gives a compiled function, method or class only its text signature as
    ``__doc__`` (and a compiled function's ``__doc__`` cannot be set afterwards). Each
    sits in the C source as ``PyDoc_STR("sig\n--\n\n")`` next to the C name of its
    function, or the ``tp_name`` of its class; this appends the source's docstring in
    CPython's layout (signature, a line ``--``, a blank line, the docstring). mypyc names
    a function ``CPyPy_<module>___<Class>___<name>`` with the module's last part. The
    build requirements pin mypy; should its C change shape, the patterns simply match
    nothing and the build keeps mypyc's own docstrings.
    """
    docs = _source_docstrings()
    by_c_prefix: dict[str, str] = {}
    by_class: dict[str, list[str]] = {}
    for (module, cls, name), doc in docs.items():
        short = module.rsplit(".", 1)[-1]
        if name is None and cls is not None:
            by_class.setdefault(cls, []).append(doc)
        else:
            by_c_prefix["___".join(p for p in (short, cls, name) if p)] = doc

    def literal(sig: str | None, doc: str | None) -> str | None:
        if not doc:
            return None
        head = f"{sig}\\n--\\n\\n" if sig is not None else ""
        return f'PyDoc_STR("{head}{_c_string(doc)}")'

    def method(m: re.Match[str]) -> str:
        new = literal(m["sig"], by_c_prefix.get(m["cname"]))
        if new is None:
            return m[0]
        return m[0][: m.start("flags") - m.start()] + m["flags"] + ", " + new

    def klass(m: re.Match[str]) -> str:
        found = by_class.get(m["name"], [])
        new = literal(m["sig"], found[0] if len(found) == 1 else None)
        if new is None:
            return m[0]
        return f'.tp_name = "{m["name"]}",{m["between"]}.tp_doc = {new}'

    for path in sources:
        if not path.endswith(".c") or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        patched = _CLASS_DOC.sub(klass, _METHOD_DOC.sub(method, text))
        if patched != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(patched)


def _ext_modules() -> list:  # type: ignore[type-arg]
    if os.environ.get("GRAPHPOOL_COMPILE", "1") == "0":
        _clear_in_tree()
        return []
    try:
        from mypyc.build import mypycify

        # The build environment holds mypy only: the modules the compiled ones import (numpy,
        # cuda.bindings, frameworks) are absent there and typed as Any. `--config-file ""`
        # leaves pyproject's [tool.mypy] out: that is the strict lint, where such Anys are
        # errors, and an error here would quietly install the pure-Python modules.
        args = ["--config-file", "", "--ignore-missing-imports", *COMPILED]
        mods = mypycify(args, opt_level="3", group_name="graphpool._native")
        try:
            _keep_docstrings([src for ext in mods for src in ext.sources])
        except Exception as e:  # the docstrings are a convenience: never lose the compiled build
            print(f"graphpool: compiled without docstrings ({e!r})", file=sys.stderr)
    except BaseException as e:  # mypy missing, or it refused the source: stay pure Python
        print(f"graphpool: not compiled ({e!r}); installing the pure-Python modules", file=sys.stderr)
        _clear_in_tree()
        return []
    from setuptools import Extension

    libs = [] if sys.platform == "win32" else ["dl"]
    return [
        *mods,
        Extension("graphpool.device._capture", [NATIVE + ".c"], libraries=libs),
        Extension("graphpool.policy._lock", [LOCK + ".c"]),
        # optional: a failed build only warns, and an in-place or editable build skips copying it
        Extension("graphpool._torch_shim", [TORCH_SHIM + ".cpp"], language="c++", optional=True),
    ]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
