"""Command line: ``python -m graphpool demo | bench | snapshot`` (also installed as ``graphpool``)."""

from __future__ import annotations

import argparse
import sys

from graphpool.errors import BackendUnavailableError

DESCRIPTION = """\
graphpool: a stream-aware caching allocator for CUDA device memory, with private
memory pools for CUDA graph capture. Without a GPU everything runs on a simulated
device on the CPU.
"""

EPILOG = """\
Every command takes --backend cuda or --backend sim; without it graphpool uses the GPU
when one is usable and the simulator otherwise (the GRAPHPOOL_BACKEND environment
variable sets the default too). Run 'python -m graphpool COMMAND --help' for a
command's options.
"""


def version() -> str:
    """The installed distribution's version, or the source tree's when not installed."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("graphpool")
    except (ImportError, PackageNotFoundError):
        from graphpool import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m graphpool`` (separate so tests can read its help)."""
    parser = argparse.ArgumentParser(
        prog="python -m graphpool",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"graphpool {version()}")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("demo", "run the example scenarios and print what each one measured"),
        ("bench", "time the allocator and graph replays (against CuPy when it is installed)"),
        ("snapshot", "print the memory snapshot and summary of a small workload"),
    ):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument(
            "--backend",
            choices=("cuda", "sim"),
            default=None,
            help="where to run: cuda (a GPU) or sim (the simulated device); "
            "default: cuda when a GPU is usable, else sim",
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
            p.add_argument("--json", action="store_true", help="print the snapshot as JSON instead of text")
    return parser


def snapshot(backend: str | None, as_json: bool = False) -> int:
    """Make a few eager buffers and one graph, then print the snapshot and the summary."""
    import graphpool as gp
    from graphpool import runtime
    from graphpool.snapshot import render_snapshot

    if backend is not None:
        gp.set_backend(backend)
    keep = [gp.alloc(n) for n in (100, 4096, 3 << 20)]
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        out = gp.alloc(1 << 20)
        runtime.get().device(s.device).memset(out.ptr, 0, out.nbytes, s.handle)
        keep.append(out)
        g.capture_end()
    print(render_snapshot(gp.memory_snapshot(), as_json))
    if not as_json:
        print()
        print(gp.memory_summary())
    del keep, g
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = build_parser().parse_args(argv)
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

        as_json = args.json == "-"
        return bench(
            args.backend,
            quick=args.quick,
            json_path=None if as_json else args.json,
            as_json=as_json,
            progress=not args.no_progress,
        )
    return snapshot(args.backend, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
