"""Where a file is: one :class:`Location` for a local path or an object-store URI, spelled one way.

    "/data/run7"  "relative/dir"  "s3://bucket/run7"  "gs://bucket/run7"  "az://container/run7"
          └───────────────┬──────────────────┘
                          ▼
    location(x) ──► Location(uri as users name it, path as pyarrow.fs names it, scheme, fs)

Usage: ``root = location("s3://bucket/run7")``, then ``root / "state.json"``, ``root.join("a", "b")``,
``loc.parent``, ``loc.relative_to(root)``, ``loc.is_within(root)``; :func:`is_uri` tells an object-store URI from a
local path. Every operation of :mod:`zephon_ray.storage` takes a Location, a path or a URI.

Guarantee: one spelling per file: ``gcs://`` is ``gs://``, ``abfs(s)://`` is ``az://``, ``file://`` is a local
path; empty and ``.`` segments of a URI are dropped; a local path is made absolute (relative to ``base`` or the
working directory, ``~`` expanded) and resolved (symlinks, ``..``). A Location compares and hashes by its ``uri``.

Limits: naming only, no I/O: whether the file exists is not checked, and ``fs`` is attached by
:mod:`zephon_ray.storage.filesystems` when an operation needs it. ``..`` in a URI, a URI without a bucket, other
schemes and empty values are refused with one :class:`StorageError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zephon_ray.storage.errors import StorageError

REMOTE_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
"""URI schemes mapped to an object-store filesystem (``gcs://`` is ``gs://``; ``abfs(s)://`` is ``az://``)."""


def is_uri(value: Any) -> bool:
    """True for ``scheme://...`` strings of an object store this package maps (see :data:`REMOTE_SCHEMES`)."""
    if isinstance(value, Location):
        return value.remote
    text = str(value)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


@dataclass(frozen=True)
class Location:
    """One file or directory: ``uri`` as users name it, ``path`` as ``fs`` names it. Compare and hash by ``uri``."""

    uri: str
    path: str
    scheme: str = "file"
    fs: Any = field(default=None, compare=False, repr=False, hash=False)

    @property
    def remote(self) -> bool:
        return self.scheme != "file"

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> Location:
        extra = "/".join(str(p).strip("/") for p in parts if str(p).strip("/"))
        if not extra:
            return self
        if self.remote:
            return Location(f"{self.uri.rstrip('/')}/{extra}", f"{self.path.rstrip('/')}/{extra}", self.scheme, self.fs)
        joined = os.path.join(self.path, *extra.split("/"))
        return Location(joined, joined, self.scheme, self.fs)

    def __truediv__(self, part: str) -> Location:
        return self.join(part)

    @property
    def parent(self) -> Location:
        if self.remote:
            if "/" not in self.path.rstrip("/"):
                return self  # a bucket is its own parent
            head_uri, head_path = self.uri.rstrip("/").rsplit("/", 1)[0], self.path.rstrip("/").rsplit("/", 1)[0]
            return Location(head_uri, head_path, self.scheme, self.fs)
        parent = os.path.dirname(self.path.rstrip("/")) or "/"
        return Location(parent, parent, self.scheme, self.fs)

    def relative_to(self, other: Location) -> str:
        base = other.path.rstrip("/") + "/"
        if not self.path.startswith(base):
            raise ValueError(f"{self.uri} is not under {other.uri}")
        return self.path[len(base) :]

    def is_within(self, other: Location) -> bool:
        """True when this location is ``other`` or lies under it (same store)."""
        if self.scheme != other.scheme:
            return False
        mine, theirs = self.path.rstrip("/"), other.path.rstrip("/")
        return mine == theirs or mine.startswith(theirs + "/")

    def local_path(self) -> Path:
        if self.remote:
            raise StorageError(f"{self.uri}: not a local path")
        return Path(self.path)

    def __str__(self) -> str:
        return self.uri

    def __fspath__(self) -> str:  # lets local locations go where os.PathLike is accepted
        if self.remote:
            raise TypeError(f"{self.uri} is an object-store URI, not a local path")
        return self.path


def location(value: str | os.PathLike[str] | Location, *, base: str | os.PathLike[str] | None = None) -> Location:
    """Map a local path (absolute, or relative to ``base``/the working directory; ``~`` expanded) or an object-store
    URI to its :class:`Location`. Refuses other ``scheme://`` strings and empty values with one line."""
    if isinstance(value, Location):
        return value
    text = os.fspath(value) if not isinstance(value, str) else value
    if not text:
        raise StorageError("empty path or URI")
    scheme, sep, rest = text.partition("://")
    if sep:
        canonical = REMOTE_SCHEMES.get(scheme.lower())
        if canonical is None:
            if scheme.lower() == "file":
                return location(rest)
            known = ", ".join(sorted({f"{s}://" for s in REMOTE_SCHEMES.values()}))
            raise StorageError(f"{text}: unsupported URI scheme {scheme!r} (use a local path or one of {known})")
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise StorageError(f"{text}: no bucket in the URI")
        key = "/".join(p for p in key.split("/") if p and p != ".")
        if any(p == ".." for p in key.split("/")):
            raise StorageError(f"{text}: '..' is not allowed in an object-store URI")
        path = f"{bucket}/{key}" if key else bucket
        return Location(f"{canonical}://{path}", path, canonical, None)
    if base is not None and is_uri(base):
        if os.path.isabs(os.path.expanduser(text)):
            resolved = os.path.realpath(os.path.expanduser(text))
            return Location(resolved, resolved)
        return location(base).join(*[p for p in text.split("/") if p not in ("", ".")])
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = Path(base or os.getcwd()) / p
    resolved = os.path.realpath(p)
    return Location(resolved, resolved)
