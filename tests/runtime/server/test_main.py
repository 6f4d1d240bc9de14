"""`tokenfleet serve` option handling: flags over the config file, and the printed curl example."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.server.main import build_parser, config_from_args, curl_example


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_defaults_serve_the_builtin_model_on_localhost_8000():
    config = parse()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.model.name == "smollm2-135m-instruct"
    assert config.server.api_keys == ()


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "runtime.yaml"
    path.write_text("server:\n  port: 9000\n  api_keys: [from-file]\nscheduler:\n  max_waiting: 7\n")
    config = parse("--config", str(path), "--host", "0.0.0.0", "--api-key", "k2", "--served-name", "m")
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9000)
    assert config.server.api_keys == ("from-file", "k2")
    assert config.scheduler.max_waiting == 7
    assert config.model.name == "m"
    assert parse("--config", str(path), "--max-waiting", "3").scheduler.max_waiting == 3
    assert parse("--scheduling-policy", "priority").scheduler.policy == "priority"
    assert parse().scheduler.policy == "fcfs"
    assert parse("--fair-share").scheduler.fair_share and not parse().scheduler.fair_share


def test_invalid_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        parse("--port", "70000")
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  nope: 1\n")
    with pytest.raises(ConfigError):
        parse("--config", str(bad))


def test_curl_example_carries_the_key_header_only_when_needed():
    plain = curl_example("http://127.0.0.1:8000", "m", with_key=False)
    assert plain.startswith("curl http://127.0.0.1:8000/v1/chat/completions ")
    assert "Authorization" not in plain and '"model": "m"' in plain
    assert "Authorization: Bearer $API_KEY" in curl_example("http://h:1", "m", with_key=True)


def test_lora_flags_take_vllms_forms():
    config = parse(
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "smol"}',
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "4",
    )
    lora = config.lora
    assert lora.enable and (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (2, 32, 4)
    assert [(m.name, m.path, m.base_model_name) for m in lora.modules] == [
        ("sql", "/adapters/sql", None),
        ("chat", "/adapters/chat", "smol"),
    ]
    assert not parse().lora.enable
    with pytest.raises(ConfigError, match="enable"):  # modules without --enable-lora, as vLLM refuses
        parse("--lora-modules", "sql=/adapters/sql")
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        parse("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2")
    with pytest.raises(SystemExit):  # argparse: not name=path
        parse("--enable-lora", "--lora-modules", "just-a-name")
