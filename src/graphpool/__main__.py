"""Command line: ``python -m graphpool demo | bench | snapshot``."""

from __future__ import annotations

import argparse
import sys


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
            p.add_argument("--quick", action="store_true", help="small iteration counts (CI smoke test)")
            p.add_argument(
                "--json",
                nargs="?",
                const="-",
                default=None,
                metavar="PATH",
                help="print the results as JSON instead of a table; with PATH, write the JSON "
                "there and print the table",
            )
            p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
        if name == "snapshot":
            p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from graphpool.demo import run

        return run(args.backend)
    if args.command == "bench":
        from graphpool.bench import run as bench

        as_json = args.json == "-"
        return bench(
            args.backend,
            quick=args.quick,
            json_path=None if as_json else args.json,
            as_json=as_json,
            progress=not args.no_progress,
        )
    from graphpool.snapshot import run_cli

    return run_cli(args.backend, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
