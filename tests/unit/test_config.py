import sys

import pytest

from burstrl.config import ConfigError, ServeConfig, dump_toml, load_config, parse_overrides

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_parse_overrides_forms_and_types():
    got = parse_overrides(
        ["--a.b", "v", "--a.c=3", "--n", "1.5", "--x.flag", "true", "--x.off=False", "--s", "hello world"]
    )
    assert got == {"a": {"b": "v", "c": 3}, "n": 1.5, "x": {"flag": True, "off": False}, "s": "hello world"}


def test_hyphens_read_as_underscores_in_field_names_only():
    cfg = load_config(
        ServeConfig, [], ["--engine.max-running-requests", "5", "--served-model-name=tiny", "--adapters.policy-v1", "/a"]
    )
    assert cfg.engine.max_running_requests == 5
    assert cfg.served_model_name == "tiny"
    assert cfg.adapters == {"policy-v1": "/a"}  # adapter names are data, not field names


def test_parse_overrides_rejects_bad_words():
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="expected an override"):
        parse_overrides(["a.b", "1"])


def test_layering_defaults_files_then_overrides(tmp_path):
    first = tmp_path / "first.toml"
    first.write_text('[engine]\nmax_total_num_tokens = 1024\nmax_running_requests = 8\n[server]\nport = 9000\n')
    second = tmp_path / "second.toml"
    second.write_text("[engine]\nmax_total_num_tokens = 2048\n")
    cfg = load_config(ServeConfig, [first, second], ["--server.port", "9100"])
    assert cfg.engine.max_total_num_tokens == 2048  # later file wins
    assert cfg.engine.max_running_requests == 8  # earlier file kept where not overridden
    assert cfg.server.port == 9100  # override beats files
    assert cfg.server.host == "127.0.0.1"  # default


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'engine.bogus'"):
        load_config(ServeConfig, [], ["--engine.bogus", "1"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[sever]\nport = 1\n")
    with pytest.raises(ConfigError, match="'sever'"):
        load_config(ServeConfig, [bad])


def test_type_error_is_named():
    with pytest.raises(ConfigError, match="config key 'server.port'"):
        load_config(ServeConfig, [], ["--server.port", "not-a-port"])
    with pytest.raises(ConfigError, match="config key 'engine.max_total_num_tokens'"):
        load_config(ServeConfig, [], ["--engine.max_total_num_tokens=1"])


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[engine\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(ServeConfig, [path])


def test_dump_toml_round_trips(tmp_path):
    cfg = load_config(
        ServeConfig,
        [],
        ["--model.path", "/m", "--engine.seed", "7", "--engine.session_cache", "false", "--server.port", "0"],
    )
    cfg.adapters = {"policy-v1": "/a/1", "name.with.dots": "/a/2"}
    text = dump_toml(cfg)
    assert tomllib.loads(text)["engine"]["seed"] == 7
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    assert load_config(ServeConfig, [path]) == cfg


def test_override_keys_can_bracket_or_quote_a_segment_holding_dots():
    """Environment names hold dots and colons (`openenv:http://127.0.0.1:8000`, `verifiers:pkg.mod`):
    a bracketed or TOML-quoted segment is one key, so their options and weights can be overridden."""
    got = parse_overrides(["--orchestrator.env[openenv:http://127.0.0.1:8000].max_turns", "4",
                           '--orchestrator.envs."verifiers:pkg.mod"=0.5', "--a[b=c].d=x=y"])
    assert got == {"orchestrator": {"env": {"openenv:http://127.0.0.1:8000": {"max_turns": 4}},
                                    "envs": {"verifiers:pkg.mod": 0.5}},
                   "a": {"b=c": {"d": "x=y"}}}
    for bad, says in (("--a..b", "empty key segment"), ("--a.b.", "empty key segment"), ("--a[b", "closing"),
                      ("--a[b]c", "expected . or ="), ("--=1", "empty key segment")):
        with pytest.raises(ConfigError, match=says):
            parse_overrides([bad, "1"])


def test_a_bracketed_environment_name_reaches_the_orchestrators_config():
    from burstrl.config import OrchestrateConfig

    name = "openenv:http://127.0.0.1:8000"
    cfg = load_config(OrchestrateConfig, [], [f"--orchestrator.envs[{name}]", "1",
                                              f"--orchestrator.env[{name}].max_turns", "4"])
    assert cfg.orchestrator.envs == {name: 1.0} and cfg.orchestrator.env == {name: {"max_turns": 4}}
