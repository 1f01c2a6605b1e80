"""Command line: ``python -m graphpool demo | bench | snapshot`` (also installed as ``graphpool``)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import NoReturn

from graphpool.errors import BackendUnavailableError

DESCRIPTION = """\
graphpool: a stream-aware caching allocator for CUDA device memory, with private
memory pools for CUDA graph capture. Without a GPU everything runs on a simulated
device on the CPU.
"""

EPILOG = """\
Every command takes --backend cuda or --backend sim, before or after the command's name;
without it graphpool uses the GPU when one is usable and the simulator otherwise (the
GRAPHPOOL_BACKEND environment variable sets the default too). Run
'python -m graphpool COMMAND --help' for a command's options.
"""

PROG = "python -m graphpool"
BACKEND_HELP = (
    "where to run: cuda (a GPU) or sim (the simulated device); default: cuda when a GPU is usable, else sim"
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a wrong argument is one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


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
    parser = _Parser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"graphpool {version()}")
    parser.add_argument("--backend", choices=("cuda", "sim"), default=None, help=BACKEND_HELP)
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("demo", "run the example scenarios and print what each one measured"),
        ("bench", "time the allocator and graph replays (against CuPy when it is installed)"),
        ("snapshot", "print the memory snapshot and summary of a small workload, or write it for viewers"),
    ):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        # SUPPRESS: given only before the command's name, the top level's value stays
        p.add_argument("--backend", choices=("cuda", "sim"), default=argparse.SUPPRESS, help=BACKEND_HELP)
        if name == "bench":
            p.add_argument("--quick", action="store_true", help="small iteration counts (CI smoke test)")
            p.add_argument(
                "--json",
                nargs="?",
                const="-",
                default=None,
                metavar="PATH",
                help="print the results as JSON instead of a table; with PATH, write the JSON "
                "there and print the table (PATH is checked before the bench runs)",
            )
            p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
        if name == "snapshot":
            p.add_argument(
                "--json",
                action="store_true",
                help="print the snapshot as JSON instead of text; with --out, also write "
                "DIR/snapshot.json and print the list of files written as JSON",
            )
            p.add_argument(
                "--out",
                metavar="DIR",
                default=None,
                help="record the history and write DIR/snapshot.pickle (for pytorch.org/memory_viz), "
                "DIR/snapshot.html and, with matplotlib, DIR/snapshot.png instead of printing",
            )
            p.add_argument(
                "--demo", action="store_true", help="run the demo's scenarios (quietly) before the workload"
            )
    return parser


def _workload() -> list[object]:
    """A few eager buffers on two streams, one freed, and a graph whose capture freed a
    temporary; returns what keeps them alive."""
    import graphpool as gp
    from graphpool import runtime

    keep: list[object] = [gp.alloc(n) for n in (100, 4096, 3 << 20)]
    gp.alloc(1 << 16).free()
    s = gp.Stream()
    keep.append(gp.alloc(1 << 20, stream=s))
    g = gp.CUDAGraph()
    dev = runtime.get().device(s.device)
    with gp.stream(s):
        g.capture_begin()
        tmp = gp.alloc(1 << 20)
        out = gp.alloc(1 << 20)
        dev.memset(tmp.ptr, 0, tmp.nbytes, s.handle)
        dev.memset(out.ptr, 1, out.nbytes, s.handle)
        tmp.free()
        keep.append(out)
        g.capture_end()
    keep.append(g)
    return keep


def snapshot(backend: str | None, as_json: bool = False, out: str | None = None, demo: bool = False) -> int:
    """Run the workload (after the demo's scenarios with ``demo``), then print the snapshot and
    the summary, or with ``out`` record the history and write the snapshot files there."""
    import graphpool as gp
    from graphpool.snapshot import render_snapshot

    if out is not None:
        writable_dir(out, "snapshot --out")  # before any work
    if backend is not None:
        gp.set_backend(backend)
    if out is not None:
        gp.record_memory_history(True)
    try:
        if demo:
            import contextlib
            import io

            from graphpool.tools.demo import run as run_demo

            with contextlib.redirect_stdout(io.StringIO()):
                run_demo(None)
        keep = _workload()
        if out is None:
            print(render_snapshot(gp.memory_snapshot(), as_json))
            if not as_json:
                print()
                print(gp.memory_summary())
        else:
            _write_snapshot(out, as_json)
        del keep
    finally:
        if out is not None:
            gp.record_memory_history(False)
    return 0


def writable_dir(path: str, option: str) -> None:
    """Make the folder ``path`` if needed and check that a file can be written there; OSError
    (naming ``option`` and the path) otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OSError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None


def _write_snapshot(out: str, as_json: bool = False) -> None:
    """Write snapshot.pickle, snapshot.html and (with matplotlib) snapshot.png into ``out``
    (with ``as_json`` snapshot.json too); say what was written, in words or as JSON."""
    import json

    import graphpool as gp
    from graphpool.snapshot import dump, render_snapshot
    from graphpool.tools import viz

    snap = gp.torch_snapshot()
    events = sum(len(t) for t in snap["device_traces"])
    written: dict[str, str | None] = {}
    lines: list[str] = []
    pickle_path = os.path.join(out, "snapshot.pickle")
    dump(snap, pickle_path)
    written["pickle"] = pickle_path
    lines.append(
        f"{pickle_path}: {len(snap['segments'])} segments, {events} events (PyTorch's snapshot layout)"
    )
    lines.append(
        f"  open it at pytorch.org/memory_viz or: python -m torch.cuda._memory_viz trace_plot {pickle_path}"
    )
    html_path = os.path.join(out, "snapshot.html")
    viz.write_html(snap, html_path)
    written["html"] = html_path
    lines.append(f"{html_path}: segments by pool and stream, and memory over time (self-contained)")
    png_path = os.path.join(out, "snapshot.png")
    if viz.write_png(snap, png_path):
        written["png"] = png_path
        lines.append(f"{png_path}: the same as a picture")
    else:
        written["png"] = None
        lines.append("no snapshot.png: matplotlib is not installed (pip install matplotlib)")
    if as_json:
        json_path = os.path.join(out, "snapshot.json")
        with open(json_path, "w") as fh:
            fh.write(render_snapshot(gp.memory_snapshot(), True) + "\n")
        written["json"] = json_path
        summary = {"files": written, "segments": len(snap["segments"]), "events": events}
        print(json.dumps(summary, indent=2))
    else:
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BackendUnavailableError as exc:  # no GPU here: one line that says so, no traceback
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output path that cannot be written: one line, no traceback
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    """Run the chosen command."""
    if args.command == "demo":
        from graphpool.tools.demo import run

        return run(args.backend)
    if args.command == "bench":
        from graphpool.tools.bench import run as bench

        as_json = args.json == "-"
        return bench(
            args.backend,
            quick=args.quick,
            json_path=None if as_json else args.json,
            as_json=as_json,
            progress=not args.no_progress,
        )
    return snapshot(args.backend, as_json=args.json, out=args.out, demo=args.demo)


if __name__ == "__main__":
    sys.exit(main())
