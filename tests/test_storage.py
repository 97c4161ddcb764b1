"""The storage layer (zephon_ray/files.py) on a local disk: locations, atomic writes, versioned JSON reads with one
clear error, sha256, listing. The same functions against a real S3 API server: tests/test_s3.py."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os

import pytest

from zephon_ray import files


def test_locations_map_paths_and_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = files.location("a/../b")
    assert (local.uri, local.remote, local.scheme) == (str(tmp_path / "b"), False, "file")
    s3 = files.location("s3://bucket//run7/./x/")
    assert (s3.uri, s3.path, s3.scheme, s3.remote) == ("s3://bucket/run7/x", "bucket/run7/x", "s3", True)
    assert s3.join("manifest.json").uri == "s3://bucket/run7/x/manifest.json"
    assert s3.parent.uri == "s3://bucket/run7" and s3.name == "x"
    assert files.location("gcs://b/k").uri == "gs://b/k" and files.location("abfs://c/k").uri == "az://c/k"
    assert files.location("data/x", base="s3://bucket/recipes").uri == "s3://bucket/recipes/data/x"
    assert files.location("file:///tmp/x").uri == "/tmp/x"
    assert s3.join("a").is_within(s3) and not s3.is_within(s3.join("a"))
    assert files.location("s3://bucket/run70").is_within(files.location("s3://bucket")) and not files.location(
        "s3://bucket/run70").is_within(files.location("s3://bucket/run7"))
    for bad, needle in (("ftp://host/x", "unsupported URI scheme 'ftp'"), ("s3:///key", "no bucket"),
                        ("s3://b/../x", "'..' is not allowed"), ("", "empty path")):
        with pytest.raises(files.StorageError, match=needle):
            files.location(bad)


def _writer(path: str, rounds: int) -> None:
    for i in range(rounds):
        files.write_atomic(path, (f"{i:08d}" * 50_000).encode())


def test_local_atomic_write_leaves_old_or_new(tmp_path):
    """A reader racing a writer that replaces a 400 KB file 40 times only ever sees a whole version, and no temp
    file is left behind."""
    path = tmp_path / "d" / "doc.bin"
    files.write_atomic(path, (f"{0:08d}" * 50_000).encode())
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(path), 40))
    proc.start()
    seen = set()
    while proc.is_alive():
        blob = files.read_bytes(path)
        assert len(blob) == 400_000 and blob == blob[:8] * 50_000
        seen.add(blob[:8])
    proc.join()
    assert proc.exitcode == 0 and files.read_bytes(path) == (f"{39:08d}" * 50_000).encode()
    assert os.listdir(path.parent) == ["doc.bin"]


def test_read_json_names_the_file_once(tmp_path):
    path = tmp_path / "state.json"
    with pytest.raises(files.DocumentError, match=f"^{path}: state missing$"):
        files.read_json(path, what="state")
    path.write_text('{"format": "x/v1", "a": ')
    with pytest.raises(files.DocumentError, match=f"^{path}: corrupt state \\(not valid JSON: "):
        files.read_json(path, what="state")
    files.write_json(path, {"format": "x/v2", "a": 1})
    with pytest.raises(files.DocumentError, match=f"^{path}: state format 'x/v2' is not 'x/v1'$"):
        files.read_json(path, expect_format="x/v1", what="state")
    files.write_json(path, [1, 2])
    with pytest.raises(files.DocumentError, match="state format 'list' is not 'x/v1'"):
        files.read_json(path, expect_format="x/v1", what="state")

    class OwnError(ValueError):
        pass

    with pytest.raises(OwnError, match=f"{tmp_path / 'nope.json'}: manifest missing \\(hint\\)"):
        files.read_json(tmp_path / "nope.json", error=OwnError, what="manifest", missing_hint=" (hint)")
    files.write_json(path, {"format": "x/v1", "k": [1, 2]})
    assert files.read_json(path, expect_format="x/v1") == {"format": "x/v1", "k": [1, 2]}


def test_sha256_listing_exists_delete(tmp_path):
    (tmp_path / "sub").mkdir()
    for name, blob in (("a.bin", b"a" * 10), ("sub/b.bin", b"b" * 3)):
        files.write_atomic(tmp_path / name, blob)
    assert files.sha256(tmp_path / "a.bin") == hashlib.sha256(b"a" * 10).hexdigest() == files.sha256_file(
        tmp_path / "a.bin")
    assert files.listing(tmp_path) == {"a.bin": 10}
    assert files.listing(tmp_path, recursive=True) == {"a.bin": 10, "sub/b.bin": 3}
    assert files.listing(tmp_path / "absent") == {}
    assert files.exists(tmp_path / "sub") and files.is_dir(tmp_path / "sub") and files.is_file(tmp_path / "a.bin")
    assert files.size(tmp_path / "a.bin") == 10 and files.size(tmp_path / "nope") is None
    files.delete(tmp_path / "a.bin")
    files.delete(tmp_path / "a.bin")  # absent is fine
    files.delete_tree(tmp_path / "sub")
    assert files.listing(tmp_path, recursive=True) == {}
    with pytest.raises(FileNotFoundError, match="nope.bin: not found"):
        files.read_bytes(tmp_path / "nope.bin")


def test_spool_commits_whole_or_nothing(tmp_path):
    target = tmp_path / "seg" / "x.parquet"
    with pytest.raises(RuntimeError):
        with files.spool(target) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(b"half")
            raise RuntimeError("writer died")
    assert not target.exists() and os.listdir(target.parent) == []
    with files.spool(target) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"whole")
    assert target.read_bytes() == b"whole" and os.listdir(target.parent) == ["x.parquet"]


def test_worker_environment_maps_the_endpoint_and_ships_no_secret_or_local_path(monkeypatch):
    for key in (*files.WORKER_ENV_VARS, *files.SECRET_ENV_VARS, *files.LOCAL_ONLY_ENV_VARS):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("ZEPHON_RAY_STORAGE_RETRY_S", "120")
    for secret in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.setenv(secret, "s3cr3t")
    for local in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.setenv(local, "/home/me/only-here")
    assert files.s3_endpoint() == "http://127.0.0.1:9"
    env = files.worker_environment()
    assert env == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "S3_ENDPOINT_URL": "http://127.0.0.1:9",
                   "AWS_REGION": "eu-west-3", "ZEPHON_RAY_STORAGE_RETRY_S": "120"}, env
    assert "s3cr3t" not in str(env) and "only-here" not in str(env)
    assert files.aws_environment() == env  # the old name: the same safe subset
    assert set(files.local_credentials()) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                              "AZURE_STORAGE_ACCOUNT_KEY", "AWS_PROFILE", "AWS_CONFIG_FILE",
                                              "AWS_CA_BUNDLE", "GOOGLE_APPLICATION_CREDENTIALS"}
    files.export_endpoint_for_zephon()
    assert os.environ["S3_ENDPOINT_URL"] == "http://127.0.0.1:9"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:10")  # the service-specific one wins
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:10")
    assert files.s3_endpoint() == "http://127.0.0.1:10"
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://elsewhere:1")
    with pytest.raises(files.StorageError, match="the S3 endpoint is ambiguous"):
        files.s3_endpoint()
    monkeypatch.delenv("S3_ENDPOINT_URL")
    monkeypatch.setenv(files.MAX_ATTEMPTS_ENV, "many")
    with pytest.raises(files.StorageError, match="ZEPHON_RAY_S3_MAX_ATTEMPTS='many': not a number"):
        files.filesystem(files.location("s3://b/k"))


def test_json_bytes_is_one_encoding():
    assert files.json_bytes({"b": 1, "a": [1]}, compact=True) == b'{"a":[1],"b":1}\n'
    assert json.loads(files.json_bytes({"b": 1})) == {"b": 1}
