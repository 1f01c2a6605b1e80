"""Command line: ``python -m graphpool demo | bench | snapshot``."""

from __future__ import annotations

import argparse
import sys

from graphpool.errors import BackendUnavailableError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("demo", "the seed's scenarios with their memory figures"),
        ("bench", "allocator and graph benchmarks"),
        ("snapshot", "a small workload's memory snapshot and summary"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--backend",
            choices=("cuda", "sim"),
            default=None,
            help="default: cuda when a GPU is usable, else sim",
        )
        if name == "bench":
            p.add_argument("--quick", action="store_true", help="fewer repetitions")
            p.add_argument("--json", default=None, help="also write the results to this file")
        if name == "snapshot":
            p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except BackendUnavailableError as exc:  # no GPU here: one line that says so, no traceback
        print(f"python -m graphpool: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    """Run the chosen command."""
    if args.command == "demo":
        from graphpool.demo import run

        return run(args.backend)
    if args.command == "bench":
        from graphpool.bench import run as bench

        return bench(args.backend, quick=args.quick, json_path=args.json)
    from graphpool.snapshot import run_cli

    return run_cli(args.backend, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
