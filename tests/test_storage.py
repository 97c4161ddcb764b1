"""The storage layer (zephon_ray/storage/) on a local disk: locations, atomic writes, versioned JSON reads with one
clear error, sha256, listing, the worker environment, the facade. The same functions against a real S3 API server:
tests/test_s3.py; the retry policy: tests/test_storage_faults.py."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os

import pytest

from zephon_ray import storage


def test_locations_map_paths_and_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = storage.location("a/../b")
    assert (local.uri, local.remote, local.scheme) == (str(tmp_path / "b"), False, "file")
    s3 = storage.location("s3://bucket//run7/./x/")
    assert (s3.uri, s3.path, s3.scheme, s3.remote) == ("s3://bucket/run7/x", "bucket/run7/x", "s3", True)
    assert s3.join("manifest.json").uri == "s3://bucket/run7/x/manifest.json"
    assert s3.parent.uri == "s3://bucket/run7" and s3.name == "x"
    assert storage.location("gcs://b/k").uri == "gs://b/k" and storage.location("abfs://c/k").uri == "az://c/k"
    assert storage.location("data/x", base="s3://bucket/recipes").uri == "s3://bucket/recipes/data/x"
    assert storage.location("file:///tmp/x").uri == "/tmp/x"
    assert s3.join("a").is_within(s3) and not s3.is_within(s3.join("a"))
    assert storage.location("s3://bucket/run70").is_within(storage.location("s3://bucket")) and not storage.location(
        "s3://bucket/run70"
    ).is_within(storage.location("s3://bucket/run7"))
    for bad, needle in (
        ("ftp://host/x", "unsupported URI scheme 'ftp'"),
        ("s3:///key", "no bucket"),
        ("s3://b/../x", "'..' is not allowed"),
        ("", "empty path"),
    ):
        with pytest.raises(storage.StorageError, match=needle):
            storage.location(bad)


def _writer(path: str, rounds: int) -> None:
    for i in range(rounds):
        storage.write_atomic(path, (f"{i:08d}" * 50_000).encode())


def test_local_atomic_write_leaves_old_or_new(tmp_path):
    """A reader racing a writer that replaces a 400 KB file 40 times only ever sees a whole version, and no temp
    file is left behind."""
    # The local commit point of zephon_ray/storage/operations.py (temp file, fsync, rename, fsync of the directory).
    path = tmp_path / "d" / "doc.bin"
    storage.write_atomic(path, (f"{0:08d}" * 50_000).encode())
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(path), 40))
    proc.start()
    seen = set()
    while proc.is_alive():
        blob = storage.read_bytes(path)
        assert len(blob) == 400_000 and blob == blob[:8] * 50_000
        seen.add(blob[:8])
    proc.join()
    assert proc.exitcode == 0 and storage.read_bytes(path) == (f"{39:08d}" * 50_000).encode()
    assert os.listdir(path.parent) == ["doc.bin"]


def test_read_json_names_the_file_once(tmp_path):
    path = tmp_path / "state.json"
    with pytest.raises(storage.DocumentError, match=f"^{path}: state missing$"):
        storage.read_json(path, what="state")
    path.write_text('{"format": "x/v1", "a": ')
    with pytest.raises(storage.DocumentError, match=f"^{path}: corrupt state \\(not valid JSON: "):
        storage.read_json(path, what="state")
    storage.write_json(path, {"format": "x/v2", "a": 1})
    with pytest.raises(storage.DocumentError, match=f"^{path}: state format 'x/v2' is not 'x/v1'$"):
        storage.read_json(path, expect_format="x/v1", what="state")
    storage.write_json(path, [1, 2])
    with pytest.raises(storage.DocumentError, match="state format 'list' is not 'x/v1'"):
        storage.read_json(path, expect_format="x/v1", what="state")

    class OwnError(ValueError):
        pass

    with pytest.raises(OwnError, match=f"{tmp_path / 'nope.json'}: manifest missing \\(hint\\)"):
        storage.read_json(tmp_path / "nope.json", error=OwnError, what="manifest", missing_hint=" (hint)")
    storage.write_json(path, {"format": "x/v1", "k": [1, 2]})
    assert storage.read_json(path, expect_format="x/v1") == {"format": "x/v1", "k": [1, 2]}


def test_sha256_listing_exists_delete(tmp_path):
    (tmp_path / "sub").mkdir()
    for name, blob in (("a.bin", b"a" * 10), ("sub/b.bin", b"b" * 3)):
        storage.write_atomic(tmp_path / name, blob)
    assert (
        storage.sha256(tmp_path / "a.bin")
        == hashlib.sha256(b"a" * 10).hexdigest()
        == storage.sha256_file(tmp_path / "a.bin")
    )
    assert storage.listing(tmp_path) == {"a.bin": 10}
    assert storage.listing(tmp_path, recursive=True) == {"a.bin": 10, "sub/b.bin": 3}
    assert storage.listing(tmp_path / "absent") == {}
    assert storage.exists(tmp_path / "sub") and storage.is_dir(tmp_path / "sub") and storage.is_file(tmp_path / "a.bin")
    assert storage.size(tmp_path / "a.bin") == 10 and storage.size(tmp_path / "nope") is None
    storage.delete(tmp_path / "a.bin")
    storage.delete(tmp_path / "a.bin")  # absent is fine
    storage.delete_tree(tmp_path / "sub")
    assert storage.listing(tmp_path, recursive=True) == {}
    with pytest.raises(FileNotFoundError, match="nope.bin: not found"):
        storage.read_bytes(tmp_path / "nope.bin")


def test_spool_commits_whole_or_nothing(tmp_path):
    target = tmp_path / "seg" / "x.parquet"
    with pytest.raises(RuntimeError):
        with storage.spool(target) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(b"half")
            raise RuntimeError("writer died")
    assert not target.exists() and os.listdir(target.parent) == []
    with storage.spool(target) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"whole")
    assert target.read_bytes() == b"whole" and os.listdir(target.parent) == ["x.parquet"]


def test_worker_environment_maps_the_endpoint_and_ships_no_secret_or_local_path(monkeypatch):
    # What zephon_ray/storage/environment.py promises: the CLI's runtime_env carries no secret and no local path.
    from zephon_ray.storage import environment

    for key in (*storage.WORKER_ENV_VARS, *storage.SECRET_ENV_VARS, *storage.LOCAL_ONLY_ENV_VARS):
        monkeypatch.delenv(key, raising=False)
    # export_endpoint_for_zephon writes os.environ and remembers what it wrote: both are undone after the test (an
    # S3_ENDPOINT_URL left behind would make the next S3 test's workers see two endpoints).
    monkeypatch.setenv("S3_ENDPOINT_URL", "")
    monkeypatch.setattr(environment, "_EXPORTED", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("ZEPHON_RAY_STORAGE_RETRY_S", "120")
    for secret in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.setenv(secret, "s3cr3t")
    for local in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.setenv(local, "/home/me/only-here")
    assert storage.s3_endpoint() == "http://127.0.0.1:9"
    env = storage.worker_environment()
    assert env == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "S3_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_REGION": "eu-west-3",
        "ZEPHON_RAY_STORAGE_RETRY_S": "120",
    }, env
    assert "s3cr3t" not in str(env) and "only-here" not in str(env)
    assert set(storage.local_credentials()) == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AWS_PROFILE",
        "AWS_CONFIG_FILE",
        "AWS_CA_BUNDLE",
        "GOOGLE_APPLICATION_CREDENTIALS",
    }
    storage.export_endpoint_for_zephon()
    assert os.environ["S3_ENDPOINT_URL"] == "http://127.0.0.1:9"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")  # the service-specific one wins
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:10")
    assert storage.s3_endpoint() == "http://127.0.0.1:10"
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://elsewhere:1")
    with pytest.raises(storage.StorageError, match="the S3 endpoint is ambiguous"):
        storage.s3_endpoint()
    monkeypatch.delenv("S3_ENDPOINT_URL")
    monkeypatch.setenv(storage.MAX_ATTEMPTS_ENV, "many")
    with pytest.raises(storage.StorageError, match="ZEPHON_RAY_S3_MAX_ATTEMPTS='many': not a number"):
        storage.filesystem(storage.location("s3://b/k"))


def test_json_bytes_is_one_encoding():
    assert storage.json_bytes({"b": 1, "a": [1]}, compact=True) == b'{"a":[1],"b":1}\n'
    assert json.loads(storage.json_bytes({"b": 1})) == {"b": 1}


def test_the_facade_reexports_what_the_modules_define():
    """``storage.X`` is the object its module defines, not a copy: process-wide state (the retry statistics, the
    filesystem cache) exists once, whichever way it is imported."""
    from zephon_ray.storage import filesystems, retries

    for name in storage.__all__:
        obj = getattr(storage, name)
        if callable(obj) and hasattr(obj, "__module__"):
            assert obj.__module__.startswith("zephon_ray.storage.") and obj.__module__ != "zephon_ray.storage.__init__"
    assert storage.RETRY_STATS is retries.RETRY_STATS
    storage.filesystem(storage.location("/"))
    assert filesystems._FS_CACHE
    storage.clear_filesystem_cache()
    assert not filesystems._FS_CACHE
