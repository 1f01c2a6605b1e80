"""The command line: plain-word help, ``--version``, and the snapshot command."""

from __future__ import annotations

import re

import pytest

import graphpool as gp
from graphpool.__main__ import build_parser, main, version


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
