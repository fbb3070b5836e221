"""`burstrl image ...`: build, inspect, pull and import sandbox images."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from burstrl.cli.app import (
    fail,
    image_app,
)


@image_app.command("build")
def image_build(
    src: Path = typer.Argument(..., help="Directory whose tree becomes the new layer."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    base: Path | None = typer.Option(None, "--base", help="OCI layout whose layers go underneath."),
    dest: str = typer.Option("/work", "--dest", help="Where SRC's tree sits inside the image."),
    compression: str = typer.Option("zstd", "--compression", help="Layer compression: zstd or gzip."),
    tag: str = typer.Option("latest", "--tag", help="Tag of the image in OUT's index."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Build an image: BASE's layers + one layer of SRC at DEST; print the manifest digest."""
    from burstrl.sandbox.images import ImageError, build_image

    if compression not in ("zstd", "gzip"):
        fail(f"unknown compression {compression!r}; choose zstd or gzip")
    try:
        ref = build_image(src, out, base=base, dest=dest, compression=compression, tag=tag, force=force)
    except (ImageError, OSError) as exc:
        fail(str(exc))
    typer.echo(ref.manifest_digest)


@image_app.command("inspect")
def image_inspect(
    layout: Path = typer.Argument(..., help="OCI layout directory."),
    tag: str = typer.Option("latest", "--tag", help="Which image of the layout."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Hash every layer blob too."),
) -> None:
    """Print an image's manifest digest, config and layers as JSON (every blob checked)."""

    from burstrl.sandbox.images import ImageError, describe, read_image, verify_image

    try:
        image = read_image(layout, tag)
        if verify:
            verify_image(image)
    except (ImageError, OSError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(describe(image), indent=2))


@image_app.command("pull")
def image_pull(
    ref: str = typer.Argument(..., help="Image reference: [REGISTRY/]NAME[:TAG][@sha256:DIGEST]."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP (a registry without TLS, e.g. on loopback)."),
    platform: str = typer.Option("linux/amd64", "--platform", help="os/arch[/variant] picked from a manifest list."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Pull an image from a registry into OUT, layers recompressed to zstd; print the manifest digest.

    Credentials, where the registry wants them: BURSTRL_REGISTRY_USER and BURSTRL_REGISTRY_PASSWORD."""
    import os

    from burstrl.sandbox.archive import stderr_progress
    from burstrl.sandbox.images import ImageError
    from burstrl.sandbox.registry import pull

    user, password = os.environ.get("BURSTRL_REGISTRY_USER"), os.environ.get("BURSTRL_REGISTRY_PASSWORD")
    try:
        ref_out = pull(ref, out, insecure=insecure, platform=platform, force=force,
                       auth=(user, password or "") if user else None, progress=stderr_progress())
    except (ImageError, OSError) as exc:
        fail(str(exc))
    typer.echo(ref_out.manifest_digest)


@image_app.command("import")
def image_import(
    archive: Path = typer.Argument(..., help="A `docker save` tarball or an OCI archive (tar, or tar.gz)."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    tag: str | None = typer.Option(None, "--tag", help="Which image of a multi-image archive (NAME:TAG)."),
    platform: str = typer.Option("linux/amd64", "--platform", help="os/arch[/variant] picked from an index."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Import an image archive into OUT, layers recompressed to zstd; print the manifest digest."""
    from burstrl.sandbox.archive import import_archive, stderr_progress
    from burstrl.sandbox.images import ImageError

    try:
        ref_out = import_archive(archive, out, tag=tag, platform=platform, force=force,
                                 progress=stderr_progress())
    except (ImageError, OSError) as exc:
        fail(str(exc))
    typer.echo(ref_out.manifest_digest)


@image_app.command("base")
def image_base(
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    package: list[str] = typer.Option(["pytest"], "--package",
                                      help="Pure-Python distribution installed here to copy in, with its "
                                           "requirements (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Build, offline, a base image with Python + pytest + git from this host's files; print its digest."""
    from burstrl.sandbox.baseimage import build_base_image
    from burstrl.sandbox.images import ImageError

    try:
        ref_out = build_base_image(out, tuple(package), force=force)
    except (ImageError, OSError, RuntimeError) as exc:
        fail(str(exc))
    typer.echo(ref_out.manifest_digest)


