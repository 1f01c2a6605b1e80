"""The three mutants issue 14 found alive, applied one at a time to a copy of src/.

Run from the repository root: ``python benchmarks/mutants_issue14.py``. Each mutant must
make the named tests fail (killed); the unmutated copy must pass them.
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


def run(src: str, tests: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, env=env, capture_output=True).returncode


def main() -> int:
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
        bad += rc == 0
        print(f"{verdict:9} {name}")
    baseline = run("src", sorted({t for m in MUTANTS for t in m[4]}))
    print(f"unmutated: {'pass' if baseline == 0 else 'FAIL'}")
    return 1 if bad or baseline else 0


if __name__ == "__main__":
    sys.exit(main())
