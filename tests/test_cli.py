"""The command line: plain-word help, ``--version``, the snapshot command, global options
before the command, and one-line errors for bad arguments and output paths."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import graphpool as gp
from graphpool.tools.cli import build_parser, main, version


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--help"], ["demo", "--help"], ["bench", "--help"], ["snapshot", "--help"]]
)
def test_help_is_plain_words(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(argv, capsys)
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert not re.search(r"\.\. \w+::", text)
    assert "--backend" in text or argv == ["--help"]


def test_top_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["--help"], capsys)
    for command in ("demo", "bench", "snapshot"):
        assert command in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["--version"], capsys)
    assert text.strip() == f"graphpool {version()}"
    assert version() == gp.__version__  # the metadata and the module agree


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([])
    assert e.value.code == 2


def test_snapshot_command(sim: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["snapshot"]) == 0
    out = capsys.readouterr().out
    assert "segment 0x" in out and "graphpool memory summary" in out


def test_global_options_go_before_the_command_too(sim: object, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--backend", "sim", "demo"])
    assert (args.command, args.backend) == ("demo", "sim")
    args = build_parser().parse_args(["demo", "--backend", "sim"])
    assert (args.command, args.backend) == ("demo", "sim")
    assert build_parser().parse_args(["bench"]).backend is None
    assert main(["--backend", "sim", "snapshot"]) == 0
    assert "graphpool memory summary" in capsys.readouterr().out


def test_snapshot_json_with_out_writes_and_prints_json(sim: object, tmp_path: Path) -> None:
    out = tmp_path / "snap"
    done = _cli("snapshot", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)  # --json was ignored with --out: text lines
    assert said["files"]["json"] == str(out / "snapshot.json") and said["segments"] > 0
    segments = json.loads((out / "snapshot.json").read_text())
    assert segments and {"address", "blocks", "total_size"} <= set(segments[0])
    assert (out / "snapshot.pickle").exists() and (out / "snapshot.html").exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    src = str(Path(gp.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=src, GRAPHPOOL_BACKEND="sim")
    return subprocess.run(
        [sys.executable, "-m", "graphpool", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m graphpool"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("snapshot", "--out", "/proc/graphpool-none"),
        ("snapshot", "--out", "/dev/null/x"),
        ("bench", "--json", "/proc/graphpool-none/b.json"),
        ("bench", "--json", "/"),
        ("--backend", "sim", "bench", "--quick", "--json", "/dev/null/x.json"),
    ],
    ids=["snapshot-proc", "snapshot-under-a-file", "bench-proc", "bench-a-folder", "bench-global-backend"],
)
def test_a_bad_output_path_is_one_line_before_any_work(args: tuple[str, ...]) -> None:
    """Both ended in raw tracebacks; bench ran fully (minutes without --quick) first."""
    t0 = time.monotonic()
    done = _cli(*args)
    _one_line_error(
        done, "cannot write there", args[args.index("--out" if "--out" in args else "--json") + 1]
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "[bench" not in done.stderr  # no progress: nothing ran
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    "args",
    [("--bogus",), ("demo", "--bogus"), ("--backend", "gpu", "demo"), ("nosuch",), ("bench", "--quick=3")],
)
def test_a_bad_argument_is_one_line(args: tuple[str, ...]) -> None:
    done = _cli(*args)
    _one_line_error(done, "--help")
    assert done.returncode == 2
