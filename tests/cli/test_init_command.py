"""``slotproxy init``: the example config for those who installed with pip (no repository, no
config.example.yaml), written where ``serve`` looks, with the schema its first line names beside it."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.cli.init import SCHEMA_NAME, example_text

from .test_cli import REPO, run_cli

NO_ENV = {"SLOTPROXY_CONFIG": ""}


def test_the_shipped_example_is_the_repository_s() -> None:
    assert (REPO / "proxy" / "config" / "example.yaml").read_text() == (REPO / "config.example.yaml").read_text()
    assert example_text() == (REPO / "config.example.yaml").read_text()
    assert '"config/example.yaml"' in (REPO / "pyproject.toml").read_text()  # shipped in the wheel


def test_init_writes_what_serve_and_check_read_by_default(tmp_path: Path) -> None:
    result = run_cli("init", cwd=tmp_path, env=NO_ENV)
    assert result.returncode == 0, result.stderr
    config = tmp_path / "slotproxy.yaml"
    assert config.read_text() == (REPO / "config.example.yaml").read_text()
    assert result.stdout.splitlines()[0] == "wrote slotproxy.yaml"
    assert result.stdout.splitlines()[-1] == "next: slotproxy check --config slotproxy.yaml, then slotproxy serve"
    check = run_cli("check", cwd=tmp_path, env=NO_ENV)
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("# slotproxy.yaml: valid\n")


def test_the_schema_line_resolves_beside_the_copy(tmp_path: Path) -> None:
    target = tmp_path / "team" / "proxy.yaml"
    target.parent.mkdir()
    assert run_cli("init", str(target)).returncode == 0
    first = target.read_text().splitlines()[0]
    assert first == f"# yaml-language-server: $schema=./{SCHEMA_NAME}"
    schema = target.parent / first.split("$schema=", 1)[1]
    assert json.loads(schema.read_text()) == json.loads((REPO / SCHEMA_NAME).read_text())


def test_an_existing_config_is_refused_unless_force(tmp_path: Path) -> None:
    config = tmp_path / "slotproxy.yaml"
    config.write_text("# mine\n")
    refused = run_cli("init", cwd=tmp_path, env=NO_ENV)
    assert refused.returncode == 2
    assert refused.stderr == ("slotproxy: slotproxy.yaml already exists and was left as it is; pass --force to "
                              "replace it with the example\n")
    assert config.read_text() == "# mine\n" and not (tmp_path / SCHEMA_NAME).exists()
    forced = run_cli("init", "--force", cwd=tmp_path, env=NO_ENV)
    assert forced.returncode == 0, forced.stderr
    assert config.read_text() == (REPO / "config.example.yaml").read_text()


def test_a_schema_of_another_version_is_kept_unless_force(tmp_path: Path) -> None:
    schema = tmp_path / SCHEMA_NAME
    schema.write_text("{}\n")
    kept = run_cli("init", str(tmp_path / "a.yaml"))
    assert kept.returncode == 0 and schema.read_text() == "{}\n"
    assert f"kept {schema}, which differs from this version's schema (--force replaces it" in kept.stdout
    replaced = run_cli("init", "--force", str(tmp_path / "a.yaml"))
    assert replaced.returncode == 0 and json.loads(schema.read_text()) == json.loads((REPO / SCHEMA_NAME).read_text())
    again = run_cli("init", str(tmp_path / "b.yaml"))
    assert f"kept {schema} (already this version's schema)" in again.stdout


def test_a_folder_gets_slotproxy_yaml_and_a_missing_folder_is_named(tmp_path: Path) -> None:
    result = run_cli("init", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "slotproxy.yaml").is_file()
    assert f"then slotproxy serve --config {tmp_path / 'slotproxy.yaml'}" in result.stdout
    missing = run_cli("init", str(tmp_path / "nope" / "slotproxy.yaml"))
    assert missing.returncode == 2
    assert f"the folder {tmp_path / 'nope'} does not exist; create it first" in missing.stderr


def test_help_names_the_command_its_default_and_force() -> None:
    top = run_cli("--help")
    assert "init         write a commented example config that serves as is" in top.stdout
    help_text = run_cli("init", "--help").stdout
    assert "default: ./slotproxy.yaml, what serve reads when given no --config" in " ".join(help_text.split())
    assert "--force" in help_text and "replace an existing file" in help_text


def test_no_config_found_points_at_init(tmp_path: Path) -> None:
    result = run_cli("serve", cwd=tmp_path, env=NO_ENV)
    assert result.returncode == 2
    assert "`slotproxy init` writes a commented one that serves as is to ./slotproxy.yaml" in result.stderr
    assert "config.example.yaml" not in result.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    check = run_cli("check", "--config", str(empty))
    assert "or run `slotproxy init` for a commented config" in check.stderr
