"""The ``dataset-rt`` command line (also ``python -m dataset_rt``).

Commands: ``inspect`` (manifest summary), ``verify`` (every checksum), ``head`` (raw records with
their embedded metadata), ``view`` (an HTML page or PNG contact sheet of the samples), ``pack`` (a
directory tree into a cache), ``push``, ``pull`` and ``ls`` (caches published on object storage)
and ``demo`` (the quickstart on an embedded synthetic dataset). Reading, validating, decoding and
transferring caches happens in Rust; this module parses arguments and prints.

Exit status: 0 success; 1 a cache failed validation or an operation failed; 2 a usage error or a
path that is not a cache; 141 (128 + SIGPIPE) the standard output was closed early, as by
``| head -1``, which ends the command quietly.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import signal
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from dataset_rt import _native
from dataset_rt._config import (
    ReaderConfig,
    RemoteConfig,
    ShardCompression,
    WriterConfig,
    is_url,
)
from dataset_rt._native import ConfigError, DatasetRTError
from dataset_rt._results import (
    CacheInput,
    CacheLoaded,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWritten,
)
from dataset_rt._runtime import DatasetRuntime

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_PIPE", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# The standard output was closed early (`| head -1`): what the shell reports for a process
# killed by SIGPIPE. SIGPIPE itself stays ignored (Python's setting, which the native runtime's
# sockets rely on); the write's EPIPE ends the command instead.
EXIT_PIPE = 128 + signal.SIGPIPE

_PREVIEW_BYTES = 32


def _size(n: int) -> str:
    """Exact bytes, plus a binary-prefixed size when that helps."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{n} bytes ({value:.1f} {unit})"


def _error(message: str) -> None:
    print(f"dataset-rt: error: {message}", file=sys.stderr)


def _shown(path: str | Path) -> str:
    """A path as text that any output takes: bytes of a name that are not UTF-8 (which
    ``os.fsdecode`` turned into lone surrogates) are shown as ``\\xff`` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _positive_int(text: str) -> int:
    return _int_from(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_from(text, 0)


def _int_from(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


# --- inspect ---------------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    remote = is_url(args.cache)
    if remote:
        text = _native.inspect_remote_cache(args.cache, _remote_config(args))
    else:
        text = _native.inspect_cache(args.cache)
    if args.json:
        print(text.rstrip("\n"))
        return EXIT_OK
    manifest: dict[str, Any] = json.loads(text)
    if "parts" in manifest:
        return _print_set(args.cache, manifest)
    shards: list[dict[str, Any]] = manifest["shards"]
    schema = ", ".join(f"{f['name']}: {f['type']}" for f in manifest["metadata_schema"])
    if manifest["sample_id"] == "metadata":
        sample_id = f"metadata key 'sample_id' ({manifest['sample_id_type']})"
    else:
        sample_id = f"record position ({manifest['sample_id_type']})"
    compression = manifest["compression"]
    raw, stored = manifest["raw_payload_bytes"], manifest["stored_payload_bytes"]
    stored_share = f"stored/raw = {stored / raw:.3f}" if raw else "stored/raw = n/a"
    rows = [
        ("cache", args.cache if remote else str(Path(args.cache).resolve())),
        ("name", manifest["name"]),
        ("format", f"{manifest['format']} v{manifest['format_version']}"),
        ("writer", manifest["writer_version"]),
        ("samples", str(manifest["num_samples"])),
        ("schema", schema or "(no metadata)"),
        ("sample_id", sample_id),
        ("compression", f"{compression['algo']} (ratio {compression['ratio']:g})"),
        ("shards", f"{len(shards)} file(s), {_size(sum(s['bytes'] for s in shards))}"),
        ("index", f"{manifest['index']['file']}, {_size(manifest['index']['bytes'])}"),
        ("metadata", f"{manifest['metadata']['file']}, {_size(manifest['metadata']['bytes'])}"),
        ("payload raw", _size(raw)),
        ("payload stored", f"{_size(stored)}, {stored_share}"),
        ("checksums", f"{manifest['checksum_algo']}, alignment {manifest['alignment']}"),
        ("fingerprint", manifest["fingerprint"]),
    ]
    width = max(len(key) for key, _ in rows) + 1
    for key, value in rows:
        print(f"{key + ':':<{width}} {value}")
    return EXIT_OK


def _print_set(path: str, manifest: dict[str, Any]) -> int:
    """A cache set's summary: the set, then one line per part."""
    parts: list[dict[str, Any]] = manifest["parts"]
    rows = [
        ("cache set", path if is_url(path) else str(Path(path).resolve())),
        ("name", manifest["name"]),
        ("format", f"{manifest['format']} v{manifest['format_version']}"),
        ("writer", manifest["writer_version"]),
        ("samples", str(manifest["num_samples"])),
        ("parts", str(len(parts))),
        ("fingerprint", manifest["fingerprint"]),
    ]
    width = max(len(key) for key, _ in rows) + 1
    for key, value in rows:
        print(f"{key + ':':<{width}} {value}")
    name_width = max(len(p["name"]) for p in parts)
    for part in parts:
        print(
            f"  {part['name']:<{name_width}}  {part['num_samples']:>12} samples  "
            f"{part['fingerprint']}"
        )
    return EXIT_OK


# --- verify ----------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        if is_url(args.cache):
            samples, shards = _native.verify_remote_cache(args.cache, _remote_config(args))
        else:
            samples, shards = _native.verify_cache(args.cache)
    except ConfigError:
        raise  # a usage error (a URL or setting it cannot use): exit status 2, below
    except DatasetRTError as error:
        print(f"FAILED: {_shown(args.cache)}", file=sys.stderr)
        _error(str(error))
        return EXIT_FAILED
    print(f"OK: {samples} samples, {shards} shards verified")
    return EXIT_OK


# --- head ------------------------------------------------------------------------------------


def _cmd_head(args: argparse.Namespace) -> int:
    records = _native.head_records(args.cache, args.n, _PREVIEW_BYTES)
    if not records:
        print("(no records)")
    for i, record in enumerate(records):
        (
            sample,
            metadata,
            _shard,
            shard_file,
            offset,
            flags,
            encoding,
            stored_len,
            raw_len,
            checksum,
            preview,
        ) = record
        if i:
            print()
        print(
            f"record {sample}: {shard_file} offset {offset}, flags {flags:#x} ({encoding}), "
            f"stored {stored_len} bytes, raw {raw_len} bytes, checksum {checksum}"
        )
        print(f"  metadata: {metadata}")
        more = "..." if raw_len > len(preview) else ""
        print(f"  payload:  {raw_len} bytes: {preview.hex()}{more}")
    return EXIT_OK


# --- view ------------------------------------------------------------------------------------


def _cmd_view(args: argparse.Namespace) -> int:
    from dataset_rt._viewer import FilterError, parse_filters, read_samples, render_html, render_png

    try:
        filters = parse_filters(args.filter)
        remote = _remote_config(args) if is_url(args.cache) else None
        samples = read_samples(args.cache, filters, args.limit, remote=remote)
    except FilterError as error:
        _error(str(error))
        return EXIT_USAGE
    try:
        if args.png is not None:
            args.png.write_bytes(render_png(samples))
            print(f"wrote {args.png}: contact sheet of {len(samples)} sample(s)")
        if args.out is not None or args.png is None:
            out = args.out if args.out is not None else Path("view.html")
            out.write_text(render_html(_shown(args.cache), samples, args.filter), encoding="utf-8")
            print(f"wrote {out}: {len(samples)} sample(s)")
    except ImportError as error:
        _error(str(error))
        return EXIT_FAILED
    return EXIT_OK


# --- pack ------------------------------------------------------------------------------------


class PackRefused(ValueError):
    """A file or link under the packed directory that ``pack`` will not store; the message says
    which and what to do."""


# Read-only, never blocking on a FIFO, not inherited by child processes.
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _list_files(root: Path, *, follow_symlinks: bool) -> list[tuple[str, tuple[str, ...] | None]]:
    """Every file under ``root``, sorted by its POSIX path relative to ``root``, with the
    components of its real location below ``root`` (``None``: outside, reached through a link
    that ``follow_symlinks`` allowed).

    A symbolic link whose target lies inside ``root`` is packed as what it points to (a file, or
    a folder's files under the link's path). A link leaving ``root`` is refused unless
    ``follow_symlinks``. A broken link, a link loop and anything that is neither a regular file
    nor a folder (FIFO, socket, device) are refused. Nothing is skipped silently."""
    root = Path(os.path.realpath(root))
    found: list[tuple[str, tuple[str, ...] | None]] = []

    def refuse_link(path: Path, what: str) -> PackRefused:
        return PackRefused(f"{path} is a symbolic link {what}")

    def walk(
        path: Path, rel: tuple[str, ...], real: tuple[str, ...] | None, seen: frozenset[Any]
    ) -> None:
        info = os.stat(path)
        folder = (info.st_dev, info.st_ino)
        if folder in seen:
            raise refuse_link(path, "back to a folder that contains it (a loop); remove the link")
        seen = seen | {folder}
        with os.scandir(path) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        for entry in entries:
            entry_path = Path(entry.path)
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                raise PackRefused(
                    f"{_shown(entry_path)}: the name is not UTF-8; a file's path is its "
                    "sample_id, a str: rename the file"
                ) from None
            entry_rel = (*rel, entry.name)
            entry_real = None if real is None else (*real, entry.name)
            if entry.is_symlink():
                target = Path(os.path.realpath(entry_path))
                # Broken first, wherever it points: --follow-symlinks could not pack it either.
                if not target.exists():
                    raise refuse_link(
                        entry_path,
                        f"to {os.readlink(entry_path)}, which does not exist; remove the link",
                    )
                if _inside(target, root):
                    entry_real = target.relative_to(root).parts
                elif follow_symlinks:
                    entry_real = None
                else:
                    raise refuse_link(
                        entry_path,
                        f"to {os.readlink(entry_path)}, outside {root}; pack stores only what "
                        "lies in the folder (a link could pull in any file, such as "
                        "/proc/self/environ). Replace the link with the file, or pass "
                        "--follow-symlinks to pack what links point to",
                    )
                if target.is_dir():
                    walk(entry_path, entry_rel, entry_real, seen)
                    continue
            elif entry.is_dir(follow_symlinks=False):
                walk(entry_path, entry_rel, entry_real, seen)
                continue
            found.append(("/".join(entry_rel), entry_real))

    walk(root, (), (), frozenset())
    found.sort(key=lambda item: item[0])
    return found


def _open_below(root_fd: int, parts: tuple[str, ...]) -> int:
    """Opens ``parts`` below the directory ``root_fd`` without following any symbolic link on the
    way, so a link planted after the listing cannot lead outside."""
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = _OPEN | os.O_NOFOLLOW | (0 if last else os.O_DIRECTORY)
            next_fd = os.open(part, flags, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = next_fd
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise
    return fd


def _read_regular(fd: int, shown: Path) -> bytes:
    """Reads the whole file behind ``fd`` (closing it) after checking that it is a regular file:
    the check and the read use one descriptor, so the file cannot change kind in between."""
    with os.fdopen(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise PackRefused(f"{shown} is not a regular file; pack stores regular files only")
        return f.read()


class _DirectorySource:
    """One sample per file under a directory, in sorted relative-path order, labelled by its
    top-level folder: torchvision's ImageFolder convention, where every file below ``DIR/cls/``
    (nested folders included) is of class ``cls``; ``""`` for files directly in the directory.

    Each file is opened once; its kind is checked on that descriptor. Files inside the directory
    are opened component by component without following links."""

    def __init__(self, name: str, root: Path, *, follow_symlinks: bool) -> None:
        self.name = name
        self._root = root
        self._follow = follow_symlinks
        self.refused: PackRefused | None = None

    def __iter__(self) -> Iterator[CacheInput]:
        try:
            yield from self._samples()
        except PackRefused as refused:
            self.refused = refused
            raise

    def _samples(self) -> Iterator[CacheInput]:
        files = _list_files(self._root, follow_symlinks=self._follow)
        root_fd = os.open(self._root, _OPEN | os.O_DIRECTORY)
        try:
            for rel, real in files:
                shown = self._root / rel
                try:
                    # Outside the folder (``real`` None) only through --follow-symlinks.
                    fd = _open_below(root_fd, real) if real is not None else os.open(shown, _OPEN)
                except OSError as error:
                    if error.errno == errno.ELOOP:
                        raise PackRefused(
                            f"{shown} became a symbolic link while packing; pack again"
                        ) from None
                    if error.errno == errno.ENXIO:  # a socket
                        raise PackRefused(
                            f"{shown} is not a regular file; pack stores regular files only"
                        ) from None
                    raise
                data = _read_regular(fd, shown)
                yield CacheInput(
                    data=data,
                    metadata={
                        "sample_id": rel,
                        "path": rel,
                        "size": len(data),
                        "label": PurePosixPath(rel).parts[0] if "/" in rel else "",
                    },
                )
        finally:
            os.close(root_fd)


def _cmd_pack(args: argparse.Namespace) -> int:
    root = Path(args.dir).resolve()
    cache = Path(args.cache).resolve()
    if not root.is_dir():
        _error(f"{args.dir} is not a directory")
        return EXIT_USAGE
    if cache == root or root in cache.parents:
        _error(f"the cache {args.cache} must not be inside the directory it packs ({args.dir})")
        return EXIT_USAGE
    ratio = args.ratio if args.ratio is not None else (0.9 if args.compression == "lz4" else 1.0)
    writer = WriterConfig(
        shard_compression=ShardCompression(algo=args.compression, ratio=ratio),
        show_progress=not args.quiet,
        shard_size_bytes=args.shard_size,
    )
    source = _DirectorySource(cache.name, root, follow_symlinks=args.follow_symlinks)
    with DatasetRuntime(num_workers=args.workers) as runtime:
        result = runtime.from_cache_sources(
            source,
            cache.parent,
            reader_config=ReaderConfig(shuffle=False),
            writer_config=writer,
        )
    match result:
        case CacheSourcesDatasetSuccess(_, [CacheWritten(name, path, num_samples)]):
            print(f"CacheWritten: packed {num_samples} files from {root} into {path} ({name})")
        case CacheSourcesDatasetSuccess(_, [CacheLoaded(name, path, num_samples)]):
            print(
                f"CacheLoaded: {path} already exists and was reused ({num_samples} samples); "
                f"{root} was not read. Remove the cache to pack again."
            )
        case CacheSourcesDatasetError(_, message):
            _error(str(source.refused) if source.refused else message)
            return EXIT_FAILED
        case _:
            _error(f"unexpected result {result!r}")
            return EXIT_FAILED
    return EXIT_OK


# --- push, pull, ls --------------------------------------------------------------------------


def _remote_config(args: argparse.Namespace) -> RemoteConfig:
    """The flags' settings; each flag left out is taken from the environment."""
    return RemoteConfig(endpoint=args.endpoint, region=args.region, allow_http=args.allow_http)


def _cmd_push(args: argparse.Namespace) -> int:
    report = _native.push_cache(args.cache, args.url, _remote_config(args), args.replace)
    if report["already_published"]:
        print(
            f"already published: {report['url']} holds this cache (fingerprint "
            f"{report['fingerprint']}); nothing was uploaded"
        )
        return EXIT_OK
    uploaded, resumed = len(report["uploaded"]), len(report["resumed"])
    print(
        f"published {args.cache} at {report['url']}: {uploaded} file(s) uploaded"
        + (f", {resumed} already there from an interrupted push" if resumed else "")
        + f" (fingerprint {report['fingerprint']})"
    )
    if report["replaced"] is not None:
        print(f"replaced the cache with fingerprint {report['replaced']}")
    return EXIT_OK


def _cmd_pull(args: argparse.Namespace) -> int:
    report = _native.pull_cache(args.url, args.dir, _remote_config(args))
    what = f"cache set of {report['parts']} parts" if report["parts"] else "cache"
    if report["already_present"]:
        print(
            f"{args.dir} already holds the {what} published at {report['url']} (fingerprint "
            f"{report['fingerprint']}); nothing was downloaded"
        )
    else:
        print(
            f"pulled the {what} at {report['url']} into {args.dir}: {_size(report['bytes'])} "
            f"downloaded and verified (fingerprint {report['fingerprint']})"
        )
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    caches = _native.list_caches(args.url, _remote_config(args))
    unreadable = [cache for cache in caches if cache["error"] is not None]
    if args.json:
        print(json.dumps(caches, indent=2))
    elif not caches:
        print(f"no cache is published at {args.url} or directly under it")
    for cache in [] if args.json else caches:
        if cache["error"] is not None:
            print(f"{cache['url']}: cannot be opened: {cache['error']}")
        else:
            kind = f"cache set of {cache['parts']} parts, " if cache["parts"] else ""
            print(
                f"{cache['url']}: {kind}{cache['num_samples']} samples, "
                f"{_size(cache['bytes'] or 0)}, format v{cache['format_version']}, fingerprint "
                f"{cache['fingerprint']}"
            )
    return EXIT_FAILED if unreadable else EXIT_OK


# --- demo ------------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataset_rt._demo import run_demo

    return run_demo(args.out, num_samples=args.samples, num_workers=args.workers)


# --- main ------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a closed standard output (``--help | head -1``) ends the
    command as it ends every other one: argparse would drop the error and exit 0."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            file = file or sys.stderr
            try:
                file.write(message)
                file.flush()
            except AttributeError:  # no standard stream at all (pythonw)
                pass
            except BrokenPipeError:
                raise
            except OSError:
                pass


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dataset-rt",
        description="Inspect, verify, build and publish DatasetRT caches.",
        epilog="Exit status: 0 success, 1 validation or operation failed, 2 usage error or "
        "not a cache.",
    )
    parser.add_argument("--version", action="version", version=f"dataset-rt {_native.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    remote_help = (
        "URL is s3://BUCKET/PREFIX/NAME (any S3-compatible store) or file:///PATH/NAME. "
        "Credentials come from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN); the endpoint, region and plain-HTTP permission too (AWS_ENDPOINT_URL, "
        "AWS_REGION, AWS_ALLOW_HTTP) unless the flags below give them."
    )

    def remote_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--endpoint",
            metavar="URL",
            default=None,
            help="the store's http(s):// address (default: AWS_ENDPOINT_URL, else AWS)",
        )
        p.add_argument(
            "--region", metavar="NAME", default=None, help="default: AWS_REGION, else us-east-1"
        )
        p.add_argument(
            "--allow-http",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="allow (or refuse) a plain http:// endpoint (default: AWS_ALLOW_HTTP, else no)",
        )

    p = commands.add_parser("inspect", help="summarise a cache's manifest")
    p.add_argument(
        "cache", metavar="CACHE", help="cache directory (base/name), or the URL of a published one"
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    remote_flags(p)
    p.set_defaults(handler=_cmd_inspect)

    p = commands.add_parser(
        "verify",
        help="check the index, the metadata and every record and shard checksum "
        "(exit 1 naming what is corrupt)",
    )
    p.add_argument(
        "cache",
        metavar="CACHE",
        help="cache directory (base/name), or the URL of a published one (its index, metadata "
        "and every record are checked, fetched through the node's local cache)",
    )
    remote_flags(p)
    p.set_defaults(handler=_cmd_verify)

    p = commands.add_parser("head", help="show the first records with their embedded metadata")
    p.add_argument("cache", metavar="CACHE", help="cache directory (base/name)")
    p.add_argument(
        "-n", type=_non_negative_int, default=5, metavar="K", help="records to show (default 5)"
    )
    p.set_defaults(handler=_cmd_head)

    p = commands.add_parser(
        "view",
        help="write an HTML page (or a PNG contact sheet) of the samples",
        description="Writes one self-contained HTML page showing, for each sample in storage "
        "order, its payload as a thumbnail when Pillow decodes it as an image (else a hex and "
        "text preview), its metadata and its weight. Needs Pillow (the 'view' extra). "
        "--filter COLUMN=VALUE or COLUMN!=VALUE keeps the samples whose metadata column, in its "
        "text form (true/false for booleans), equals (or differs from) VALUE; repeat it to "
        "combine filters with AND. Columns are those of samples_metadata(). CACHE may be the "
        "URL of a published cache (s3://BUCKET/PREFIX/NAME or file:///PATH/NAME), read in place "
        "through the node's local cache (DATASET_RT_REMOTE_DIR, else dataset-rt/remote in the "
        "user's cache directory); credentials come from the environment only (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN).",
    )
    p.add_argument(
        "cache", metavar="CACHE", help="cache directory (base/name), or the URL of a published one"
    )
    p.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="HTML page (default view.html)"
    )
    p.add_argument(
        "--png",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a PNG contact sheet (without --out, no HTML page is written)",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="EXPR",
        help="COLUMN=VALUE or COLUMN!=VALUE",
    )
    p.add_argument(
        "--limit", type=_positive_int, default=100, metavar="N", help="samples shown (default 100)"
    )
    remote_flags(p)
    p.set_defaults(handler=_cmd_view)

    p = commands.add_parser(
        "pack",
        help="pack a directory tree into a cache, one sample per file",
        description="Packs every file under DIR (sorted by relative path) into the cache CACHE "
        "(written as base CACHE/.. and name CACHE's last component). Metadata: sample_id and "
        "path (relative POSIX path), size (bytes), label (top-level folder name, '' at the top). "
        "An existing cache is reused, not rewritten. Symbolic links: a link to a file or folder "
        "inside DIR is packed as what it points to, under the link's own path; a link leading "
        "out of DIR is refused unless --follow-symlinks; broken links, link loops and special "
        "files (FIFOs, sockets, devices) are always refused. Nothing is skipped silently.",
    )
    p.add_argument("dir", metavar="DIR", help="directory to pack")
    p.add_argument("cache", metavar="CACHE", help="cache directory to write (base/name)")
    p.add_argument("--compression", choices=("none", "lz4"), default="none")
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="keep a record LZ4-compressed when it shrinks to at most this share of its size "
        "(default 0.9 for lz4, 1.0 for none)",
    )
    p.add_argument("--workers", type=_positive_int, default=4, help="Rust worker threads")
    p.add_argument(
        "--shard-size",
        type=_positive_int,
        default=WriterConfig().shard_size_bytes,
        metavar="BYTES",
        help="target size of one shard file",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="also pack what links leading out of DIR point to (files, and folders with loop "
        "protection); without it such links are refused",
    )
    p.set_defaults(handler=_cmd_pack)

    p = commands.add_parser(
        "push",
        help="publish a local cache at a URL (atomically; an existing cache only with --replace)",
        description="Uploads the cache CACHE_DIR to URL, whose last segment must be the cache's "
        "name, then makes it visible with one conditional write of its manifest: a reader sees "
        "the whole cache or none. A URL that holds another cache is refused unless --replace. "
        "An interrupted push is invisible, and pushing again uploads only what is missing. "
        + remote_help,
    )
    p.add_argument("cache", metavar="CACHE_DIR", help="cache directory (base/name)")
    p.add_argument("url", metavar="URL", help="where to publish it (ends in the cache's name)")
    p.add_argument(
        "--replace", action="store_true", help="replace the cache published at URL, if any"
    )
    remote_flags(p)
    p.set_defaults(handler=_cmd_push)

    p = commands.add_parser(
        "pull",
        help="download a published cache or cache set into a local directory, verified",
        description="Downloads the cache or cache set published at URL into DIR (base/name; the "
        "name must be the cache's or the set's), checking every file's size and checksum against "
        "its manifest. DIR ends up holding the whole cache or nothing; a set's parts are pulled "
        "one by one and its set manifest last, so DIR is a set only once complete, and a rerun "
        "pulls only the missing parts. A DIR that holds something else is refused. " + remote_help,
    )
    p.add_argument("url", metavar="URL", help="the published cache or cache set")
    p.add_argument("dir", metavar="DIR", help="cache directory to create (base/name)")
    remote_flags(p)
    p.set_defaults(handler=_cmd_pull)

    p = commands.add_parser(
        "ls",
        help="list the caches and cache sets published at a URL and directly under it",
        description="Lists the cache or cache set published at URL and those directly under it, "
        "with their samples, size, format and fingerprint (and a set's parts). Exit status 1 when "
        "a manifest is unreadable. " + remote_help,
    )
    p.add_argument("url", metavar="URL", help="a cache's or set's URL, or a prefix holding them")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    remote_flags(p)
    p.set_defaults(handler=_cmd_ls)

    p = commands.add_parser(
        "demo",
        help="write an embedded synthetic image dataset, read it back, run the loader on it",
        description="Generates a deterministic synthetic image-like dataset, writes it under "
        "--out with progress, reads it back shuffled for two epochs and prints a summary. Then "
        "the shared-memory loader decodes it in 2 worker processes, resumes from a checkpoint "
        "taken mid-epoch, and is timed beside torch's DataLoader when torch is installed. "
        "A second run reuses the cache.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("demo-cache"),
        metavar="DIR",
        help="base cache directory (default ./demo-cache)",
    )
    p.add_argument("--samples", type=_positive_int, default=2000, metavar="N")
    p.add_argument("--workers", type=_positive_int, default=4, metavar="N")
    p.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status.
    A standard output closed early (``| head -1``) ends it quietly with ``EXIT_PIPE``."""
    try:
        status = _main(argv)
        # Here, not at the interpreter's exit, so that a closed pipe is seen here.
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE
    return status


def _stdout_closed() -> bool:
    """Whether the standard output is a pipe (or socket) whose reader has gone: a write's
    ``BrokenPipeError`` may come from elsewhere (a worker's pipe), which is an error to report."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _stdout_to_devnull() -> None:
    """Python's recipe for a closed standard output (the signal module's "Note on SIGPIPE"):
    whatever is still buffered goes to /dev/null, so the interpreter's flush at exit does not
    raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, ValueError, OSError):
        pass
    finally:
        os.close(devnull)


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors
        if exit_.code is None:
            return EXIT_OK
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (FileNotFoundError, NotADirectoryError) as error:
        _error(str(error))
        return EXIT_USAGE
    except ConfigError as error:
        _error(str(error))
        return EXIT_USAGE
    except BrokenPipeError as error:
        if _stdout_closed():
            raise
        _error(str(error))
        return EXIT_FAILED
    except (DatasetRTError, OSError) as error:
        _error(str(error))
        return EXIT_FAILED


if __name__ == "__main__":  # ``python -m dataset_rt.cli`` runs the command line too
    raise SystemExit(main())
