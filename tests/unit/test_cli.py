import os
import subprocess
import sys
from pathlib import Path

import pytest

# A deadline for a hang, not a duration: `model make-tiny` takes 2-6 s quiet and ran past 60 s on a
# fresh clone at load ~4 (the import of torch and transformers competing for 2 cores).
DEADLINE_S = 600


def burstrl(*args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    """Run the installed console script when there is one, else `python -m burstrl.cli`."""
    script = Path(sys.executable).parent / "burstrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "burstrl.cli"]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def test_help_lists_commands():
    result = burstrl("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "model", "version"):
        assert command in result.stdout


def test_version():
    from burstrl import __version__

    result = burstrl("version")
    assert result.returncode == 0
    assert result.stdout.strip() == __version__


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "burstrl.cli", "version"], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert result.returncode == 0, result.stderr


def test_serve_dry_run_prints_resolved_config(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text("[engine]\nmax_running_requests = 3\n")
    result = burstrl(
        "serve", str(config), "--engine.max_total_num_tokens", "4096", "--model", "/models/x", "--port=9001", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    assert "max_total_num_tokens = 4096" in result.stdout
    assert "max_running_requests = 3" in result.stdout
    assert 'path = "/models/x"' in result.stdout
    assert "port = 9001" in result.stdout


def test_serve_unknown_key_exits_2_naming_it():
    result = burstrl("serve", "--engine.bogus", "1", "--dry-run")
    assert result.returncode == 2
    assert "error:" in result.stderr and "engine.bogus" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_a_path_that_is_no_model_is_one_line(tmp_path):
    """Issue 49 (noted): `serve --model /nonexistent` or a directory without config.json ended in the
    hub client's or transformers' traceback; now one line, as the other commands answer a bad path."""
    for path in ("/nonexistent", str(tmp_path)):
        result = burstrl("serve", "--model", path, "--port", "0")
        assert result.returncode != 0 and f"{path}: not a model directory" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


@pytest.mark.slow  # two `burstrl serve` processes that get as far as the tokenizer
def test_serve_on_vllm_answers_a_bad_setting_in_one_line(tiny_model_dir, tmp_path):
    """No vLLM interpreter there, or a setting vLLM cannot serve: one line naming it, no traceback."""
    cases = [(("--engine.vllm.python", str(tmp_path / "nope")), "no such interpreter"),
             (("--engine.logprobs_mode", "raw"), 'engine.logprobs_mode = "raw" is not supported')]
    for extra, needle in cases:
        result = burstrl("serve", "--model", str(tiny_model_dir), "--port", "0", "--engine.backend", "vllm",
                         "--server.state_dir", str(tmp_path / "state"), *extra)
        assert result.returncode != 0 and needle in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_serve_missing_config_file_exits_2():
    result = burstrl("serve", "/no/such/config.toml", "--dry-run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # 2-6 s: kept out of the fast lane
def test_make_tiny_writes_a_model_dir(tmp_path):
    out = tmp_path / "tiny"
    result = burstrl("model", "make-tiny", str(out), "--layers", "1", "--hidden", "64", "--vocab", "512")
    assert result.returncode == 0, result.stderr
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp dirs left behind


def test_cli_import_stays_light():
    """`--help` must be instant: heavy libraries are imported inside commands only."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, burstrl.cli; print(sorted(sys.modules))"],
        capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert result.returncode == 0, result.stderr
    for heavy in ("torch", "transformers", "fastapi", "pydantic"):
        assert f"'{heavy}'" not in result.stdout


@pytest.mark.slow  # three CLI processes (~9 s)
def test_run_dry_run_shows_which_cached_warm_start_an_empty_model_path_uses(tmp_path):
    """`model.warm_start = forgetful` picks the SWE warm start with the sampled flaw (no build on --dry-run)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "toy-swe.toml"
    env = {**os.environ, "BURSTRL_CACHE": str(tmp_path)}
    for choice, name in (("plain", "tiny-qwen3-swe-warm"), ("forgetful", "tiny-qwen3-swe-forgetful")):
        result = subprocess.run([sys.executable, "-m", "burstrl.cli", "run", str(example), "--model.warm_start", choice,
                                 "--dry-run"], capture_output=True, text=True, timeout=DEADLINE_S, env=env)
        assert result.returncode == 0, result.stderr
        assert f'path = "{tmp_path / name}"' in result.stdout and f'warm_start = "{choice}"' in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing built
    bad = burstrl("run", str(example), "--model.warm_start", "lazy", "--dry-run")
    assert bad.returncode == 2 and "warm_start" in bad.stderr
