"""Where a front end's keys and limits come from (`shoal.deploy.openai.server.front_end_config`):
key files, the warned-about command line, the environment, and the bounds' own checks."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from shoal.deploy.openai.server import FrontEndConfig, add_api_server_args, front_end_config


def _config_of(*argv: str) -> FrontEndConfig:
    parser = argparse.ArgumentParser()
    add_api_server_args(parser)
    return front_end_config(parser.parse_args(list(argv)), 8000)


def test_keys_come_from_files_and_the_admin_key_defaults_to_none(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("file-key\n")
    (tmp_path / "admin").write_text("admin-key")
    config = _config_of("--api-key-file", str(tmp_path / "key"))
    assert config.api_key == "file-key" and config.admin_api_key is None
    config = _config_of(
        "--api-key-file", str(tmp_path / "key"), "--admin-api-key-file", str(tmp_path / "admin")
    )
    assert config.admin_api_key == "admin-key"
    assert "file-key" not in repr(config) and "admin-key" not in repr(config)


def test_a_key_on_the_command_line_works_with_a_warning_that_does_not_echo_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _config_of("--api-key", "cli-secret-key")
    assert config.api_key == "cli-secret-key"
    assert "--api-key-file" in caplog.text and "cli-secret-key" not in caplog.text


def test_a_missing_or_empty_key_file_and_a_bad_limit_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        _config_of("--api-key-file", str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        _config_of("--admin-api-key-file", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--max-n"):
        _config_of("--max-n", "0")
    with pytest.raises(ValueError, match="--max-sequences-per-request"):
        _config_of("--max-sequences-per-request", "0")


def test_one_request_starts_at_most_1024_sequences_unless_told() -> None:
    assert _config_of().limits.max_sequences_per_request == 1024
    config = _config_of("--max-sequences-per-request", "64")
    assert config.limits.max_sequences_per_request == 64


def test_the_environment_supplies_keys_when_no_flag_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_API_KEY", "env-key")
    monkeypatch.setenv("SHOAL_ADMIN_API_KEY", "env-admin")
    config = _config_of()
    assert (config.api_key, config.admin_api_key) == ("env-key", "env-admin")


def test_the_routing_policy_is_cache_aware_unless_chosen() -> None:
    assert _config_of().routing_policy == "cache-aware"
    assert _config_of("--routing-policy", "round-robin").routing_policy == "round-robin"
    with pytest.raises(SystemExit):
        _config_of("--routing-policy", "random")


def test_the_cost_of_loading_an_adapter_is_the_policys_unless_given() -> None:
    assert _config_of().lora_load_cost is None
    assert _config_of("--routing-lora-load-cost", "0").lora_load_cost == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            _config_of("--routing-lora-load-cost", bad)


def test_the_migration_limit_defaults_to_three_and_refuses_a_negative(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _config_of().migration_limit == 3
    assert _config_of("--migration-limit", "0").migration_limit == 0
    with pytest.raises(SystemExit):
        _config_of("--migration-limit", "-1")
    assert "must be >= 0" in capsys.readouterr().err
