"""Pulling images from an OCI distribution registry (Docker Hub, GHCR, a `docker-registry` on
loopback) into a local OCI layout whose layers are tar+zstd.

Why our own client: sandbox nodes have no Docker daemon, and skopeo/crane are not on every
machine; the distribution API needs only a few GETs. What it speaks: anonymous (or basic) token
auth from the `WWW-Authenticate: Bearer realm,service,scope` challenge, OCI image indexes and
Docker manifest lists (one platform picked), OCI and Docker v2 schema 2 manifests. Every blob is
streamed to disk and checked against its digest before it is converted (`archive.LayoutWriter`),
every layer's diff_id against the config; the layout is published whole or not at all.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from burstrl.sandbox.archive import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    SOURCE,
    LayoutWriter,
    Progress,
    clean_config,
    config_diff_ids,
    pick_platform,
)
from burstrl.sandbox.images import (
    INDEX_TYPE,
    MANIFEST_TYPE,
    Descriptor,
    ImageError,
    ImageRef,
)

ACCEPT = f"{INDEX_TYPE}, {DOCKER_LIST}, {MANIFEST_TYPE}, {DOCKER_MANIFEST}"
DOCKER_HUB = "registry-1.docker.io"
_CHUNK = 1 << 20
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")


@dataclass(frozen=True)
class Reference:
    """A parsed image reference: `registry/repository` and a tag or a digest."""

    registry: str
    repository: str
    reference: str  # a tag, or sha256:<hex>

    @property
    def is_digest(self) -> bool:
        return self.reference.startswith("sha256:")


def parse_ref(ref: str) -> Reference:
    """Parse `[registry/]name[:tag][@sha256:...]` as docker does: the first component is a
    registry when it has a `.` or a `:` or is `localhost`; else Docker Hub (`library/` for
    one-component names). A digest wins over a tag."""
    rest, _, digest = ref.partition("@")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, name = first, remainder
    else:
        registry, name = DOCKER_HUB, rest
    tag = "latest"
    if ":" in name.rsplit("/", 1)[-1]:
        name, _, tag = name.rpartition(":")
    if registry == DOCKER_HUB and "/" not in name:
        name = f"library/{name}"
    if not _REPO.match(name):
        raise ImageError(f"{ref!r}: {name!r} is not a valid repository name")
    if digest:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ImageError(f"{ref!r}: {digest!r} is not a sha256 digest")
        return Reference(registry, name, digest)
    return Reference(registry, name, tag)


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, params) of a WWW-Authenticate header: `Bearer realm="...",service="...",scope="..."`."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


class RegistryClient:
    """GETs against one repository of a registry, answering auth challenges as they come.

    `auth` (user, password) is used for a Basic challenge or to get a token; None is anonymous.
    `insecure` speaks plain HTTP (a registry on loopback without TLS)."""

    def __init__(self, ref: Reference, *, insecure: bool = False, auth: tuple[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        self.ref, self.auth = ref, auth
        self.base = f"{'http' if insecure else 'https'}://{ref.registry}/v2/{ref.repository}"
        self.http = httpx.Client(timeout=timeout_s, follow_redirects=True)
        self.headers: dict[str, str] = {}

    def close(self) -> None:
        self.http.close()

    def _authorize(self, response: httpx.Response) -> None:
        scheme, params = _challenge(response.headers.get("www-authenticate", ""))
        if scheme == "basic":
            if self.auth is None:
                raise ImageError(f"{self.ref.registry} asks for a user and password (basic auth)")
            user, password = self.auth
            self.headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise ImageError(f"{self.ref.registry}: unauthorized, and no token challenge to answer "
                             f"({response.headers.get('www-authenticate')!r})")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull")
        r = self.http.get(params["realm"], params=query, auth=self.auth)
        if r.status_code != 200:
            raise ImageError(f"token request to {params['realm']} failed: HTTP {r.status_code} {r.text[:200]}")
        body = r.json()
        token = body.get("token") or body.get("access_token")
        if not token:
            raise ImageError(f"token server {params['realm']} answered without a token")
        self.headers["Authorization"] = f"Bearer {token}"

    def get(self, path: str, accept: str | None = None, stream: bool = False) -> httpx.Response:
        """GET `path` under the repository; one retry after answering a 401 challenge."""
        for attempt in range(2):
            headers = dict(self.headers, **({"Accept": accept} if accept else {}))
            req = self.http.build_request("GET", self.base + path, headers=headers)
            try:
                r = self.http.send(req, stream=stream)
            except httpx.HTTPError as exc:
                raise ImageError(f"cannot reach {self.base}{path}: {exc!r}") from exc
            if r.status_code == 401 and attempt == 0:
                r.read()
                r.close()
                self._authorize(r)
                continue
            if r.status_code != 200:
                text = r.read()[:300].decode(errors="replace")
                r.close()
                raise ImageError(f"GET {self.base}{path}: HTTP {r.status_code} {text}")
            return r
        raise AssertionError("unreachable")

    def manifest(self, reference: str) -> tuple[dict[str, Any], str, str]:
        """(manifest JSON, its media type, its digest); checked when fetched by digest."""
        r = self.get(f"/manifests/{reference}", accept=ACCEPT)
        data = r.content
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise ImageError(f"manifest {reference} does not match its digest (got {digest})")
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise ImageError(f"manifest {reference} is not JSON: {exc}") from exc
        media = body.get("mediaType") or r.headers.get("content-type", "").split(";")[0]
        if body.get("schemaVersion") == 1:
            raise ImageError(f"{reference}: Docker schema 1 manifests are not supported (deprecated)")
        return body, media, digest

    def blob_json(self, desc: Descriptor) -> dict[str, Any]:
        data = self.get(f"/blobs/{desc.digest}").content
        if "sha256:" + hashlib.sha256(data).hexdigest() != desc.digest:
            raise ImageError(f"blob {desc.digest} does not match its digest")
        return json.loads(data)

    def download(self, desc: Descriptor, dest: Path, label: str, progress: Progress | None) -> None:
        """Stream a blob to `dest`, checking its size and sha256 as it arrives."""
        sha, size = hashlib.sha256(), 0
        r = self.get(f"/blobs/{desc.digest}", stream=True)
        try:
            with open(dest, "wb") as fh:
                for chunk in r.iter_bytes(_CHUNK):
                    sha.update(chunk)
                    size += len(chunk)
                    fh.write(chunk)
                    if progress is not None:
                        progress(f"{label} (download)", size, desc.size)
                    if size > desc.size:
                        break
        except httpx.HTTPError as exc:
            raise ImageError(f"download of {desc.digest} failed: {exc!r}") from exc
        finally:
            r.close()
        if size != desc.size or "sha256:" + sha.hexdigest() != desc.digest:
            raise ImageError(f"blob {desc.digest} is corrupt: expected {desc.size} bytes with that digest, "
                             f"got {size} bytes, sha256:{sha.hexdigest()}")


def pull(ref: str, out_dir: Path, *, insecure: bool = False, platform: str = "linux/amd64",
         auth: tuple[str, str] | None = None, force: bool = False,
         progress: Progress | None = None) -> ImageRef:
    """Pull `ref` (e.g. `localhost:5000/name:tag`, `registry.example.com/ns/name@sha256:...`) into an
    OCI layout at `out_dir` tagged `latest`, every layer recompressed to tar+zstd.

    A manifest list / index yields the `platform` (`os/arch[/variant]`) image. The source ref
    and manifest digest are kept in the new manifest's annotations."""
    parsed = parse_ref(ref)
    client = RegistryClient(parsed, insecure=insecure, auth=auth)
    try:
        manifest, media, digest = client.manifest(parsed.reference)
        if media in (INDEX_TYPE, DOCKER_LIST) or "manifests" in manifest:
            chosen = pick_platform(manifest, platform, ref)
            manifest, media, digest = client.manifest(chosen.digest)
        if media not in (MANIFEST_TYPE, DOCKER_MANIFEST) and "layers" not in manifest:
            raise ImageError(f"{ref}: unsupported manifest type {media!r}")
        config = client.blob_json(Descriptor.from_json(manifest.get("config") or {}))
        layers = [Descriptor.from_json(d) for d in manifest.get("layers") or []]
        diff_ids = config_diff_ids(config, len(layers), ref)
        with LayoutWriter(out_dir, force, progress) as writer:
            for i, (desc, diff_id) in enumerate(zip(layers, diff_ids, strict=False)):
                label = f"layer {i + 1}/{len(layers)} {desc.digest[7:19]}"
                tmp = writer.scratch(f"download-{desc.hex}")
                client.download(desc, tmp, label, progress)
                with open(tmp, "rb") as fh:
                    writer.add_layer(fh, desc.media_type, label=label, diff_id=diff_id)  # type: ignore[arg-type]
                tmp.unlink()
            return writer.finish(clean_config(config), annotations={SOURCE: ref, f"{SOURCE}.digest": digest})
    finally:
        client.close()
