"""The README's two commands are the ones CI runs and the ones the tests exercise."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    command = "./scripts/test"
    assert f"```sh\n{command}\n```" in README
    assert command in ci.splitlines()[-1]
    script = (REPO / "scripts" / "test").read_text()
    assert "apt-get install" in script and "redis-server" in script and "chromium" in script
    assert "pip install --quiet -e '.[test]'" in script and "python -m pytest" in script


def test_readme_serve_command_uses_the_example_config() -> None:
    assert "pip install -e . && slotproxy serve --config config.example.yaml" in README
    assert (REPO / "config.example.yaml").is_file()
