"""`burstrl fleet token`: the token it prints is the one a replica with that key accepts."""

from __future__ import annotations

from pathlib import Path

from burstrl.protocol.tenants import tenant_of

from .test_cli import burstrl


def test_fleet_token_prints_a_token_the_key_checks(tmp_path: Path) -> None:
    key = tmp_path / "tenant.key"
    key.write_text("fleet-secret\n")
    key.chmod(0o600)
    out = burstrl("fleet", "token", "run-a", "--key-file", str(key))
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert tenant_of({"authorization": f"Bearer {token}"}, "fleet-secret") == "run-a"
    assert tenant_of({"authorization": f"Bearer {token}"}, "another-key") is None


def test_fleet_token_refuses_a_bad_name_a_shared_key_file_and_no_file(tmp_path: Path) -> None:
    key = tmp_path / "tenant.key"
    key.write_text("fleet-secret\n")
    key.chmod(0o600)
    bad = burstrl("fleet", "token", "Run_A", "--key-file", str(key))
    assert bad.returncode == 2 and "tenant name 'Run_A'" in bad.stderr
    key.chmod(0o644)
    shared = burstrl("fleet", "token", "run-a", "--key-file", str(key))
    assert shared.returncode == 2 and "readable by other users" in shared.stderr and not shared.stdout
    missing = burstrl("fleet", "token", "run-a", "--key-file", str(tmp_path / "none"))
    assert missing.returncode == 2 and "No such file" in missing.stderr
