"""The README's two commands are the ones CI runs and the ones the tests exercise."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    command = "pip install -e '.[test]' && python -m pytest"
    assert command in README
    assert command in ci


def test_readme_serve_command_uses_the_example_config() -> None:
    assert "pip install -e . && slotproxy serve --config config.example.yaml" in README
    assert (REPO / "config.example.yaml").is_file()
