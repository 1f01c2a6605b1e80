"""Hand-made mutants of issue 28, item 1, each against the tests written to kill it.

Run by hand from the repository root (never by CI: no file here is a test):

    PYTHONPATH=src python tests/mutation/handmade.py            # every mutant
    PYTHONPATH=src python tests/mutation/handmade.py takeover   # those whose name has "takeover"

For each mutant: the source is checked to pass its tests, the one edit is applied in place
(its ``old`` text must occur exactly once), the tests are run (killed: they fail), and the
file is written back byte for byte, then its tests are run again (they must pass). Prints a
markdown table (tests/mutation/handmade-2026-12-04.md holds the last one).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    behaviour: str
    file: str  # relative to src/graphpool
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    label: str = ""  # the edit in words, for the table (default: old -> new)


ALLOC = "policy/allocator.py"
T_TAKE = "tests/policy/test_stream_takeover.py::"
T_EXP = "tests/test_expandable_rules.py::"
T_GC = "tests/policy/test_gc_and_limits.py::"
T_SB = "tests/test_streams_buffers.py::"
T_FID = "tests/sim/test_fidelity.py::"
T_CUPY = "tests/test_twin_cupy_capture.py::"

MUTANTS = (
    Mutant(
        "takeover: a block freed right after its stream's idle answer counted as covered",
        ALLOC,
        "return b.stream == stream or b.gc_base < done.get(b.stream, 0)",
        "return b.stream == stream or b.gc_base <= done.get(b.stream, 0)",
        (T_TAKE + "test_a_block_freed_after_its_streams_idle_answer_needs_a_new_answer",),
    ),
    Mutant(
        "takeover: an idle answer stamped one tick late",
        ALLOC,
        "                        done[t] = now\n",
        "                        done[t] = now + 1\n",
        (T_TAKE + "test_a_block_freed_after_its_streams_idle_answer_needs_a_new_answer",),
    ),
    Mutant(
        "takeover: growing a segment absorbs another stream's busy free tail",
        ALLOC,
        "tail.size < size and tail.stream == stream",
        "tail.size < size",
        (T_TAKE + "test_growing_a_segment_never_absorbs_another_streams_free_tail",),
    ),
    Mutant(
        "takeover: max_split_size ignored",
        ALLOC,
        "                    if total < self._max_split or not self._refuses(total, size):\n"
        "                        best, best_size = first, total",
        "                    if True:\n                        best, best_size = first, total",
        (T_TAKE + "test_takeover_keeps_max_split_size",),
    ),
    Mutant(
        "expandable: the first segment of a stream skips the limits",
        ALLOC,
        "if need > reserve or not self._map_allowed(need):",
        "if need > reserve:",
        (T_EXP + "test_a_limit_refuses_the_mapping_of_an_expandable_segment",),
    ),
    Mutant(
        "expandable: a mapping checked against the byte cap only (the fraction skipped)",
        ALLOC,
        'as ``_device_malloc`` does)."""\n        limits = self.limits\n'
        '        if limits.cap is not None and self.stats.current("reserved_bytes") + nbytes > limits.cap:',
        'as ``_device_malloc`` does)."""\n        limits = self.limits\n'
        "        if limits.nbytes is not None and "
        'self.stats.current("reserved_bytes") + nbytes > limits.nbytes:',
        (T_EXP + "test_a_limit_refuses_the_mapping_of_an_expandable_segment",),
        "`_map_allowed` tests `limits.nbytes` instead of `limits.cap`",
    ),
    Mutant(
        "expandable: empty_cache unmaps a free end that a graph still keeps",
        ALLOC,
        "if tail.allocated or tail.holds or tail.prev is None:",
        "if tail.allocated or tail.prev is None:",
        (T_EXP + "test_empty_cache_keeps_a_free_end_a_graph_still_writes",),
    ),
    Mutant(
        "GC: blocks of equal age never collected (>= vs >)",
        ALLOC,
        "if age >= threshold_age:",
        "if age > threshold_age:",
        (T_GC + "test_segments_of_equal_age_are_collected",),
    ),
    Mutant(
        "GC: the threshold measured against the binding cap instead of the fraction's",
        ALLOC,
        "cap = self.limits.fraction_bytes()",
        "cap = self.limits.cap",
        (T_GC + "test_the_threshold_is_a_share_of_the_fraction_not_of_a_smaller_byte_limit",),
    ),
    Mutant(
        "limits: the fraction cap rounded up instead of truncated",
        "policy/limits.py",
        "else int(self.fraction * self.total)",
        "else math.ceil(self.fraction * self.total)",
        (
            T_GC + "test_the_fraction_cap_is_truncated",
            T_GC + "test_a_segment_one_byte_past_the_truncated_fraction_is_refused",
        ),
    ),
    Mutant(
        "streams: an invalidated capture reads as not capturing",
        "streams.py",
        "return self._dev().capture_info(self.handle)[0] != CAPTURE_STATUS_NONE",
        "return self._dev().capture_info(self.handle)[0] == 1  # ACTIVE only",
        (T_SB + "test_an_invalidated_capture_still_reads_as_capturing",),
    ),
    Mutant(
        "buffers: deepcopy copies on the legacy stream, unordered after the source's stream",
        "buffer.py",
        "self._alloc.device.memcpy(out.ptr, self.ptr, self.nbytes, self.stream.handle)",
        "self._alloc.device.memcpy(out.ptr, self.ptr, self.nbytes, 0)",
        (T_SB + "test_deepcopy_copies_after_the_work_queued_on_the_buffers_stream",),
    ),
    Mutant(
        "indirect: gp.alloc(n, s) reuses the previous stream's home",
        "memory.py",
        "if seen is not None and seen.stream is s:",
        "if seen is not None:",
        (T_SB + "test_alloc_on_a_stream_allocates_for_that_stream_whatever_came_before",),
    ),
    Mutant(
        "indirect: Event.record does not tell the replay checker",
        "streams.py",
        "        for listener in record_listeners:\n            listener(self, s)",
        "        for listener in ():\n            listener(self, s)",
        (T_SB + "test_a_recorded_event_orders_replays_for_the_checker",),
    ),
    Mutant(
        "indirect: the OOM retry releases the cache without waiting for the events first",
        ALLOC,
        "        self._synchronize_events()\n        block = fl.best_fit(stream, size, self._max_split)",
        "        block = fl.best_fit(stream, size, self._max_split)",
        (
            "tests/policy/test_stream_events.py::test_out_of_memory_waits_for_the_events_before_it_releases_the_cache",
        ),
    ),
)


def run(tests: tuple[str, ...]) -> bool:
    """Whether ``tests`` pass."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest could not run {tests}: rc {done.returncode}\n{done.stdout[-2000:]}")
    return done.returncode == 0


def main(selector: str = "") -> int:
    rows = ["| behaviour | test(s) | mutant | killed |", "| --- | --- | --- | --- |"]
    bad = 0
    for m in MUTANTS:
        if selector and selector not in m.behaviour:
            continue
        path = ROOT / "src" / "graphpool" / m.file
        original = path.read_bytes()
        text = original.decode()
        if text.count(m.old) != 1:
            found = text.count(m.old)
            raise RuntimeError(f"{m.behaviour}: the mutant's text occurs {found} times in {m.file}")
        if not run(m.tests):
            raise RuntimeError(f"{m.behaviour}: the tests fail on the unmutated source")
        try:
            path.write_text(text.replace(m.old, m.new))
            killed = not run(m.tests)
        finally:
            path.write_bytes(original)
        if not run(m.tests):
            raise RuntimeError(f"{m.behaviour}: the tests fail after the source was restored")
        bad += not killed
        names = "<br>".join(f"`{t.rsplit('::', 1)[-1]}`" for t in m.tests)
        edit = f"{m.file}: " + (m.label or f"`{_one_line(m.old)}` -> `{_one_line(m.new)}`")
        rows.append(f"| {m.behaviour} | {names} | {edit} | {'yes' if killed else '**no**'} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 1 if bad else 0


def _one_line(code: str) -> str:
    return " ".join(code.split()).replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
