"""The three mutants issue 14 found alive, applied one at a time to a copy of src/.

Run from the repository root: ``python benchmarks/mutants_issue14.py``. Each mutant must
make the named tests fail (killed); the unmutated copy must pass them.

``--checks``: also drop each ``_expect`` of policy/check.py in turn (one mutant per
check) and run tests/policy/test_check.py against it: each must be killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

MUTANTS = [
    (
        "record_stream's event on the block's own stream",
        "src/graphpool/policy/allocator.py",
        "self._record_event(ev, s)",
        "self._record_event(ev, block.stream)",
        ["tests/policy/test_stream_events.py", "tests/test_record_stream_race.py"],
    ),
    (
        "inactive_split peak not raised within an epoch",
        "src/graphpool/policy/stats.py",
        "            k.inactive_split_run = c\n",
        "            pass\n",
        ["tests/policy/test_stream_events.py"],
    ),
    (
        "inactive_split_bytes peak not raised within an epoch",
        "src/graphpool/policy/stats.py",
        "            k.inactive_split_bytes_run = c\n",
        "            pass\n",
        ["tests/policy/test_stream_events.py"],
    ),
    (
        "adjacent-free-blocks-merged check dropped",
        "src/graphpool/policy/check.py",
        '                _expect(not both_free, "two adjacent free blocks were not merged")\n',
        "",
        ["tests/policy/test_check.py"],
    ),
]


# Survivors that no corruption can kill: the check cannot fail unless an earlier one does.
EQUIVALENT = {
    "check dropped: f'{scope} {key}current negative'",  # current == the blocks' tally >= 0 first
}


def run(src: str, tests: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, env=env, capture_output=True).returncode


def check_mutants() -> list[tuple[str, str, str, str, list[str]]]:
    """One mutant per ``_expect`` call in check.py: that call made a no-op."""
    import ast

    path = "src/graphpool/policy/check.py"
    text = open(path).read()
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_expect":
            line = lines[node.lineno - 1]
            col = node.col_offset
            assert line[col : col + 8] == "_expect("
            # make the whole file the "old" text so the site is unique
            new_line = line[:col] + "(lambda *_: None)(" + line[col + 8 :]
            new_text = "".join(lines[: node.lineno - 1] + [new_line] + lines[node.lineno :])
            msg = ast.unparse(node.args[1])[:60]
            tests = ["tests/policy/test_check.py::test_checker_catches"]  # behaviour, not the count
            out.append((f"check dropped: {msg}", path, text, new_text, tests))
    return out


def main() -> int:
    if "--checks" in sys.argv:
        MUTANTS.extend(check_mutants())
    bad = 0
    for name, path, old, new, tests in MUTANTS:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree("src", os.path.join(tmp, "src"))
            target = os.path.join(tmp, path)
            text = open(target).read()
            assert text.count(old) == 1, f"{name}: mutation site not found once in {path}"
            open(target, "w").write(text.replace(old, new))
            rc = run(os.path.join(tmp, "src"), tests)
        verdict = "killed" if rc != 0 else "SURVIVED"
        if rc == 0 and name in EQUIVALENT:
            verdict = "equivalent"
        bad += rc == 0 and name not in EQUIVALENT
        print(f"{verdict:9} {name}")
    baseline = run("src", sorted({t.split("::")[0] for m in MUTANTS for t in m[4]}))
    print(f"unmutated: {'pass' if baseline == 0 else 'FAIL'}")
    return 1 if bad or baseline else 0


if __name__ == "__main__":
    sys.exit(main())
