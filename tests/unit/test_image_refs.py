"""Image references, registry auth challenges and platform picks, as docker and the
distribution spec define them (no network: the registry itself is in tests/integration)."""

from __future__ import annotations

import pytest

from burstrl.sandbox.archive import pick_platform
from burstrl.sandbox.images import ImageError
from burstrl.sandbox.registry import DOCKER_HUB, Reference, _challenge, parse_ref

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("ref", "want"), [
    ("localhost:5000/name:tag", Reference("localhost:5000", "name", "tag")),
    ("localhost/ns/name", Reference("localhost", "ns/name", "latest")),
    (f"registry.example.com/ns/name@{DIGEST}", Reference("registry.example.com", "ns/name", DIGEST)),
    (f"ghcr.io/a/b:v1@{DIGEST}", Reference("ghcr.io", "a/b", DIGEST)),  # the digest wins
    ("ubuntu", Reference(DOCKER_HUB, "library/ubuntu", "latest")),
    ("swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
     Reference(DOCKER_HUB, "swebench/sweb.eval.x86_64.django_1776_django-11099", "latest")),
    ("127.0.0.1:5000/x/y:1.2", Reference("127.0.0.1:5000", "x/y", "1.2")),
])
def test_references_parse_as_docker_parses_them(ref: str, want: Reference) -> None:
    assert parse_ref(ref) == want


@pytest.mark.parametrize("ref", ["localhost:5000/Upper:tag", "x@sha256:short", "localhost:5000/a//b"])
def test_bad_references_are_refused(ref: str) -> None:
    with pytest.raises(ImageError):
        parse_ref(ref)


def test_a_bearer_challenge_is_parsed() -> None:
    scheme, params = _challenge('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                                'scope="repository:library/ubuntu:pull"')
    assert scheme == "bearer"
    assert params == {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                      "scope": "repository:library/ubuntu:pull"}


def test_the_platform_is_picked_from_an_index() -> None:
    def entry(arch: str, variant: str | None = None) -> dict:
        plat = {"os": "linux", "architecture": arch, **({"variant": variant} if variant else {})}
        return {"mediaType": "application/vnd.oci.image.manifest.v1+json", "size": 1,
                "digest": "sha256:" + (arch + (variant or "")).encode().hex().ljust(64, "0")[:64], "platform": plat}

    index = {"manifests": [entry("arm", "v7"), entry("arm64", "v8"), entry("amd64")]}
    assert pick_platform(index, "linux/amd64", "x").digest == entry("amd64")["digest"]
    assert pick_platform(index, "linux/arm64", "x").digest == entry("arm64", "v8")["digest"]
    assert pick_platform(index, "linux/arm/v7", "x").digest == entry("arm", "v7")["digest"]
    with pytest.raises(ImageError, match="no image for linux/s390x .*linux/amd64"):
        pick_platform(index, "linux/s390x", "x")
