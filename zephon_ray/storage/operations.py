"""The I/O: every durable read and write of zephon-ray, on a local path or an object-store URI.

    exists  is_file  is_dir  size  listing  entries                  what is there
    read_bytes  read_json  open_input_file  sha256                   reads
    write_atomic  write_json  spool / spool_path + upload            writes that commit whole
    make_dirs  delete  delete_tree                                   the rest

Every durable file zephon-ray writes or reads (service ``state_dir``, materialised directories, pre-tokenised
copies, the loader's state files) goes through these functions; recipe *sources* are read by Zephon's own storage
router instead (:mod:`zephon_ray.zephon_io`), so that the listing and the bytes are Zephon's view. Each takes a
local path, an object-store URI or a :class:`~zephon_ray.storage.locations.Location`.

Commit points (what a reader can see):

- **Local path**: :func:`write_atomic` writes a temp file in the same directory, fsyncs it, renames it over the
  target and fsyncs the directory, so a reader sees the old content or the new one, never a mix, even after a
  crash. :func:`upload` commits a finished spool file the same way (a rename).
- **Object store** (no rename): :func:`write_atomic` is one upload of the whole object. S3 makes an object
  visible only when its PUT (or a multipart upload's CompleteMultipartUpload) succeeds, and then whole: a reader
  sees the previous object or the new one. Nothing is atomic *across* objects, so every format here writes its
  data objects first and its manifest/state object last, under the name that commits; an object the manifest
  does not name is never read. Not atomic on S3: a group of objects, a delete of a prefix, and a listing taken
  during writes (S3 listings are strongly consistent since 2020, but a listing sees whichever objects are
  complete at that instant).
- Azure (pyarrow's AzureFileSystem) creates a new blob empty when the upload starts and fills it when it commits:
  a reader that polls for an object another process is writing treats an empty one as not written yet
  (:mod:`zephon_ray.lane_exchange` does).
- A process killed during an upload leaves no object (an unfinished multipart upload is invisible; configure a
  bucket lifecycle rule to expire such parts).
- Deleting through pyarrow leaves a zero-byte ``parent/`` marker object (pyarrow's way of keeping a directory
  that may have become empty); :func:`listing` and every format here skip such markers.

Guarantee: a remote call retries transient faults within the retry budget (:mod:`zephon_ray.storage.retries`) and
fails as one line naming the URI: ``FileNotFoundError`` for a missing file, :class:`StorageError` for anything else
(a missing bucket and refused credentials said as such). A whole-object read checks its length against the store's
listing, so a response cut short is retried, never returned. A JSON document is refused above
:data:`MAX_DOCUMENT_BYTES`.

Limits: the retry covers one call of this module, not an open file handed out (:func:`open_input_file`); a
group of writes is not atomic on an object store (commit with the last one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from zephon_ray.storage.errors import DocumentError, StorageError, describe_error, is_permanent_text, is_transient
from zephon_ray.storage.filesystems import resolve
from zephon_ray.storage.locations import Location
from zephon_ray.storage.retries import retry

T = TypeVar("T")

MAX_DOCUMENT_BYTES = 256 << 20
"""A JSON document larger than this is refused (a bound on what a corrupt or foreign file can make us load)."""
_READ_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------- one remote call
def _io(loc: Location, action: str, fn: Callable[[], T]) -> T:
    """One remote operation on ``loc``: store errors mapped to one line (:func:`_errors`), transient ones retried."""

    def attempt() -> T:
        with _errors(loc, action):
            return fn()

    return retry(attempt, loc.uri)


@contextlib.contextmanager
def _errors(loc: Location, action: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, DocumentError):
        raise
    except FileNotFoundError as exc:
        if loc.remote and action in ("write it", "upload it"):  # GCS: a write into a bucket that does not exist
            _check_bucket(loc)
            raise StorageError(f"{loc.uri}: cannot {action}: {describe_error(exc)}") from None
        raise
    except PermissionError as exc:
        raise StorageError(f"{loc.uri}: permission denied ({action}): {exc.strerror or exc}") from None
    except OSError as exc:
        text = describe_error(exc)
        if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text or "ContainerNotFound" in text:
            bucket = loc.path.split("/", 1)[0]
            raise StorageError(f"{loc.uri}: bucket {bucket!r} does not exist ({action})") from None
        if is_permanent_text(text):
            raise StorageError(
                f"{loc.uri}: access denied ({action}); check the credentials "
                f"({_CREDENTIALS_HINT.get(loc.scheme, 'the store')}): {text}"
            ) from None
        raise StorageError(f"{loc.uri}: cannot {action}: {text}", transient=is_transient(exc)) from None


_CREDENTIALS_HINT = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_PROFILE, or the node's instance role",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, or the node's service account",
    "az": "AZURE_STORAGE_ACCOUNT_KEY, or Azure's default credentials",
}


def _check_bucket(loc: Location) -> None:
    """After a not-found on an object store: say so once if the bucket itself is missing (a configuration error,
    not an absent file)."""
    import pyarrow.fs as pafs

    bucket = loc.path.split("/", 1)[0]
    if loc.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
        raise StorageError(f"{loc.uri}: bucket {bucket!r} does not exist")


# ---------------------------------------------------------------------------------------------- queries
def exists(value: str | os.PathLike[str] | Location) -> bool:
    """True when a file or a non-empty directory (object prefix) is there. A missing bucket is an error."""
    loc = resolve(value)
    if not loc.remote:
        return os.path.exists(loc.path)
    import pyarrow.fs as pafs

    def look() -> Any:
        info = loc.fs.get_file_info(loc.path)
        if info.type == pafs.FileType.NotFound:
            _check_bucket(loc)
        return info

    return _io(loc, "look it up", look).type != pafs.FileType.NotFound


_SOURCE_MISSING = re.compile(r"Source missing: (\S+)")


def misreported_missing(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is Zephon's ``Source missing: <url>`` for an object that is
    there. Zephon's object-store lookup takes any store error whose text holds "404" for a missing object
    (``zephon/_internal/io/storage/obstore.py``, ``exists``), and obstore's text for an outage holds the time it
    spent (``in 27.276118ms``) and the endpoint's port, whose digits can spell it: an outage then reads as a missing
    source, a permanent fault. The object is looked up again here, an outage waited out within the storage budget;
    False when it is missing, or the lookup gives up."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain of causes, bounded
        if seen is None:
            return False
        found = _SOURCE_MISSING.search(str(seen))
        if found:
            try:
                return exists(found.group(1))
            except (StorageError, OSError, ValueError):
                return False
        seen = seen.__cause__ or seen.__context__
    return False


def is_file(value: str | os.PathLike[str] | Location) -> bool:
    loc = resolve(value)
    if not loc.remote:
        return os.path.isfile(loc.path)
    import pyarrow.fs as pafs

    return _io(loc, "look it up", lambda: loc.fs.get_file_info(loc.path)).type == pafs.FileType.File


def is_dir(value: str | os.PathLike[str] | Location) -> bool:
    """Local: a directory. Object store: a prefix with at least one object under it (or a bucket that exists)."""
    loc = resolve(value)
    if not loc.remote:
        return os.path.isdir(loc.path)
    import pyarrow.fs as pafs

    return _io(loc, "look it up", lambda: loc.fs.get_file_info(loc.path)).type == pafs.FileType.Directory


def size(value: str | os.PathLike[str] | Location) -> int | None:
    """The file's size in bytes, or None when there is no file."""
    loc = resolve(value)
    if not loc.remote:
        try:
            st = os.stat(loc.path)
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (stat): {exc.strerror}") from None
        return st.st_size if os.path.isfile(loc.path) else None
    import pyarrow.fs as pafs

    info = _io(loc, "stat it", lambda: loc.fs.get_file_info(loc.path))
    return info.size if info.type == pafs.FileType.File else None


def listing(value: str | os.PathLike[str] | Location, *, recursive: bool = False) -> dict[str, int]:
    """``{name relative to the directory: size}`` of the files under it (directly in it unless ``recursive``),
    sorted by name; ``{}`` for a directory that does not exist. Directory markers are left out."""
    loc = resolve(value)
    import pyarrow.fs as pafs

    infos = _io(
        loc,
        "list it",
        lambda: loc.fs.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True, recursive=recursive)),
    )
    base = loc.path.rstrip("/") + "/"
    out = {}
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.startswith(base):
            continue
        out[info.path[len(base) :]] = int(info.size)
    return dict(sorted(out.items()))


def entries(value: str | os.PathLike[str] | Location) -> list[str]:
    """Names directly under a directory (files and subdirectories; an object store's common prefixes), sorted;
    ``[]`` when it does not exist."""
    loc = resolve(value)
    import pyarrow.fs as pafs

    infos = _io(
        loc, "list it", lambda: loc.fs.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True, recursive=False))
    )
    base = loc.path.rstrip("/") + "/"
    return sorted({i.path[len(base) :].strip("/") for i in infos if i.path.startswith(base)} - {""})


# ---------------------------------------------------------------------------------------------- reads
def read_bytes(value: str | os.PathLike[str] | Location, *, limit: int | None = None) -> bytes:
    """The whole file. ``FileNotFoundError`` (naming it) when absent; :class:`StorageError` for anything else;
    ``limit`` bounds the size read (a larger file is refused before it is read)."""
    loc = resolve(value)
    if not loc.remote:
        try:
            with open(loc.path, "rb") as fh:
                if limit is not None and os.fstat(fh.fileno()).st_size > limit:
                    raise StorageError(f"{loc.uri}: larger than the {limit} bytes allowed here")
                return fh.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{loc.uri}: not found") from None
        except IsADirectoryError:
            raise StorageError(f"{loc.uri}: is a directory, not a file") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (read): {exc.strerror}") from None
        except OSError as exc:
            raise StorageError(f"{loc.uri}: cannot read: {exc.strerror or exc}") from None
    import pyarrow.fs as pafs

    def read() -> bytes:
        info = loc.fs.get_file_info(loc.path)
        if info.type != pafs.FileType.File:
            if "/" not in loc.path:
                raise StorageError(f"{loc.uri}: a bucket, not an object")
            if info.type == pafs.FileType.NotFound:
                _check_bucket(loc)
            raise FileNotFoundError(f"{loc.uri}: not found")
        if limit is not None and info.size is not None and info.size > limit:
            raise StorageError(f"{loc.uri}: larger than the {limit} bytes allowed here")
        with loc.fs.open_input_stream(loc.path) as fh:
            data = fh.read()
        if info.size is not None and len(data) != info.size:
            # A response cut mid-body that the client did not notice: never hand back a prefix of the object.
            raise StorageError(f"{loc.uri}: response cut short ({len(data)} of {info.size} bytes)", transient=True)
        return data

    return _io(loc, "read it", read)


def open_input_file(value: str | os.PathLike[str] | Location) -> Any:
    """A random-access pyarrow file (for Parquet footers and row groups: ranged reads on an object store)."""
    loc = resolve(value)
    return _io(loc, "open it", lambda: loc.fs.open_input_file(loc.path))


def read_json(
    value: str | os.PathLike[str] | Location,
    *,
    expect_format: str | None = None,
    format_key: str = "format",
    error: type[Exception] = DocumentError,
    what: str = "file",
    missing_hint: str = "",
) -> Any:
    """A versioned JSON document, or ONE ``error`` naming the file: missing, unreadable, not JSON, or (with
    ``expect_format``) not a table whose ``format_key`` is ``expect_format``."""
    loc = resolve(value)
    try:
        blob = read_bytes(loc, limit=MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raise error(f"{loc.uri}: {what} missing{missing_hint}") from None
    except StorageError as exc:
        raise error(f"{what} unreadable: {exc}") from None
    try:
        doc = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{loc.uri}: corrupt {what} (not valid JSON: {exc})") from None
    if expect_format is not None:
        found = doc.get(format_key) if isinstance(doc, dict) else type(doc).__name__
        if found != expect_format:
            raise error(f"{loc.uri}: {what} format {found!r} is not {expect_format!r}")
    return doc


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a local file's bytes (the fast path for many shards: no location parsing)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256(value: str | os.PathLike[str] | Location) -> str:
    """sha256 of the file's bytes (streamed; an object is downloaded once)."""
    loc = resolve(value)
    if not loc.remote:
        try:
            return sha256_file(loc.path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{loc.uri}: not found") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (read): {exc.strerror}") from None

    def digest() -> str:
        h = hashlib.sha256()
        with loc.fs.open_input_stream(loc.path) as fh:
            while chunk := fh.read(_READ_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    return _io(loc, "read it", digest)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- writes
def json_bytes(obj: Any, *, compact: bool = False) -> bytes:
    """The one JSON encoding of durable documents: sorted keys; indented unless ``compact``; a final newline."""
    if compact:
        return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(value: str | os.PathLike[str] | Location) -> None:
    """Create a local directory (and parents). Object stores have no directories: nothing is written."""
    loc = resolve(value)
    if not loc.remote:
        try:
            os.makedirs(loc.path, exist_ok=True)
        except FileExistsError:
            raise StorageError(f"{loc.uri}: exists and is not a directory") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (create directory): {exc.strerror}") from None


def write_atomic(value: str | os.PathLike[str] | Location, data: bytes) -> None:
    """Replace the file with ``data`` so that a reader sees the old content or the new, never a mix (see the
    module docstring for what that means on an object store)."""
    loc = resolve(value)
    if not loc.remote:
        make_dirs(loc.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=loc.parent.path)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, loc.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(loc.parent.path)
        return

    def write() -> None:
        with loc.fs.open_output_stream(loc.path) as fh:  # one object: visible whole when the upload completes
            fh.write(data)

    _io(loc, "write it", write)  # a PUT of the whole object: safe to repeat


def write_json(value: str | os.PathLike[str] | Location, obj: Any, *, compact: bool = False) -> None:
    write_atomic(value, json_bytes(obj, compact=compact))


def upload(local_file: str | os.PathLike[str], value: str | os.PathLike[str] | Location) -> None:
    """Commit a finished local file (a spool) at ``value``: a rename on a local filesystem (same directory tree
    expected; else a copy then rename), one upload to an object store. The local file is consumed."""
    loc = resolve(value)
    if not loc.remote:
        make_dirs(loc.parent)
        with open(local_file, "rb+") as fh:
            os.fsync(fh.fileno())
        try:
            os.replace(local_file, loc.path)
        except OSError:  # another filesystem: copy next to the target, then rename
            fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=loc.parent.path)
            os.close(fd)
            import shutil

            shutil.copyfile(local_file, tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, loc.path)
            os.unlink(local_file)
        fsync_dir(loc.parent.path)
        return

    def put() -> None:
        with open(local_file, "rb") as src, loc.fs.open_output_stream(loc.path) as dst:
            while chunk := src.read(8 * _READ_CHUNK):
                dst.write(chunk)

    _io(loc, "upload it", put)  # the spool is read again from its start on each try
    os.unlink(local_file)


def spool_path(value: str | os.PathLike[str] | Location) -> str:
    """A new, empty local temp file for ``value``'s content, to be committed with :func:`upload` (or removed).
    Local targets spool in their own directory (so the commit is a rename, and a crash leaves a ``.tmp-*`` file
    next to it), remote ones in the system temp directory."""
    loc = resolve(value)
    if loc.remote:
        directory = None
    else:
        make_dirs(loc.parent)
        directory = loc.parent.path
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=directory)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def spool(value: str | os.PathLike[str] | Location) -> Iterator[str]:
    """A local temp file (:func:`spool_path`) to write ``value``'s content into; committed with :func:`upload` when
    the block ends without an exception, removed otherwise."""
    loc = resolve(value)
    tmp = spool_path(loc)
    try:
        yield tmp
        upload(tmp, loc)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def delete(value: str | os.PathLike[str] | Location) -> None:
    """Remove one file; absent is fine."""
    loc = resolve(value)
    if not loc.remote:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(loc.path)
        return
    import pyarrow.fs as pafs

    def remove() -> None:
        if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
            loc.fs.delete_file(loc.path)

    _io(loc, "delete it", remove)


def delete_tree(value: str | os.PathLike[str] | Location) -> None:
    """Remove a directory (object prefix) and everything under it; absent is fine. Not atomic on object stores."""
    loc = resolve(value)
    if not loc.remote:
        import shutil

        shutil.rmtree(loc.path, ignore_errors=True)
        return
    import pyarrow.fs as pafs

    def remove() -> None:
        for _ in range(3):
            if loc.fs.get_file_info(loc.path).type != pafs.FileType.Directory:
                return
            try:
                loc.fs.delete_dir(loc.path)
                return
            except FileNotFoundError:
                # On an object store a directory is a prefix: if another process removes its last objects between
                # the check and the delete (a job's actors cleaning up their own files as they stop), the delete
                # finds nothing and says so. Absent is fine; look again.
                continue
        raise OSError(f"{loc.uri}: objects keep appearing under it while it is deleted")

    _io(loc, "delete it", remove)
