"""The command line's help and start-up cost (issue 24, finding 9).

Before: ``slotproxy --help`` printed the module docstring's reST (````slotproxy````), ``status --url`` had no
help and no default, ``--log-format``/``--log-level`` and ``demo --no-proxy`` stated no default, and every
call, ``--version`` included, imported aiohttp, pydantic, yaml and redis (~0.5 s to 1 s). The time itself
is measured in ``bench/RESULTS.md``, not here: this test checks what is imported, which is what the time
comes from.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("aiohttp", "pydantic", "pydantic_core", "yaml", "redis", "uvloop", "multidict", "yarl", "prometheus_client")
NOT_OPTIONS = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


COMMANDS = sorted(name for name, _ in subparsers(build_parser()))


def test_every_command_is_walked() -> None:
    assert COMMANDS == ["check", "clients", "demo", "fake-upstream", "init", "schema", "serve", "status", "usage"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_that_states_its_default(command: str) -> None:
    parser = dict(subparsers(build_parser()))[command]
    for action in parser._actions:
        if isinstance(action, NOT_OPTIONS) or action.help == argparse.SUPPRESS:  # internal (serve --worker-of)
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
        assert "default" in action.help.lower(), f"{command} {action.option_strings}: {action.help!r}"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_rest_markup_in_any_help(command: str) -> None:
    parser = dict(subparsers(build_parser()))[command]
    assert "``" not in parser.format_help()
    assert "``" not in build_parser().format_help()


@pytest.mark.parametrize("argv", [["--help"], *([command, "--help"] for command in COMMANDS)])
def test_help_as_the_user_sees_it(argv: list[str]) -> None:
    """Through ``python -m proxy``: the flags a command defines in its own module are there when it is named."""
    result = subprocess.run([sys.executable, "-m", "proxy", *argv], cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout
    expected = {"fake-upstream": "--cap", "demo": "--no-proxy", "status": "(default:", "--help": "COMMAND"}
    assert expected.get(argv[0], "usage: slotproxy") in result.stdout


def _imported(*argv: str) -> set[str]:
    """Top-level packages ``python -X importtime -m proxy ARGV`` imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "proxy", *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    assert "proxy" in names
    return names


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"]])
def test_version_and_help_import_no_heavy_package(argv: list[str]) -> None:
    assert not set(HEAVY) & _imported(*argv)


def test_importing_the_cli_imports_no_heavy_package() -> None:
    script = "import sys, proxy.cli; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=True)
    loaded = {name.split(".")[0] for name in result.stdout.split()}
    assert not set(HEAVY) & loaded
