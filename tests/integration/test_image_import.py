"""Importing images: a real registry (Debian's `docker-registry`) on loopback, `docker save`
tarballs and OCI archives built here; every import must reproduce each layer's diff_id, store
tar+zstd, and run in a sandbox with the image's Env. Nothing is mocked."""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from burstrl.sandbox.archive import import_archive
from burstrl.sandbox.images import (
    LAYER_ZSTD,
    ImageError,
    build_image,
    describe,
    read_image,
    verify_image,
)
from burstrl.sandbox.registry import pull
from tests.http_client import HTTP

REGISTRY_BIN = "/usr/bin/docker-registry"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
IMAGE_ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "IMPORTED_VAR=from-the-image"]


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(files: dict[str, bytes]) -> bytes:
    """An uncompressed layer: `files` (path -> content) with their parent dirs, as docker writes them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass
class Source:
    """An image as another tool would have it: layer tars, their compressed blobs, the config."""

    tars: list[bytes]
    blobs: list[bytes]
    media: list[str]
    config: bytes

    @property
    def diff_ids(self) -> list[str]:
        return [sha(t) for t in self.tars]


def source_image(arch: str = "amd64", marker: str = "amd64") -> Source:
    """Two layers, the first gzip (docker's own), the second plain tar; Env set."""
    tars = [layer_tar({"work/hello.txt": b"hello from layer one\n", "work/pkg/mod.py": b"X = 1\n"}),
            layer_tar({"work/second.txt": f"layer two {marker}\n".encode()})]
    blobs = [gzip.compress(tars[0], mtime=0), tars[1]]
    media = [DOCKER_GZIP, "application/vnd.docker.image.rootfs.diff.tar"]
    config = {"architecture": arch, "os": "linux",
              "config": {"Env": IMAGE_ENV, "WorkingDir": "/work", "Cmd": ["/bin/sh"]},
              "rootfs": {"type": "layers", "diff_ids": [sha(t) for t in tars]},
              "history": [{"created_by": "test"}]}
    return Source(tars, blobs, media, json.dumps(config).encode())


def check_imported(out: Path, src: Source) -> None:
    """zstd layers, the original diff_ids, every blob hashing to its digest."""
    image = read_image(out)
    verify_image(image)
    info = describe(image)
    assert [layer["media_type"] for layer in info["layers"]] == [LAYER_ZSTD] * len(src.tars)
    assert image.diff_ids == src.diff_ids
    for desc in image.layers:
        assert image.blob_path(desc).read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic
    assert image.env == IMAGE_ENV


def run_in_sandbox(layout: Path, cache: Path) -> list[str]:
    """Start a namespace sandbox from `layout`; what it sees of the image's files and Env."""
    from burstrl.sandbox.backends import SandboxSpec, make_backend
    from burstrl.sandbox.layercache import LayerCache

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    backend = make_backend("namespace", layer_cache=LayerCache(cache, max_bytes=1 << 30))
    with backend.create(SandboxSpec(image=layout)) as sb:
        res = sb.exec("cat /work/hello.txt /work/second.txt; echo env=$IMPORTED_VAR")
    assert res.exit_code == 0, res
    return res.stdout.splitlines()


# ------------------------------------------------------------------------------ the registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Registry:
    url: str
    storage: Path
    proc: subprocess.Popen[bytes]

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")


def start_registry(tmp: Path, auth: dict[str, Any] | None = None) -> Registry:
    """`docker-registry serve` on a free loopback port, storage in `tmp`; ready when /v2/ answers."""
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip("Debian's docker-registry is not installed (apt-get install docker-registry)")
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config: dict[str, Any] = {"version": 0.1, "log": {"level": "error"},
                              "storage": {"filesystem": {"rootdirectory": str(tmp / "storage")}},
                              "http": {"addr": f"127.0.0.1:{port}"}}
    if auth:
        config["auth"] = auth
    (tmp / "config.yml").write_text(json.dumps(config))  # JSON is YAML
    with open(tmp / "registry.log", "wb") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(tmp / "config.yml")], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"registry exited {proc.returncode}: {(tmp / 'registry.log').read_text()}")
        try:
            if HTTP.get(url + "/v2/", timeout=2).status_code in (200, 401):
                return Registry(url, tmp / "storage", proc)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("registry did not answer /v2/ within 30 s")
        time.sleep(0.05)  # polling interval while waiting on the condition above


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    reg = start_registry(tmp_path / "registry")
    yield reg
    reg.proc.kill()
    reg.proc.wait()


def push_blob(http: httpx.Client, base: str, name: str, data: bytes) -> None:
    """Monolithic upload: POST opens a session, PUT ?digest= closes it with the whole blob."""
    r = http.post(f"{base}/v2/{name}/blobs/uploads/")
    assert r.status_code == 202, r.text
    location = r.headers["location"]
    location = location if location.startswith("http") else base + location
    sep = "&" if "?" in location else "?"
    r = http.put(f"{location}{sep}digest={sha(data)}", content=data,
                 headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text


def push_image(http: httpx.Client, base: str, name: str, src: Source, tag: str | None) -> tuple[str, int]:
    """Push `src` as a Docker v2 schema 2 manifest; (its digest, its size)."""
    for blob in [*src.blobs, src.config]:
        push_blob(http, base, name, blob)
    manifest = {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
                "config": {"mediaType": DOCKER_CONFIG, "digest": sha(src.config), "size": len(src.config)},
                "layers": [{"mediaType": m, "digest": sha(b), "size": len(b)} for m, b in zip(src.media, src.blobs, strict=False)]}
    body = json.dumps(manifest).encode()
    r = http.put(f"{base}/v2/{name}/manifests/{tag or sha(body)}", content=body,
                 headers={"Content-Type": DOCKER_MANIFEST})
    assert r.status_code == 201, r.text
    return sha(body), len(body)


def push_multiarch(http: httpx.Client, base: str, name: str, tag: str) -> Source:
    """A manifest list with arm64 first and amd64 second: the pull must pick amd64."""
    amd, arm = source_image(), source_image("arm64", "arm64")
    entries = []
    for src, arch in ((arm, "arm64"), (amd, "amd64")):
        digest, size = push_image(http, base, name, src, None)
        entries.append({"mediaType": DOCKER_MANIFEST, "digest": digest, "size": size,
                        "platform": {"os": "linux", "architecture": arch}})
    body = json.dumps({"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": entries}).encode()
    r = http.put(f"{base}/v2/{name}/manifests/{tag}", content=body, headers={"Content-Type": DOCKER_LIST})
    assert r.status_code == 201, r.text
    return amd


def no_leftovers(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


@pytest.mark.slow
def test_pull_from_registry_recompresses_to_zstd_and_runs(registry: Registry, tmp_path: Path) -> None:
    """A manifest list on a real registry: the amd64 image arrives as zstd with its diff_ids, and
    a sandbox from it sees its files and Env; pulling by digest gives the same image."""
    with httpx.Client(timeout=30) as http:
        src = push_multiarch(http, registry.url, "tasks/demo", "v1")
    out = tmp_path / "pulled"
    seen: list[tuple[str, int]] = []
    ref = pull(f"{registry.host}/tasks/demo:v1", out, insecure=True, progress=lambda w, n, t: seen.append((w, n)))
    check_imported(out, src)
    assert any("download" in w for w, _ in seen) and any("read" in w for w, _ in seen)
    assert read_image(out).manifest["annotations"]["io.burstrl.imported.from"].endswith("tasks/demo:v1")
    assert run_in_sandbox(out, tmp_path / "cache") == ["hello from layer one", "layer two amd64",
                                                       "env=from-the-image"]
    digest = read_image(out).manifest["annotations"]["io.burstrl.imported.from.digest"]
    again = pull(f"{registry.host}/tasks/demo@{digest}", tmp_path / "by-digest", insecure=True)
    assert again.manifest_digest != ref.manifest_digest  # the annotations name the ref pulled
    assert read_image(again.layout).layers == read_image(out).layers  # same content, same zstd bytes
    arm = pull(f"{registry.host}/tasks/demo:v1", tmp_path / "arm", insecure=True, platform="linux/arm64")
    assert read_image(arm.layout).config["architecture"] == "arm64"
    from typer.testing import CliRunner

    from burstrl.cli import app

    cli = CliRunner().invoke(app, ["image", "pull", f"{registry.host}/tasks/demo:v1", "--out", str(tmp_path / "cli"),
                                   "--insecure"])
    assert cli.exit_code == 0, cli.output
    assert read_image(tmp_path / "cli").manifest_digest in cli.output and "layer 1/2" in cli.output


@pytest.mark.slow
def test_pull_of_a_corrupt_blob_fails_and_publishes_nothing(registry: Registry, tmp_path: Path) -> None:
    """A layer whose bytes on the registry no longer match its digest: a clear error, no layout."""
    src = source_image()
    with httpx.Client(timeout=30) as http:
        push_image(http, registry.url, "tasks/bad", src, "v1")
    data = next(p for p in registry.storage.rglob("data") if p.parent.name == sha(src.blobs[0])[7:])
    data.write_bytes(data.read_bytes()[:-10] + b"0123456789")
    out = tmp_path / "out"
    with pytest.raises(ImageError, match="corrupt"):
        pull(f"{registry.host}/tasks/bad:v1", out, insecure=True)
    no_leftovers(tmp_path, out)
    with pytest.raises(ImageError, match="HTTP 404"):
        pull(f"{registry.host}/tasks/missing:v1", out, insecure=True)
    no_leftovers(tmp_path, out)


# ------------------------------------------------------------------------------ archives


def add_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def docker_save_tar(path: Path, src: Source, oci_style: bool) -> None:
    """What `docker save` writes: manifest.json naming the config and each layer; before docker 25
    `<id>/layer.tar` (here one gzip, one plain), from 25 on `blobs/sha256/<hex>`."""
    cfg = f"blobs/sha256/{sha(src.config)[7:]}" if oci_style else f"{sha(src.config)[7:]}.json"
    layers = ([f"blobs/sha256/{sha(b)[7:]}" for b in src.blobs] if oci_style
              else [f"{i:064x}/layer.tar" for i in range(1, len(src.blobs) + 1)])
    manifest = [{"Config": cfg, "RepoTags": ["demo:latest"], "Layers": layers}]
    with tarfile.open(path, "w") as tar:
        add_file(tar, "manifest.json", json.dumps(manifest).encode())
        add_file(tar, cfg, src.config)
        for name, blob in zip(layers, src.blobs, strict=False):
            add_file(tar, name, blob)
        if oci_style:
            add_file(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')


@pytest.mark.slow
@pytest.mark.parametrize(("oci_style", "gzipped"), [(False, False), (True, False), (False, True)],
                         ids=["legacy", "docker25", "legacy-gzipped"])
def test_docker_save_tarball_imports_and_runs(tmp_path: Path, oci_style: bool, gzipped: bool) -> None:
    """`docker save` (and `docker save | gzip`): one gzip and one plain layer, both become zstd."""
    src = source_image()
    archive = tmp_path / "demo.tar"
    docker_save_tar(archive, src, oci_style)
    if gzipped:
        archive.write_bytes(gzip.compress(archive.read_bytes()))
    out = tmp_path / "imported"
    import_archive(archive, out)
    check_imported(out, src)
    assert run_in_sandbox(out, tmp_path / "cache") == ["hello from layer one", "layer two amd64",
                                                       "env=from-the-image"]


def test_docker_save_with_a_wrong_diff_id_fails_and_publishes_nothing(tmp_path: Path) -> None:
    src = source_image()
    config = json.loads(src.config)
    config["rootfs"]["diff_ids"][1] = sha(b"other content")  # the config names another layer
    broken = Source(src.tars, src.blobs, src.media, json.dumps(config).encode())
    archive = tmp_path / "demo.tar"
    docker_save_tar(archive, broken, oci_style=False)
    out = tmp_path / "imported"
    with pytest.raises(ImageError, match="uncompressed layer is sha256:.*the config says"):
        import_archive(archive, out)
    no_leftovers(tmp_path, out)


def oci_archive(layout: Path, path: Path, gzipped: bool = False) -> None:
    """A tar of an OCI layout, as `skopeo copy ... oci-archive:` writes it."""
    with tarfile.open(path, "w:gz" if gzipped else "w") as tar:
        for p in sorted(layout.rglob("*")):
            tar.add(p, p.relative_to(layout).as_posix(), recursive=False)


@pytest.mark.slow
def test_oci_archive_imports_and_runs(tmp_path: Path) -> None:
    """A gzip-layered OCI layout (built here) as an archive: imported as zstd, same diff_ids."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "hello.txt").write_text("hello from layer one\n")
    (repo / "second.txt").write_text("layer two amd64\n")
    layout = tmp_path / "gz-layout"
    build_image(repo, layout, compression="gzip")
    original = read_image(layout)
    archive = tmp_path / "image.oci.tar.gz"
    oci_archive(layout, archive, gzipped=True)
    out = tmp_path / "imported"
    import_archive(archive, out)
    image = read_image(out)
    verify_image(image)
    assert [d.media_type for d in image.layers] == [LAYER_ZSTD]
    assert image.diff_ids == original.diff_ids
    assert run_in_sandbox(out, tmp_path / "cache")[:2] == ["hello from layer one", "layer two amd64"]


def test_oci_archive_with_a_corrupt_blob_fails_and_publishes_nothing(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("x" * 1000)
    layout = tmp_path / "layout"
    build_image(repo, layout, compression="gzip")
    blob = read_image(layout).blob_path(read_image(layout).layers[0])
    data = bytearray(blob.read_bytes())
    data[-12] ^= 0xFF  # inside the gzip trailer's CRC: decompression or the digest check must catch it
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    archive = tmp_path / "image.tar"
    oci_archive(layout, archive)
    out = tmp_path / "imported"
    with pytest.raises(ImageError, match="corrupt|cannot decompress"):
        import_archive(archive, out)
    no_leftovers(tmp_path, out)


def test_cli_import_prints_the_digest(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from burstrl.cli import app

    archive = tmp_path / "demo.tar"
    docker_save_tar(archive, source_image(), oci_style=False)
    result = CliRunner().invoke(app, ["image", "import", str(archive), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert read_image(tmp_path / "out").manifest_digest in result.output
    bad = CliRunner().invoke(app, ["image", "import", str(tmp_path / "missing.tar"), "--out", str(tmp_path / "o2")])
    assert bad.exit_code != 0 and "not a tar archive" in bad.output


# ------------------------------------------------------------------------------ token auth


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A token service as Docker Hub runs one: GET realm?service=&scope= answers a JWT (RS256,
    the signing cert in `x5c`) that the registry checks against its `rootcertbundle`."""

    def __init__(self, tmp: Path, issuer: str, service: str) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("openssl is needed to sign registry tokens")
        self.key, self.cert = tmp / "key.pem", tmp / "cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "1", "-subj", "/CN=burstrl-test-token"],
                       check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], check=True,
                             capture_output=True).stdout
        self.x5c, self.issuer, self.service = base64.b64encode(der).decode(), issuer, service
        self.requests: list[dict[str, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                server.requests.append(query)
                body = json.dumps({"token": server.token(query.get("scope", ""))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def token(self, scope: str) -> str:
        """A JWT granting what `scope` (`repository:NAME:ACTIONS`, space-separated) asks for."""
        access = []
        for item in scope.split():
            kind, name, actions = item.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": self.issuer, "sub": "", "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": os.urandom(8).hex(), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(),
                             check=True, capture_output=True).stdout
        return f"{signing_input}.{_b64url(sig)}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow
def test_pull_answers_a_bearer_token_challenge(tmp_path: Path) -> None:
    """A registry that wants a token: the pull follows the WWW-Authenticate challenge to the
    token service (anonymously, with the service and scope it names) and then succeeds."""
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip("Debian's docker-registry is not installed (apt-get install docker-registry)")
    tokens = TokenServer(tmp_path, "burstrl-test-issuer", "burstrl-test-registry")
    reg = start_registry(tmp_path / "registry", auth={"token": {
        "realm": tokens.realm, "service": tokens.service, "issuer": tokens.issuer,
        "rootcertbundle": str(tokens.cert)}})
    try:
        assert HTTP.get(reg.url + "/v2/").status_code == 401
        src = source_image()
        token = tokens.token("repository:tasks/private:pull,push")
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {token}"}) as http:
            push_image(http, reg.url, "tasks/private", src, "v1")
        tokens.requests.clear()
        out = tmp_path / "pulled"
        pull(f"{reg.host}/tasks/private:v1", out, insecure=True)
        check_imported(out, src)
        assert tokens.requests[0] == {"service": "burstrl-test-registry", "scope": "repository:tasks/private:pull"}
    finally:
        reg.proc.kill()
        reg.proc.wait()
        tokens.close()
