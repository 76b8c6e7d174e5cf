"""SHA-256 manifest of the shipped assets (``unirl_pl/assets``) and the check that loaded assets match it.

``unirl_pl/assets/MANIFEST.sha256`` is in ``sha256sum`` format (``<hex>  <path relative to assets/>``),
so ``cd unirl_pl/assets && sha256sum -c MANIFEST.sha256`` checks a checkout or an installed wheel by
hand. :func:`verify_assets` checks the files of an asset folder when it is loaded: a pretrained folder
that a partial download, a bad merge or an edit changed fails with the name of the file, instead of
training from different weights. Paths outside ``unirl_pl/assets`` (your own models) are not checked.

After regenerating assets (the ShapesWorld pretraining recipes write ``unirl_pl/assets/shapes``),
rewrite the manifest: ``python -m unirl_pl.manifest --write``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from unirl_pl.errors import InputError

ASSETS = Path(__file__).resolve().parent / "assets"
MANIFEST_NAME = "MANIFEST.sha256"


class AssetIntegrityError(InputError):
    """A shipped asset file differs from, is missing from, or is not listed in ``MANIFEST.sha256``."""


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@cache
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too, so a file changed on disk is hashed again.
    return sha256_file(path)


def _asset_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME and "__pycache__" not in p.parts
    )


def load_manifest(assets: Path = ASSETS) -> dict[str, str]:
    """``{path relative to assets/ (POSIX): hex sha256}`` from ``assets/MANIFEST.sha256``."""
    manifest = assets / MANIFEST_NAME
    if not manifest.is_file():
        raise AssetIntegrityError(f"the asset manifest {manifest} is missing; reinstall unirl_pl")
    entries = {}
    for lineno, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise AssetIntegrityError(f"{manifest}:{lineno}: not a sha256sum line: {line!r}")
        entries[name.removeprefix("*")] = digest.lower()
    return entries


def write_manifest(assets: Path = ASSETS) -> Path:
    """(Re)write ``assets/MANIFEST.sha256`` over every file under ``assets``; returns its path."""
    lines = [f"{sha256_file(p)}  {p.relative_to(assets).as_posix()}" for p in _asset_files(assets)]
    manifest = assets / MANIFEST_NAME
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


def verify_assets(paths: str | os.PathLike | Iterable[str | os.PathLike], assets: Path = ASSETS) -> list[Path]:
    """Check every file under each of ``paths`` (folders or files) that lies inside ``assets`` against the manifest.

    Raises :class:`AssetIntegrityError` naming the first file whose hash differs, a file the manifest
    does not list, or a listed file that is missing. Paths outside ``assets`` (and hub ids that are not
    local paths) are skipped. Returns the files checked. Hashes are cached per (file, size, mtime),
    so checking the same folder again is cheap.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    assets = assets.resolve()
    checked: list[Path] = []
    manifest: dict[str, str] | None = None
    for raw in paths:
        path = Path(raw).resolve()
        if not path.exists() or not path.is_relative_to(assets):
            continue
        manifest = load_manifest(assets) if manifest is None else manifest
        files = [path] if path.is_file() else _asset_files(path)
        for file in files:
            name = file.relative_to(assets).as_posix()
            if name == MANIFEST_NAME:
                continue
            want = manifest.get(name)
            if want is None:
                raise AssetIntegrityError(
                    f"shipped asset {file} is not in {assets / MANIFEST_NAME}: an extra file in the asset folder "
                    "(remove it, or run `python -m unirl_pl.manifest --write` if you regenerated the assets)"
                )
            stat = file.stat()
            got = _cached_sha256(str(file), stat.st_size, stat.st_mtime_ns)
            if got != want:
                raise AssetIntegrityError(
                    f"shipped asset {file} does not match its sha256 in {assets / MANIFEST_NAME} "
                    f"(expected {want[:12]}..., got {got[:12]}...): the file is corrupt or was changed. Reinstall "
                    "unirl_pl (or `git checkout` the file), or run `python -m unirl_pl.manifest --write` if you "
                    "regenerated the assets on purpose"
                )
            checked.append(file)
        if path.is_dir():
            prefix = path.relative_to(assets).as_posix()
            prefix = "" if prefix == "." else prefix + "/"
            missing = sorted(n for n in manifest if n.startswith(prefix) and not (assets / n).is_file())
            if missing:
                raise AssetIntegrityError(
                    f"shipped asset folder {path} is missing {', '.join(missing)} (listed in "
                    f"{assets / MANIFEST_NAME}); reinstall unirl_pl"
                )
    return checked


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Check (default) or rewrite the shipped-asset manifest.")
    parser.add_argument("--write", action="store_true", help="rewrite MANIFEST.sha256 from the files on disk")
    args = parser.parse_args(argv)
    if args.write:
        print(f"wrote {write_manifest()}")
    else:
        print(f"{len(verify_assets(ASSETS))} asset files match {ASSETS / MANIFEST_NAME}")


if __name__ == "__main__":
    main()
