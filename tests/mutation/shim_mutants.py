# ruff: noqa: E501  (the mutants are source lines, quoted whole)
"""Hand-made mutants of the PyTorch shim's native lane (src/graphpool/_torch_shim.cpp), stop 18.

Each entry: (id, where, old text, new text, occurrence) -- ``occurrence`` picks which of
several identical texts is changed (0-based), None where the text is unique. Write one
mutant's source with ``python tests/mutation/shim_mutants.py ID OUT.cpp``; tests/mutation/README.md
("stop 18") says how each was built and run. Not a test: nothing here runs in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parents[2] / "src" / "graphpool" / "_torch_shim.cpp"

MUTANTS: list[tuple[str, str, str, str, int | None]] = [
    (
        "C01",
        "lane_malloc",
        "if (device < 0 || device >= kLanes || size == 0 || !g_lanes_enabled",
        "if (device < 0 || size == 0 || !g_lanes_enabled",
        None,
    ),
    ("C02", "lane_malloc", "|| size == 0 || !g_lanes_enabled", "|| !g_lanes_enabled", None),
    (
        "C03",
        "lane_malloc",
        "size == 0 || !g_lanes_enabled.load(std::memory_order_relaxed)) {",
        "size == 0) {",
        None,
    ),
    (
        "C04",
        "lane_malloc first check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        0,
    ),
    (
        "C05",
        "lane_malloc first check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (!l.on || l.requested != size || l.stream != stream) {",
        0,
    ),
    (
        "C06",
        "lane_malloc first check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (!l.on || l.state != LANE_PARKED || l.stream != stream) {",
        0,
    ),
    (
        "C07",
        "lane_malloc first check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size) {",
        0,
    ),
    (
        "C08",
        "lane_malloc second check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (false) {",
        1,
    ),
    (
        "C09",
        "lane_malloc second check",
        "if (!l.on || l.state != LANE_PARKED || l.requested != size || l.stream != stream) {",
        "if (!l.on || l.requested != size || l.stream != stream) {",
        1,
    ),
    ("C10", "lane_malloc legacy", "if (!is_legacy(stream)) {", "if (false) {", None),
    ("C11", "is_legacy", "return (uintptr_t)stream <= 1;", "return (uintptr_t)stream < 1;", None),
    ("C12", "is_legacy", "return (uintptr_t)stream <= 1;", "return (uintptr_t)stream <= 2;", None),
    (
        "C13",
        "lane_malloc query",
        "if (query == nullptr || query(stream, &id) != 0 || id != 0) {",
        "if (query != nullptr && (query(stream, &id) != 0 || id != 0)) {",
        None,
    ),
    (
        "C14",
        "lane_malloc query",
        "if (query == nullptr || query(stream, &id) != 0 || id != 0) {",
        "if (query == nullptr || (query(stream, &id), id != 0)) {",
        None,
    ),
    (
        "C15",
        "lane_malloc query",
        "if (query == nullptr || query(stream, &id) != 0 || id != 0) {",
        "if (query == nullptr || query(stream, &id) != 0) {",
        None,
    ),
    ("C16", "lane_malloc", "    l.state = LANE_LIVE;\n    l.hits++;", "    l.hits++;", None),
    ("C17", "lane_malloc", "    l.state = LANE_LIVE;\n    l.hits++;", "    l.state = LANE_LIVE;", None),
    (
        "C18",
        "lane_free",
        "if (device < 0 || device >= kLanes || !g_lanes_enabled.load(std::memory_order_relaxed)) {\n"
        "        return false;",
        "if (device < 0 || device >= kLanes) {\n        return false;",
        None,
    ),
    (
        "C19",
        "lane_free",
        "if (!l.on || l.state != LANE_LIVE || l.ptr != ptr) {",
        "if (l.state != LANE_LIVE || l.ptr != ptr) {",
        None,
    ),
    (
        "C20",
        "lane_free",
        "if (!l.on || l.state != LANE_LIVE || l.ptr != ptr) {",
        "if (!l.on || l.ptr != ptr) {",
        None,
    ),
    (
        "C21",
        "lane_free",
        "if (!l.on || l.state != LANE_LIVE || l.ptr != ptr) {",
        "if (!l.on || l.state != LANE_LIVE) {",
        None,
    ),
    ("C22", "lane_free", "    l.state = LANE_PARKED;\n    return true;", "    return true;", None),
    (
        "C23",
        "lane_free",
        "    l.state = LANE_PARKED;\n    return true;",
        "    l.state = LANE_PARKED;\n    return false;",
        None,
    ),
    ("C24", "lane_park", "    l.state = LANE_PARKED;\n    l.on = true;", "    l.state = LANE_PARKED;", None),
    (
        "C25",
        "lane_park",
        "    l.state = LANE_PARKED;\n    l.on = true;",
        "    l.state = LANE_LIVE;\n    l.on = true;",
        None,
    ),
    ("C26", "lane_park", "    l.requested = requested;\n", "    l.requested = requested + 1;\n", None),
    (
        "C27",
        "lane_park",
        "    l.stream = stream;\n    l.state = LANE_PARKED;",
        "    l.state = LANE_PARKED;",
        None,
    ),
    (
        "C28",
        "lane_park",
        "    if (device < 0 || device >= kLanes) {\n        return;",
        "    if (device < 0) {\n        return;",
        None,
    ),
    ("C29", "lane_take", "live = l.state == LANE_LIVE;", "live = l.state != LANE_EMPTY;", None),
    ("C30", "lane_take", "live = l.state == LANE_LIVE;", "live = false;", None),
    ("C31", "lane_take", "        l.state = LANE_EMPTY;\n        l.hits = 0;", "        l.hits = 0;", None),
    (
        "C32",
        "lane_take",
        "        l.state = LANE_EMPTY;\n        l.hits = 0;",
        "        l.state = LANE_EMPTY;",
        None,
    ),
    ("C33", "lane_take", "hits = l.hits;", "hits = l.hits ? 1 : 0;", None),
    ("C34", "lanes_off", "        l.on = false;", "        l.on = true;", None),
    (
        "C35",
        "free hook",
        "|| ptr == nullptr || lane_free(ptr, device)) {",
        "|| lane_free(ptr, device)) {",
        None,
    ),
    ("C36", "free hook", "|| ptr == nullptr || lane_free(ptr, device)) {", "|| ptr == nullptr) {", None),
    ("C37", "free hook", "} else if (PyLong_Check(r)) {", "} else if (false) {", None),
    ("C38", "free hook", "} else if (requested != 0) {", "} else {", None),
    (
        "C39",
        "free hook",
        "lane_park(ptr, (size_t)requested, device, stream);",
        "lane_park(ptr, size, device, stream);",
        None,
    ),
    (
        "C40",
        "free hook",
        "if (requested == (unsigned long long)-1 && PyErr_Occurred()) {\n                PyErr_Clear();",
        "if (false) {\n                PyErr_Clear();",
        None,
    ),
    (
        "C41",
        "lane_take",
        "if ((device == -1 && PyErr_Occurred()) || device_arg((int)device) < 0) {",
        "if (device == -1 && PyErr_Occurred()) {",
        0,
    ),
]

# Stop 19: the CuPy entry points (graphpool_cupy_malloc/free) and the lane's framework kind.
KIND_CHECK = "l.stream != stream || l.kind != kind) {"
CUPY_PARK = "lane_park(ptr, (size_t)requested, device, nullptr, KIND_CUPY);"
CUPY_FREE_GUARD = "|| ptr == nullptr || ptr == kFailed || lane_free(ptr, device)) {"
MUTANTS += [
    ("D01", "lane_malloc first check", KIND_CHECK, "l.stream != stream) {", 0),
    ("D02", "lane_malloc second check", KIND_CHECK, "l.stream != stream) {", 1),
    ("D03", "lane_park", "if (kind == KIND_CUPY) {", "if (false) {", None),
    ("D04", "lane_park", "if (l.cupy_ptr != ptr) {", "if (false) {", None),
    ("D05", "lane_park", "stream = l.cupy_stream;", "", None),
    ("D06", "lane_park", "    l.kind = kind;\n", "", None),
    ("D07", "lane_note_cupy", "    l.cupy_ptr = ptr;\n", "", None),
    ("D08", "lane_note_cupy", "    l.cupy_stream = stream;\n", "", None),
    (
        "D09",
        "cupy_malloc",
        "if (g_cupy_malloc == nullptr || g_cupy_stream == nullptr) {",
        "if (g_cupy_malloc == nullptr) {",
        None,
    ),
    ("D10", "cupy_malloc", "if (raw == -1 && PyErr_Occurred()) {", "if (false) {", None),
    ("D11", "cupy_malloc", "if (raw == -1 && PyErr_Occurred()) {", "if (raw == -1) {", None),
    (
        "D12",
        "cupy_malloc",
        "    if (p != nullptr) {\n        return p;\n    }\n    PyObject *args[3];",
        "    PyObject *args[3];",
        None,
    ),
    (
        "D13",
        "cupy_malloc",
        "    if (r == nullptr) {\n        return kFailed;",
        "    if (false) {\n        return kFailed;",
        None,
    ),
    (
        "D14",
        "cupy_malloc",
        "    Py_DECREF(r);\n    if (PyErr_Occurred()) {",
        "    Py_DECREF(r);\n    if (false) {",
        None,
    ),
    ("D15", "cupy_malloc", "if (p == nullptr || p == kFailed) {", "if (p == nullptr) {", None),
    ("D16", "cupy_malloc", "if (p == nullptr || p == kFailed) {", "if (p == kFailed) {", None),
    ("D17", "cupy_malloc", "    lane_note_cupy(p, device, stream);\n", "", None),
    (
        "D18",
        "cupy_malloc",
        "void *p = lane_malloc(size, device, stream, KIND_CUPY);",
        "void *p = lane_malloc(size, device, stream, KIND_TORCH);",
        None,
    ),
    (
        "D19",
        "cupy_free",
        "    if (g_cupy_free == nullptr) {\n        return;",
        "    if (false) {\n        return;",
        None,
    ),
    (
        "D20",
        "cupy_free",
        "    if (r == nullptr) {\n        PyErr_WriteUnraisable",
        "    if (false) {\n        PyErr_WriteUnraisable",
        None,
    ),
    ("D21", "cupy_free", "    if (PyLong_Check(r)) { /* parked", "    if (false) { /* parked", None),
    (
        "D22",
        "cupy_free",
        "} else if (requested != 0) {\n            " + CUPY_PARK,
        "} else {\n            " + CUPY_PARK,
        None,
    ),
    (
        "D23",
        "cupy_free",
        "            PyErr_Clear();\n        } else if (requested != 0) {\n            lane_park(ptr, (size_t)requested, device, nullptr",
        "        } else if (requested != 0) {\n            lane_park(ptr, (size_t)requested, device, nullptr",
        None,
    ),
    ("D24", "cupy_free", CUPY_PARK, "lane_park(ptr, (size_t)requested, device, nullptr, KIND_TORCH);", None),
    ("D25", "graphpool_cupy_free", CUPY_FREE_GUARD, "|| ptr == nullptr || lane_free(ptr, device)) {", None),
    ("D26", "graphpool_cupy_free", CUPY_FREE_GUARD, "|| ptr == kFailed || lane_free(ptr, device)) {", None),
    ("D27", "graphpool_cupy_free", CUPY_FREE_GUARD, "|| ptr == nullptr || ptr == kFailed) {", None),
    (
        "D28",
        "graphpool_cupy_free",
        "if (g_closed || !Py_IsInitialized() || ptr == nullptr || ptr == kFailed",
        "if (!Py_IsInitialized() || ptr == nullptr || ptr == kFailed",
        None,
    ),
    (
        "D29",
        "set_cupy_hooks",
        "if (!PyCallable_Check(m) || !PyCallable_Check(f)) {",
        "if (!PyCallable_Check(m)) {",
        1,
    ),
    (
        "D30",
        "set_cupy_hooks",
        "if (!PyCallable_Check(m) || !PyCallable_Check(f)) {",
        "if (!PyCallable_Check(f)) {",
        1,
    ),
    (
        "D31",
        "set_cupy_hooks",
        "    if (fn == nullptr) {\n        PyErr_Clear();",
        "    if (false) {\n        PyErr_Clear();",
        None,
    ),
    (
        "D32",
        "set_cupy_hooks",
        "PyCapsule_IsValid(capsule, kStreamSignature) ?",
        "PyCapsule_IsValid(capsule, nullptr) ?",
        None,
    ),
    ("D33", "set_cupy_hooks", "    g_closed = 0;\n", "", 1),
    ("D34", "close", "    g_cupy_stream = nullptr;\n    Py_RETURN_NONE;", "    Py_RETURN_NONE;", None),
    ("D35", "lane_state", 'l.kind == KIND_CUPY ? "cupy" : "torch"', '"cupy"', None),
    (
        "D36",
        "torch malloc",
        "void *p = lane_malloc(size, device, stream, KIND_TORCH);",
        "void *p = lane_malloc(size, device, stream, KIND_CUPY);",
        None,
    ),
    (
        "D37",
        "torch free",
        "lane_park(ptr, (size_t)requested, device, stream, KIND_TORCH);",
        "lane_park(ptr, (size_t)requested, device, stream, KIND_CUPY);",
        None,
    ),
]


def mutate(source: str, ident: str) -> str:
    """``source`` with mutant ``ident`` applied."""
    for i, _where, old, new, occ in MUTANTS:
        if i != ident:
            continue
        parts = source.split(old)
        if occ is None:
            if len(parts) != 2:
                raise ValueError(f"{ident}: the text is not unique in the shim")
            return new.join(parts)
        if len(parts) <= occ + 1:
            raise ValueError(f"{ident}: occurrence {occ} missing")
        return old.join(parts[: occ + 1]) + new + old.join(parts[occ + 1 :])
    raise KeyError(ident)


if __name__ == "__main__":
    ident, out = sys.argv[1:3]
    Path(out).write_text(mutate(SHIM.read_text(), ident))
