"""SHA-256 manifest of the shipped assets (``unirl_pl/assets``) and the check that loaded assets match it.

``unirl_pl/assets/MANIFEST.sha256`` is in ``sha256sum`` format (``<hex>  <path relative to assets/>``),
so ``cd unirl_pl/assets && sha256sum -c MANIFEST.sha256`` checks a checkout or an installed wheel by
hand. :func:`verify_assets` checks the files of an asset folder when it is loaded: a pretrained folder
that a partial download, a bad merge or an edit changed fails with the name of the file, instead of
training from different weights.

A folder outside ``unirl_pl/assets`` (your own models, or a copy of the shipped ones) is checked too, where it
can be:

- a folder holding its own ``MANIFEST.sha256`` (the ShapesWorld pretraining exports write one; for any folder
  ``python -m unirl_pl.manifest --write FOLDER``) is checked against it, as the shipped assets are;
- else each ``*.safetensors`` file in it that has the name, size and tensor header (the JSON before the
  payload) of a file the manifest lists is a copy of that file, and its payload must hash as the manifest
  says: a copy whose bytes were flipped is refused, naming it. Only those files are hashed, once per process.
- Other files are not checked: without a manifest nothing says what their bytes should be (a corrupt header
  still fails to load, in safetensors).

After regenerating assets (the ShapesWorld pretraining recipes write ``unirl_pl/assets/shapes``),
rewrite the manifest: ``python -m unirl_pl.manifest --write``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
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


def _hash(file: Path) -> str:
    stat = file.stat()
    return _cached_sha256(str(file), stat.st_size, stat.st_mtime_ns)


def verify_assets(
    paths: str | os.PathLike | Iterable[str | os.PathLike], assets: Path = ASSETS, component: str | None = None
) -> list[Path]:
    """Check every file under each of ``paths`` (folders or files) against a manifest.

    Inside ``assets`` the files are checked against ``assets/MANIFEST.sha256``; outside it, a folder with its own
    ``MANIFEST.sha256`` against that one, and a copy of a listed ``*.safetensors`` file (same name, size and
    header) against the listed hash (the module docstring has the rules). Raises :class:`AssetIntegrityError`
    naming the first file whose hash differs, a file the manifest does not list, or a listed file that is
    missing, and ``component`` (the expert reading it) when given. Paths that do not exist (hub ids) are
    skipped. Returns the files checked. Hashes are cached per (file, size, mtime), so checking the same
    folder again is cheap.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    assets = assets.resolve()
    who = f"{component}: " if component else ""
    checked: list[Path] = []
    for raw in paths:
        path = Path(raw).resolve()
        if not path.exists():
            continue
        if path.is_relative_to(assets):
            checked += _verify_listed(path, assets, who, shipped=True)
        elif (own := path if path.is_dir() else path.parent).joinpath(MANIFEST_NAME).is_file():
            checked += _verify_listed(path, own, who, shipped=False)
        else:
            checked += _verify_copies(path, assets, who)
    return checked


def _verify_listed(path: Path, root: Path, who: str, shipped: bool) -> list[Path]:
    """The files under ``path`` checked against ``root/MANIFEST.sha256`` (the shipped one, or a folder's own)."""
    manifest, listing = load_manifest(root), root / MANIFEST_NAME
    what = "shipped asset" if shipped else "file"
    rewrite = "python -m unirl_pl.manifest --write" + ("" if shipped else f" {root}")
    checked = []
    for file in [path] if path.is_file() else _asset_files(path):
        name = file.relative_to(root).as_posix()
        if name == MANIFEST_NAME:
            continue
        want = manifest.get(name)
        if want is None:
            raise AssetIntegrityError(
                f"{who}{what} {file} is not in {listing}: an extra file in the asset folder "
                f"(remove it, or run `{rewrite}` if you regenerated the assets)"
            )
        got = _hash(file)
        if got != want:
            fix = "Reinstall unirl_pl (or `git checkout` the file), or" if shipped else "Copy it again, or"
            raise AssetIntegrityError(
                f"{who}{what} {file} does not match its sha256 in {listing} "
                f"(expected {want[:12]}..., got {got[:12]}...): the file is corrupt or was changed. {fix} run "
                f"`{rewrite}` if you regenerated the assets on purpose"
            )
        checked.append(file)
    if path.is_dir():
        prefix = path.relative_to(root).as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        missing = sorted(n for n in manifest if n.startswith(prefix) and not (root / n).is_file())
        if missing:
            fix = "reinstall unirl_pl" if shipped else f"copy them again, or run `{rewrite}`"
            folder = "shipped asset folder" if shipped else "folder"
            raise AssetIntegrityError(
                f"{who}{folder} {path} is missing {', '.join(missing)} (listed in {listing}); {fix}"
            )
    return checked


def safetensors_header(path: str | os.PathLike) -> bytes | None:
    """The 8-byte length and JSON header of a ``.safetensors`` file (all but its payload); None when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if length > os.fstat(f.fileno()).st_size:
                return None
            return head + f.read(length)
    except OSError:
        return None


@cache
def _listed_safetensors(assets: Path, mtime_ns: int) -> dict[tuple[str, int], list[tuple[str, str, bytes | None]]]:
    """``(file name, size) -> [(path relative to assets/, sha256, header)]`` of the manifest's ``*.safetensors``
    files (read once per manifest version)."""
    index: dict[tuple[str, int], list[tuple[str, str, bytes | None]]] = {}
    for name, digest in load_manifest(assets).items():
        file = assets / name
        if name.endswith(".safetensors") and file.is_file():
            key = (file.name, file.stat().st_size)
            index.setdefault(key, []).append((name, digest, safetensors_header(file)))
    return index


def _verify_copies(path: Path, assets: Path, who: str) -> list[Path]:
    """The ``*.safetensors`` files under ``path`` (outside ``assets``) that are copies of a listed file, checked.

    A copy has the listed file's name, size and header: everything but the payload is the shipped file's, so a
    different payload is a corrupt copy (weights trained from it are written with a manifest of their own).
    """
    manifest = assets / MANIFEST_NAME
    if not manifest.is_file():
        return []
    listed = _listed_safetensors(assets, manifest.stat().st_mtime_ns)
    files = [path] if path.is_file() else sorted(path.rglob("*.safetensors"))
    checked = []
    for file in files:
        candidates = listed.get((file.name, file.stat().st_size)) if file.suffix == ".safetensors" else None
        header = safetensors_header(file) if candidates else None
        # Several shipped files may share a name, size and header (the scene DiT and the edit DiT trained from it):
        # a copy of any of them is intact.
        copies = [(n, d) for n, d, h in candidates or [] if header is not None and h == header]
        if not copies:
            continue
        name, want = copies[0]
        got = _hash(file)
        if got not in {d for _, d in copies}:
            raise AssetIntegrityError(
                f"{who}{file} is a copy of the shipped asset {name} (same size and tensor header) but its payload "
                f"differs from that file's sha256 in {manifest} (expected {want[:12]}..., got {got[:12]}...): the "
                f"copy is corrupt. Copy it again from {assets / name}; weights you trained yourself are checked "
                f"against their folder's own manifest instead: write it with "
                f"`python -m unirl_pl.manifest --write {file.parent}`"
            )
        checked.append(file)
    return checked


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Check (default) or rewrite the shipped-asset manifest.")
    parser.add_argument("--write", action="store_true", help="rewrite MANIFEST.sha256 from the files on disk")
    parser.add_argument(
        "folder", nargs="?", default=None, help="a model folder of your own (default: the shipped assets)"
    )
    args = parser.parse_args(argv)
    folder = ASSETS if args.folder is None else Path(args.folder)
    if args.write:
        print(f"wrote {write_manifest(folder)}")
    else:
        print(f"{len(verify_assets(folder))} files match {folder / MANIFEST_NAME}")


if __name__ == "__main__":
    main()
