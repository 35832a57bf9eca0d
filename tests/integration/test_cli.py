"""The ``grpc-idempotency`` command itself: help and version, database errors, export-protos,
interruptions.

Help is checked on the parser (every option of every command, walked); database errors and
exports run the command as a subprocess (``python -m grpc_idempotency.cli``), as a user would,
against the session's real PostgreSQL; the exported options.proto is compiled by protoc and,
when buf is installed, by ``buf build`` and ``buf lint`` with the README's buf.yaml recipe.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from grpc_idempotency import Store, StoreUnavailable, proto_include
from grpc_idempotency.cli import _parser
from grpc_idempotency.cli_errors import dsn_target, report_store_error, safe_dsn
from tests.e2e.procs import free_port
from tests.support.schemas import backend_gone, delete_waiting_on_a_lock, fresh_store
from tests.support.tools import DB_COMMANDS as COMMANDS
from tests.support.tools import buf_binary, run_cli
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL_PROTO = ROOT / "examples" / "tutorial" / "payments.proto"
OPTIONS = Path("grpc_idempotency") / "v1" / "options.proto"
# The README's buf recipe: the user's protos in proto/, the exported options in third_party/.
BUF_YAML = """\
version: v2
modules:
  - path: proto
  - path: third_party   # grpc-idempotency export-protos third_party
lint:
  use:
    - STANDARD
  ignore:
    - third_party
"""


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    return run_cli(*args, cwd=cwd, env=env)


# -- help and version ---------------------------------------------------------------------------


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The parser and every subcommand's parser, depth first, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


ALL = list(parsers(_parser()))


def test_the_walk_reaches_every_command() -> None:
    names = {" ".join(path) for path, _ in ALL}
    assert {
        "", "migrate", "purge", "include-path", "export-protos", "check-steps", "relay",
        "outbox", "outbox dead", "outbox retry", "outbox purge-dead", "outbox purge-sent",
        "outbox stats",
    } <= names  # fmt: skip


@pytest.mark.parametrize("path, parser", ALL, ids=[" ".join(p) or "top" for p, _ in ALL])
def test_every_option_and_command_has_plain_help(
    path: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    where = "grpc-idempotency " + " ".join(path)
    assert parser.description and "``" not in parser.description, where
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{where}: {name} has no help"
        assert "``" not in action.help, f"{where}: {name}: reStructuredText in help"
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # the one-line summaries of the commands
                assert choice.help and "``" not in choice.help, f"{where}: {choice.dest}"
            continue
        takes_value = action.nargs != 0
        if takes_value:
            assert action.metavar, f"{where}: {name} has no explicit metavar"
        if action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in action.help, f"{where}: {name} does not show its default"
    # Rendering substitutes %(default)s and friends; a typo there raises here.
    text = parser.format_help()
    assert "``" not in text and "%(" not in text, where


def test_defaults_are_shown_with_their_values() -> None:
    purge = dict(ALL)[("purge",)].format_help()
    assert "records deleted per transaction (default: 1000)" in " ".join(purge.split())
    relay = " ".join(dict(ALL)[("relay",)].format_help().split())
    assert "--lease SECONDS" in relay and "(default: 30.0)" in relay


def test_version_prints_the_installed_version() -> None:
    done = cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"grpc-idempotency {metadata.version('grpc-idempotency')}"


def test_python_dash_m_runs_the_command() -> None:
    """``python -m grpc_idempotency`` is the command, for a virtualenv whose scripts are not on
    PATH (it was "No module named grpc_idempotency.__main__")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    done = subprocess.run(
        [sys.executable, "-m", "grpc_idempotency", "include-path"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip(), "grpc_idempotency", "v1", "options.proto").is_file()


# -- database errors: the real message, the target, never the password --------------------------


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


def with_user(dsn: str, user: str, password: str) -> str:
    parts = urlsplit(dsn)
    hosts = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{hosts}"))


def test_a_missing_database_is_named_with_the_user_and_exit_2(pg_dsn: str) -> None:
    database = f"no_such_db_{secrets.token_hex(4)}"
    dsn = with_database(pg_dsn, database)
    password = urlsplit(pg_dsn).password
    done = cli("migrate", "--dsn", dsn)
    assert done.returncode == 2, done.stderr
    user = urlsplit(pg_dsn).username or "postgres"
    assert f'database "{database}" does not exist' in done.stderr  # PostgreSQL's own words
    assert f'database "{database}", user "{user}"' in done.stderr  # the target
    assert "Traceback" not in done.stderr and done.stdout == ""
    # Named once, by the database line (with the schema), not again at the end of the first
    # line (Store.connect's "[host:port/database, schema S]").
    first = done.stderr.splitlines()[0]
    assert first.endswith("no such database: check the DSN"), first
    (target,) = [line for line in done.stderr.splitlines() if line.startswith("  database: ")]
    assert f'database "{database}", user "{user}", schema grpc_idempotency (' in target
    if password:
        assert password not in done.stderr


async def refused_by_a_missing_database(pg_dsn: str) -> tuple[str, StoreUnavailable]:
    """``Store.connect``'s own error for a database that does not exist, and its DSN."""
    dsn = with_database(pg_dsn, f"no_such_db_{secrets.token_hex(4)}")
    with pytest.raises(StoreUnavailable) as refused:
        await Store.connect(dsn, schema="labelled")
    err = refused.value
    assert err.store_label.startswith(" [") and "schema labelled]" in err.store_label, err
    assert str(err).endswith(err.store_label), str(err)
    return dsn, err


async def test_a_store_error_reported_without_a_dsn_keeps_the_stores_name(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a DSN there is no database line: the name ``Store.connect`` appended to the
    message is then the report's only word of which database it was, and stays on its first
    line (a shard of several, opened in the application's code)."""
    _, err = await refused_by_a_missing_database(pg_dsn)
    report_store_error(err, None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"grpc-idempotency: {err}", lines
    assert lines[0].endswith(err.store_label), lines
    assert not [line for line in lines if line.startswith("  database: ")], lines


async def test_a_store_error_reported_with_its_dsn_names_the_database_once(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the DSN the database line names the database (with the schema): the first line
    drops the store's name, which said it again, less fully."""
    dsn, err = await refused_by_a_missing_database(pg_dsn)
    report_store_error(err, dsn, schema="labelled")
    lines = capsys.readouterr().err.splitlines()
    message = str(err).removesuffix(err.store_label)
    assert message != str(err)
    assert lines[0] == f"grpc-idempotency: {message}", lines
    assert err.store_label not in "\n".join(lines), lines
    (target,) = [line for line in lines if line.startswith("  database: ")]
    assert target.startswith(f"  database: {dsn_target(dsn)}, schema labelled ("), target


@pytest.mark.parametrize(
    "database, shown",
    [
        ("x%1b%5b31mRED%0aFAKE-LINE", 'database "x\\x1b[31mRED\\nFAKE-LINE"'),
        # urlsplit drops a raw newline (WHATWG); the ESC stays, in the masked DSN too.
        ("x\x1b[31mRED\x07", 'database "x\\x1b[31mRED\\x07"'),
    ],
    ids=["encoded", "raw"],
)
def test_control_characters_of_the_dsn_cannot_add_lines_to_the_error(
    pg_dsn: str, database: str, shown: str
) -> None:
    """The target's database name was percent-decoded and printed raw: an ESC colouring the
    terminal, a newline making a line of the message up (given raw, in the masked DSN too)."""
    done = cli("migrate", "--dsn", with_database(pg_dsn, database))
    assert done.returncode == 2, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith("FAKE-LINE")]
    (target,) = [line for line in done.stderr.splitlines() if line.startswith("  database: ")]
    assert shown in target  # escaped, as printable() shows them


def test_a_missing_role_is_named_without_its_password_and_exit_2(pg_dsn: str) -> None:
    user = f"nobody_{secrets.token_hex(4)}"
    password = f"pw-{secrets.token_hex(8)}"
    done = cli("outbox", "stats", "--dsn", with_user(pg_dsn, user, password))
    assert done.returncode == 2, done.stderr
    # Trust authentication says the role is missing; password authentication says the password
    # failed for it: either way PostgreSQL names the role.
    assert f'"{user}"' in done.stderr.splitlines()[1], done.stderr
    assert f'user "{user}"' in done.stderr
    assert password not in done.stderr
    assert ":***@" in done.stderr  # the DSN is shown, masked


@pytest.mark.parametrize(
    "parameter, refusal",
    [
        ("no_such_setting=1", 'unrecognized configuration parameter "no_such_setting"'),
        ("statement_timeout=soon", 'invalid value for parameter "statement_timeout"'),
    ],
    ids=["unknown", "bad-value"],
)
def test_a_setting_the_server_refuses_at_connection_is_not_retryable_exit_2(
    pg_dsn: str, parameter: str, refusal: str
) -> None:
    """A query parameter of the DSN that the server refuses as the session starts (a setting it
    does not know, a value it does not accept) fails every connection the same way: the DSN
    must change. It exited 1, "unavailable" (retry later), and a deploy step retried it."""
    separator = "&" if "?" in pg_dsn else "?"
    done = cli("migrate", "--dsn", f"{pg_dsn}{separator}{parameter}")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert "misconfigured while connecting" in lines[0], done.stderr
    assert refusal in done.stderr  # PostgreSQL's own words, in the causes
    assert "Traceback" not in done.stderr and done.stdout == ""


async def test_a_database_closed_to_connections_is_unavailable_with_its_own_hint(
    pg_dsn: str,
) -> None:
    """``ALTER DATABASE ... ALLOW_CONNECTIONS false`` (a maintenance window) refuses every
    session with SQLSTATE 55000 until an operator opens it again: retry later (exit 1), like
    a database starting up. It was "misconfigured" (exit 2) with the hint for a refused DSN
    setting, which sent the operator to the wrong place."""
    database = f"closed_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f"CREATE DATABASE {database} ALLOW_CONNECTIONS false")
        done = await asyncio.to_thread(cli, "migrate", "--dsn", with_database(pg_dsn, database))
        assert done.returncode == 1, done.stderr
        lines = done.stderr.splitlines()
        assert "unavailable while connecting" in lines[0], done.stderr
        assert "not accepting connections" in lines[0], done.stderr
        assert "setting of the session" not in done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database}")
        await admin.close()


def test_an_unreachable_server_names_host_and_port_and_exits_1() -> None:
    port = free_port()
    password = f"pw-{secrets.token_hex(8)}"
    dsn = f"postgresql://payments:{password}@127.0.0.1:{port}/shop"
    done = cli("purge", "--dsn", dsn)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert "unavailable while connecting" in lines[0]
    assert any("ConnectionRefusedError" in line for line in lines[1:]), done.stderr
    assert f'127.0.0.1:{port}, database "shop", user "payments"' in done.stderr
    assert password not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("ids", [[], ["--all", "1"]])
def test_outbox_retry_without_ids_or_all_is_bad_usage_even_while_the_database_is_down(
    ids: list[str],
) -> None:
    """Exit 2, fix the command: it was checked after connecting, so with the database down it
    exited 1, "retry later", which could never help."""
    dsn = f"postgresql://ops@127.0.0.1:{free_port()}/shop"
    done = cli("outbox", "retry", "--dsn", dsn, *ids)
    assert done.returncode == 2, done.stderr
    assert "IDs or --all" in done.stderr and "unavailable" not in done.stderr


def test_an_unmigrated_schema_says_what_to_run(pg_dsn: str) -> None:
    schema = f"never_migrated_{secrets.token_hex(4)}"
    done = cli("purge", "--dsn", pg_dsn, "--schema", schema)
    assert done.returncode == 2, done.stderr
    assert "grpc-idempotency migrate" in done.stderr and schema in done.stderr
    assert "database: " in done.stderr


@pytest.mark.parametrize(
    "dsn, safe",
    [
        ("postgresql://u:hunter22@db:5433/app", "postgresql://u:***@db:5433/app"),
        ("postgresql://u@db/app?password=hunter22&sslmode=require",
         "postgresql://u@db/app?password=***&sslmode=require"),
        ("postgres://u:p%40ss@/app?host=/run/pg", "postgres://u:***@/app?host=/run/pg"),
        # No authority at all (a unix socket): shown as given, not as "postgresql:/app".
        ("postgresql:///app?host=/run/pg&password=hunter22",
         "postgresql:///app?host=/run/pg&password=***"),
        ("host=db user=u password='hun ter' dbname=app", "host=db user=u password=*** dbname=app"),
        ("postgresql://u@db/app", "postgresql://u@db/app"),
        # Unencoded / ? # @ in the password: URL parsing cuts it into host, path, query or
        # fragment, so everything up to the last "@" is masked.
        ("postgresql://app:s3cr/et@db:5432/prod", "postgresql://***@db:5432/prod"),
        ("postgresql://app:s3cr?et@db:5432/prod", "postgresql://***@db:5432/prod"),
        ("postgresql://app:p?ss=w0rd@db/prod", "postgresql://***@db/prod"),
        ("postgresql://app:s3cr#et@db/prod", "postgresql://***@db/prod"),
        ("postgresql://app:p@ss/w@db/prod?sslmode=require",
         "postgresql://***@db/prod?sslmode=require"),
        ("postgresql://u@db/app?password=hun#ter", "postgresql://***@db/app?password=***"),
        # An "@" in a query password: the user info seemed to end there, and the tail showed.
        ("postgresql://u@db/app?password=pw@SECRETTAIL", "postgresql://***@db/app?password=***"),
        ("postgresql://app@db:1/shop?password=a/b?c#d@echo&foxtrot:golf",
         "postgresql://***@db:1/shop?password=***"),
        ("postgresql://app@db/shop?password=a/b@c&sslmode=require",
         "postgresql://***@db/shop?password=***&sslmode=require"),
        ("postgresql://app:s3cret/prod", "postgresql://***"),  # "s3cret" would be the port
        ("postgresql://app:pa[ss@db/prod", "postgresql://***@db/prod"),  # urlsplit refuses it
        # An unencoded "&" in a query password: its tail is no parameter of its own.
        ("postgresql://u@db/app?password=se&cr&et&sslmode=require",
         "postgresql://u@db/app?password=***&sslmode=require"),
        ("postgresql://u@db/app?sslmode=require&PassWord=a%26b&x=1",
         "postgresql://u@db/app?sslmode=require&PassWord=***&x=1"),
    ],
)  # fmt: skip
def test_safe_dsn_masks_every_password(dsn: str, safe: str) -> None:
    assert safe_dsn(dsn) == safe


def test_dsn_target_names_nothing_from_a_dsn_in_doubt() -> None:
    # The driver reads "app" as the host and "5432/et" as port and database.
    assert "et" not in dsn_target("postgresql://app:5432/et@db/prod").replace("unambiguously", "")
    # The driver reads "ss@db" as the host, urlsplit "db".
    assert "db" not in dsn_target("postgresql://app:p@ss@db/prod")


# Each quotes a piece of its password in asyncpg's parse error, or is misread by it.
UNPARSABLE = {
    "slash": ("postgresql://app:s3cr/et@db.example:5432/prod", ["s3cr", "et@"]),
    "question mark": ("postgresql://app:s3cr?et@db.example:5432/prod", ["s3cr", "et@"]),
    "query-like": ("postgresql://app:p?ss=w0rd@db.example:5432/prod", ["w0rd", "'p'", "ss="]),
    "empty host": ("postgresql://app:hunter22@,db.example/prod", ["hunter22"]),
    "bad sslmode": ("postgresql://app:hunter22@db.example/prod?sslmode=nope", ["hunter22"]),
    # asyncpg ends the user info at the first "@": it looked up the host "ss@db.example", an
    # outage to retry (exit 1) naming that host.
    "at sign": ("postgresql://app:p@ss@db.example:5432/prod", ["ss@db", "p@ss"]),
}


@pytest.mark.parametrize("dsn, pieces", UNPARSABLE.values(), ids=UNPARSABLE.keys())
@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_dsn_the_driver_cannot_parse_is_refused_without_its_text(
    command: list[str], dsn: str, pieces: list[str]
) -> None:
    done = cli(*command, "--dsn", dsn)
    assert done.returncode == 2, done.stderr  # not retryable
    assert "cannot parse" in done.stderr and "percent-encode" in done.stderr
    assert "Traceback" not in done.stderr
    for piece in pieces:
        assert piece not in done.stderr + done.stdout


# inspect takes --dsn once per service it follows (repeatable by design).
ONE_DATABASE = {name: argv for name, argv in COMMANDS.items() if name != "inspect"}


@pytest.mark.parametrize("command", ONE_DATABASE.values(), ids=ONE_DATABASE.keys())
def test_a_second_dsn_is_refused_not_the_first_dropped(command: list[str]) -> None:
    """A command of one database given --dsn twice (one per shard: ``purge --dsn $EU --dsn
    $US`` in a cron job): argparse kept the last and dropped the first without a word, so one
    shard was never purged (or migrated), and the command said it had done its work."""
    first = f"postgresql://ops:first-pw@127.0.0.1:{free_port()}/shard_eu"
    second = f"postgresql://ops:second-pw@127.0.0.1:{free_port()}/shard_us"
    done = cli(*command, "--dsn", first, f"--dsn={second}")
    assert done.returncode == 2, done.stderr  # bad usage, not "unreachable, retry later"
    assert "--dsn" in done.stderr and "once per database" in done.stderr, done.stderr
    assert "first-pw" not in done.stderr and "second-pw" not in done.stderr
    if command[0] == "relay":  # its LISTEN connection's DSN alike
        done = cli(*command, "--dsn", first, "--listen-dsn", first, "--listen-dsn", second)
        assert done.returncode == 2 and "--listen-dsn: given more than once" in done.stderr


def test_a_listen_dsn_the_driver_cannot_parse_is_refused_while_the_database_is_down() -> None:
    """Exit 2, fix the command: it was checked once --dsn had connected, so with that database
    down it exited 1, "retry later", which could never help."""
    down = f"postgresql://ops@127.0.0.1:{free_port()}/shop"
    dsn, _ = UNPARSABLE["slash"]
    done = cli("relay", "--dsn", down, "--listen-dsn", dsn,
               "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "cannot parse --listen-dsn" in done.stderr and "unavailable" not in done.stderr


@pytest.mark.parametrize("case", ["slash", "at sign"])
def test_a_listen_dsn_the_driver_cannot_parse_is_refused_before_relaying(
    pg_dsn: str, store: object, case: str
) -> None:
    dsn, pieces = UNPARSABLE[case]
    done = cli("relay", "--dsn", pg_dsn, "--listen-dsn", dsn,
               "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "cannot parse --listen-dsn" in done.stderr and "ready" not in done.stdout
    for piece in pieces:
        assert piece not in done.stderr + done.stdout


def test_a_relay_whose_database_is_refused_says_so_once(pg_dsn: str) -> None:
    """The store logs its refusal for a server's log ("every keyed call fails until this is
    fixed"): before the relay had set its logging up, Python printed that record bare, above
    the command's own report of the same error, its database name's control characters raw."""
    database = f"no_relay_db_{secrets.token_hex(4)}\x1b[2J"
    done = cli("relay", "--dsn", with_database(pg_dsn, database),
               "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("grpc-idempotency: idempotency store misconfigured"), lines
    assert all(line.startswith("  ") for line in lines[1:]), lines  # its causes, its target
    assert "every keyed call" not in done.stderr and "\x1b" not in done.stderr


def test_a_listen_dsn_the_server_refuses_is_reported_with_its_own_target(
    pg_dsn: str, store: object
) -> None:
    """A --listen-dsn naming a database (or role, or password) the server refuses: the error
    was reported with --dsn's target, its database and user, which are right, so the line
    pointed at the one DSN that needed no fixing. Now the listen DSN's, checked before --dsn
    connects, as its parsing is."""
    database = f"no_listen_db_{secrets.token_hex(4)}"
    done = cli("relay", "--dsn", pg_dsn, "--listen-dsn", with_database(pg_dsn, database),
               "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--listen-dsn" in done.stderr.splitlines()[0], done.stderr
    (target,) = [line for line in done.stderr.splitlines() if line.startswith("  database: ")]
    assert f'database "{database}"' in target, done.stderr
    assert "ready" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "dsn, target",
    [
        ("postgresql://u:pw@db.internal:6432/app", 'db.internal:6432, database "app", user "u"'),
        ("postgresql://u@h1,h2:5433/app", 'h1:5432, h2:5433, database "app", user "u"'),
        ("postgresql://u@[::1]:5433/app", '[::1]:5433, database "app", user "u"'),
        ("postgresql://postgres@/postgres?host=/tmp/pg-x&port=5999",
         'socket /tmp/pg-x/.s.PGSQL.5999, database "postgres", user "postgres"'),
        ("postgresql://u@db", 'db:5432, database "u", user "u"'),  # libpq: dbname = user
        ("postgresql://u%07%0a@db/x%1b%5b2J%0d", 'db:5432, database "x\\x1b[2J\\r", user "u\\x07\\n"'),
    ],
)  # fmt: skip
def test_dsn_target_names_server_database_and_user(
    dsn: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE"):
        monkeypatch.delenv(name, raising=False)
    assert dsn_target(dsn) == target


# -- export-protos --------------------------------------------------------------------------------


def test_export_protos_into_a_closed_pipe_exits_141_quietly(tmp_path: Path) -> None:
    """Its own OSError handler took the BrokenPipeError for a failed export: "cannot export
    ... Broken pipe" and exit 2, where every other command exits 141 without a word."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went before anything was written: every write fails
    try:
        done = subprocess.run(
            [sys.executable, "-m", "grpc_idempotency.cli", "export-protos", str(tmp_path / "x")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")
    assert (tmp_path / "x" / OPTIONS).is_file()  # the export itself was done


def test_output_the_outputs_encoding_cannot_hold_is_escaped_not_a_traceback(
    pg_dsn: str, store: object, tmp_path: Path
) -> None:
    """stdout in an encoding without the characters printed (an ASCII or Latin-1 locale, a
    file redirected on Windows, cp1252): a scope or path outside it (or inspect's box-drawing
    branches) raised a UnicodeEncodeError traceback and exit 1, "unreachable, retry later".
    Escaped instead, as Python escapes what stderr cannot hold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    env["PYTHONIOENCODING"] = "ascii"
    listed = run_cli("list", "--scope", "tenant:\u6771\u4eac", "--dsn", pg_dsn, env=env)
    assert (listed.returncode, listed.stderr) == (3, "")  # none matched
    assert listed.stdout == "no records under tenant:\\u6771\\u4eac\n"
    exported = run_cli("export-protos", str(tmp_path / "\u6771\u4eac"), env=env)
    assert (exported.returncode, exported.stderr) == (0, "")
    assert "\\u6771\\u4eac" in exported.stdout


def test_export_protos_copies_refuses_to_clobber_and_forces(tmp_path: Path) -> None:
    shipped = (Path(proto_include()) / OPTIONS).read_bytes()
    out = tmp_path / "third_party"
    exported = out / OPTIONS

    first = cli("export-protos", str(out))
    assert first.returncode == 0, first.stderr
    assert exported.read_bytes() == shipped
    assert f"wrote {exported}" in first.stdout

    again = cli("export-protos", str(out))
    assert again.returncode == 0 and f"unchanged {exported}" in again.stdout

    exported.write_bytes(shipped + b"// edited by hand\n")
    refused = cli("export-protos", str(out))
    assert refused.returncode == 1
    assert str(exported) in refused.stderr and "--force" in refused.stderr
    assert exported.read_bytes().endswith(b"// edited by hand\n")  # untouched

    forced = cli("export-protos", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"replaced {exported}" in forced.stdout
    assert exported.read_bytes() == shipped
    assert not [p for p in exported.parent.iterdir() if p.name != "options.proto"]


def user_workspace(root: Path) -> Path:
    """A user's layout: the tutorial's payments.proto in proto/, options exported to
    third_party/."""
    proto = root / "proto" / "payments" / "v1" / "payments.proto"
    proto.parent.mkdir(parents=True)
    shutil.copyfile(TUTORIAL_PROTO, proto)
    done = cli("export-protos", "third_party", cwd=root)
    assert done.returncode == 0, done.stderr
    return proto


def assert_one_keyed_method(image: Path) -> None:
    """check-steps reads the options out of the built image: the import resolved."""
    done = cli("check-steps", "--against", str(image), str(image))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 keyed method(s)" in done.stdout, done.stdout


def test_protoc_compiles_a_proto_importing_the_exported_options(tmp_path: Path) -> None:
    user_workspace(tmp_path)
    (tmp_path / "gen").mkdir()
    done = subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", "-I", "third_party",
            "--python_out=gen", "--include_imports", "--descriptor_set_out=image.binpb",
            "payments/v1/payments.proto",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gen" / "payments" / "v1" / "payments_pb2.py").exists()
    assert_one_keyed_method(tmp_path / "image.binpb")


@pytest.mark.skipif(
    buf_binary() is None, reason="buf is not installed (CI installs it into .ci/.buf)"
)
def test_buf_builds_and_lints_with_the_exported_options_as_a_module(tmp_path: Path) -> None:
    buf = str(buf_binary())
    user_workspace(tmp_path)
    (tmp_path / "buf.yaml").write_text(BUF_YAML)
    env = {**os.environ, "BUF_CACHE_DIR": str(tmp_path / ".buf-cache")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [buf, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    built = run("build", "-o", "image.binpb")
    assert built.returncode == 0, built.stderr
    linted = run("lint")
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert_one_keyed_method(tmp_path / "image.binpb")


@pytest.mark.skipif(
    buf_binary() is None, reason="buf is not installed (CI installs it into .ci/.buf)"
)
def test_buf_cannot_use_the_include_path_itself(tmp_path: Path) -> None:
    """Why export-protos exists: a buf.yaml module must be inside the workspace."""
    user_workspace(tmp_path)
    shutil.rmtree(tmp_path / "third_party")
    (tmp_path / "buf.yaml").write_text(
        f"version: v2\nmodules:\n  - path: proto\n  - path: {proto_include()}\n"
    )
    done = subprocess.run(
        [str(buf_binary()), "build", "-o", "image.binpb"],
        cwd=tmp_path,
        env={**os.environ, "BUF_CACHE_DIR": str(tmp_path / ".buf-cache")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "relative" in done.stderr, done.stderr


# -- relay arguments refused before connecting ---------------------------------------------------

FAKE_CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
FAKE_KEY = b"-----BEGIN EC PRIVATE KEY-----\nMHcC\n-----END EC PRIVATE KEY-----\n"


def relay_args(dsn: str, *extra: str) -> list[str]:
    return ["relay", "--dsn", dsn, "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C", *extra]


@pytest.mark.parametrize(
    "options, expected",
    [
        # gRPC's C core aborted the process (SIGABRT, exit 134) on these.
        (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
        (["--tls-ca", "{cert}", "--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
        # Was silently ignored: the relay delivered in plaintext.
        (["--tls-key", "{key}"], "--tls-cert and --tls-key go together"),
        # Was a FileNotFoundError traceback, after connecting to the database.
        (["--tls-ca", "{missing}"], "--tls-ca {missing}: cannot read: No such file"),
        (["--tls-cert", "{cert}", "--tls-key", "{missing}"], "--tls-key {missing}: cannot read"),
        (["--tls-ca", "{dir}"], "--tls-ca {dir}: cannot read"),
        # Would have failed every handshake, so every delivery: dead letters.
        (["--tls-cert", "{key}", "--tls-key", "{cert}"], "--tls-cert {key}: holds no PEM"),
        (["--tls-ca", "{key}"], "--tls-ca {key}: holds no PEM certificate"),
    ],
)
def test_relay_tls_files_are_checked_before_connecting(
    pg_dsn: str, store: object, tmp_path: Path, options: list[str], expected: str
) -> None:
    (tmp_path / "cert.pem").write_bytes(FAKE_CERT)
    (tmp_path / "key.pem").write_bytes(FAKE_KEY)
    paths = {
        "cert": str(tmp_path / "cert.pem"),
        "key": str(tmp_path / "key.pem"),
        "missing": str(tmp_path / "nonexistent.pem"),
        "dir": str(tmp_path),
    }
    done = cli(*relay_args(pg_dsn, *(o.format(**paths) for o in options)))
    assert done.returncode == 2, done.stderr
    assert expected.format(**paths) in done.stderr
    assert "Traceback" not in done.stderr and "ready" not in done.stdout


async def test_headers_the_relay_accepts_are_sent_by_grpc() -> None:
    """The other side of tests/unit/test_cli_arguments.py: what --header accepts, a real gRPC
    call sends (a header it refused failed every delivery, so dead-lettered every row)."""
    import grpc

    headers = ["X-Tenant=acme", "x.a_b-1= v ~!", "x-empty=", "x-blob-bin=AP8"]
    args = _parser().parse_args(
        ["relay", "--grpc-target", "t:1", "--method", "/a.B/C"]
        + [arg for h in headers for arg in ("--header", h)]
    )
    received: list[tuple[str, str | bytes]] = []

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        # grpc-stubs types them as plain pairs: they are _Metadatum named tuples (key, value)
        received.extend((m.key, m.value) for m in context.invocation_metadata())  # type: ignore[attr-defined]
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "a.B", {"C": grpc.unary_unary_rpc_method_handler(echo)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.unary_unary(
                "/a.B/C", request_serializer=None, response_deserializer=None
            )(b"", metadata=tuple(args.header), timeout=10)
    finally:
        await server.stop(None)
    assert set(args.header) <= set(received)


# -- input PostgreSQL would refuse: exit 2 (fix the command), not 1 (retry later) ---------------

BIGINT_MAX = 2**63 - 1


@pytest.mark.parametrize(
    "argv",
    [
        ["purge", "--batch-size", str(BIGINT_MAX + 1)],  # asyncpg's DataError: was exit 1
        ["outbox", "retry", str(BIGINT_MAX + 1)],
        ["outbox", "dead", "--limit", str(BIGINT_MAX + 1)],
        ["list", "--scope", "s", "--limit", str(BIGINT_MAX + 1)],
        ["list", "--scope", "tenant:\udcff"],  # the byte 0xff: not UTF-8
        ["inspect", "--scope", "tenant:\udcff", "k"],
        ["migrate", "--schema", "pg_x"],  # SQLSTATE 42939, reserved: was exit 1
    ],
)
def test_input_postgresql_would_refuse_exits_2(pg_dsn: str, store: object, argv: list[str]) -> None:
    done = cli(*argv, "--dsn", pg_dsn)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "unavailable" not in done.stderr


def test_the_largest_counts_and_ids_reach_postgresql(pg_dsn: str, store: object) -> None:
    """The bounds are PostgreSQL's own: bigint's largest passes every statement."""
    for argv, out in [
        (["purge", "--batch-size", str(BIGINT_MAX)], "purged"),
        (["outbox", "retry", str(BIGINT_MAX)], "0 dead letter(s) back to pending"),
        (["outbox", "dead", "--limit", str(BIGINT_MAX)], ""),
        (["list", "--scope", f"tenant:caf\u00e9-{secrets.token_hex(4)}", "--limit",
          str(BIGINT_MAX)], "no records under"),
    ]:  # fmt: skip
        done = cli(*argv, "--dsn", pg_dsn)
        assert done.returncode in (0, 3), done.stderr
        assert out in done.stdout


async def test_migrate_command_timeout_bounds_each_statement(pg_dsn: str, db: Any) -> None:
    """A statement waiting past --command-timeout (here on the migration lock, which the test
    holds) fails after it, not after the store's 30 s, saying that another runner is at work
    (it said "(TimeoutError)", and an operator looked for an outage)."""
    from grpc_idempotency.store.migrations import _lock_id

    schema = f"cmd_timeout_{secrets.token_hex(4)}"
    tx = db.transaction()
    await tx.start()
    await db.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
    try:
        started = time.monotonic()
        blocked = await asyncio.to_thread(
            cli, "migrate", "--dsn", pg_dsn, "--schema", schema, "--command-timeout", "1"
        )
        assert blocked.returncode == 1, blocked.stderr  # timed out: retry later
        assert "another runner is applying migrations to schema" in blocked.stderr
        assert "Traceback" not in blocked.stderr
        assert time.monotonic() - started < 20
    finally:
        await tx.rollback()
    try:
        done = await asyncio.to_thread(
            cli, "migrate", "--dsn", pg_dsn, "--schema", schema, "--command-timeout", "120"
        )
        assert done.returncode == 0, done.stderr
        assert "applied migrations" in done.stdout
    finally:
        await db.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def back_at_0010_with_a_row_to_backfill(store: Any, db: Any) -> int:
    """Takes ``store``'s schema back to 0010 (0011, the outbox backfill, runs again; 0012 to
    0015 replace what they made, as before) with a pending row 0011 updates; returns its id."""
    await db.execute(f'DELETE FROM "{store.schema}".schema_migrations WHERE version >= 11')
    row: int = await db.fetchval(
        f'INSERT INTO "{store.schema}".outbox (scope, key, step, parent_key, method,'
        " payload_type, payload, attempts) VALUES ('s', 'k', 'st', 'p', '/m', 't', '', 2)"
        " RETURNING id"
    )
    return row


@pytest.mark.parametrize(
    "setting, since",
    [("statement_timeout", "query_start"), ("transaction_timeout", "xact_start")],
)
async def test_migrate_command_timeout_bounds_a_migration_past_the_roles_timeouts(
    pg_dsn: str, db: Any, setting: str, since: str
) -> None:
    """A role (or DSN) whose statement_timeout is short, as many production roles' is: the README
    says to raise --command-timeout for a long migration, and the migration's statements were
    still cancelled at the role's timeout, "store unavailable while migrating (57014)", exit 1,
    as often as it was run. So with its transaction_timeout (PostgreSQL 17 and later), which
    ends the session of a transaction that outlasts it ("(InterfaceError)"). Here migration
    0011's backfill waits on a row a transaction holds for longer than the session's timeout
    (200 ms), then goes on once it ends."""
    from grpc_idempotency.store.migrations import available_migrations

    if (
        setting == "transaction_timeout"
        and int(await db.fetchval("SHOW server_version_num")) < 170000
    ):
        pytest.skip("transaction_timeout is PostgreSQL 17's; this server does not have it")
    async with fresh_store(pg_dsn, f"role_{setting}") as store:
        outbox = f'"{store.schema}".outbox'
        row = await back_at_0010_with_a_row_to_backfill(store, db)
        short = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}{setting}=200"
        tx = db.transaction()
        await tx.start()
        await db.execute(f"SELECT 1 FROM {outbox} WHERE id = $1 FOR UPDATE", row)
        migrating = asyncio.ensure_future(
            asyncio.to_thread(
                cli, "migrate", "--dsn", short, "--schema", store.schema, "--command-timeout", "60"
            )
        )
        try:

            async def waited_past_the_roles_timeout() -> bool:
                if migrating.done():  # ended at the role's timeout (the bug): see below
                    return True
                return bool(
                    await store.pool.fetchval(
                        "SELECT EXISTS (SELECT FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid))"
                        f" AND pg_catalog.now() - {since} > interval '1 s')",
                        await db.fetchval("SELECT pg_backend_pid()"),
                    )
                )

            await until("the backfill to wait past 200 ms", waited_past_the_roles_timeout)
        finally:
            await tx.rollback()
        done = await migrating
        assert done.returncode == 0, done.stderr
        applied = [m.version for m in available_migrations() if m.version >= 11]
        assert f"applied migrations: {applied}" in done.stdout
        assert await db.fetchval(f"SELECT failures FROM {outbox} WHERE id = $1", row) == 2


async def test_a_migration_past_its_command_timeout_says_which_and_what_to_raise(
    pg_dsn: str, db: Any
) -> None:
    """A migration's own statement running past --command-timeout (here 0011's backfill, made
    slow by a trigger on the row it updates) said "store unavailable while migrating
    (TimeoutError)", and an operator looked for an outage: it names the migration and the option
    to raise. (Not a backfill waiting on a row a transaction holds: that wait is a lock's, bounded
    below the statement timeout, and gives way: test_store.py.)"""
    async with fresh_store(pg_dsn, "slow_migration") as store:
        outbox = f'"{store.schema}".outbox'
        row = await back_at_0010_with_a_row_to_backfill(store, db)
        slow = f'"{store.schema}".slow_update'
        await db.execute(
            f"CREATE FUNCTION {slow}() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_catalog.pg_sleep(60); RETURN NEW; END $$;"
            f" CREATE TRIGGER slow_update BEFORE UPDATE ON {outbox}"
            f" FOR EACH ROW EXECUTE FUNCTION {slow}()"
        )
        try:
            done = await asyncio.to_thread(
                cli, "migrate", "--dsn", pg_dsn, "--schema", store.schema, "--command-timeout", "1"
            )
        finally:
            await db.execute(f"DROP TRIGGER slow_update ON {outbox}; DROP FUNCTION {slow}()")
        assert done.returncode == 1, done.stderr  # retry later, with more time
        assert "migration 0011_outbox_failures_so_far ran past the statement timeout of 1 s" in (
            done.stderr
        )
        assert "--command-timeout" in done.stderr and "Traceback" not in done.stderr
        assert await db.fetchval(f"SELECT failures FROM {outbox} WHERE id = $1", row) == 0
        again = await asyncio.to_thread(cli, "migrate", "--dsn", pg_dsn, "--schema", store.schema)
        assert again.returncode == 0, again.stderr
        assert await db.fetchval(f"SELECT failures FROM {outbox} WHERE id = $1", row) == 2


def test_a_migration_the_schemas_own_objects_refuse_is_misconfigured_not_unavailable(
    pg_dsn: str,
) -> None:
    """A schema shared with the application, which has a ``records`` table of its own (the
    README advises against it): migration 0001 fails on it every time. That is for an operator
    to fix (exit 2, naming the migration and what PostgreSQL refused), not "store unavailable
    while migrating (42P07)", exit 1, which told a deploy step to retry later, for good."""
    schema = f"shared_{secrets.token_hex(4)}"
    create = f'CREATE SCHEMA "{schema}"; CREATE TABLE "{schema}".records (id integer)'
    assert cli_sql(pg_dsn, create)
    try:
        done = cli("migrate", "--dsn", pg_dsn, "--schema", schema)
        assert done.returncode == 2, done.stderr
        assert "misconfigured" in done.stderr and "unavailable" not in done.stderr
        assert "migration 0001_records" in done.stderr
        assert 'relation "records" already exists' in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        assert cli_sql(pg_dsn, f'DROP SCHEMA "{schema}" CASCADE')


def cli_sql(dsn: str, sql: str) -> bool:
    """Runs ``sql`` on a connection of its own (for the tests that run no event loop)."""

    async def run() -> None:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())
    return True


# -- interrupted: SIGINT (Ctrl-C) or SIGTERM while a statement waits ----------------------------

EXPIRED = (
    "INSERT INTO {records} (scope, key, method, fingerprint, state, fencing_token, locked_until,"
    " status_code, completed_at, expires_at, retention)"
    " SELECT 's', 'old-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
    "  clock_timestamp() - interval '2 h',"
    "  clock_timestamp() - interval '1 h' + i * interval '1 ms', interval '1 h'"
    " FROM generate_series(1, 5) i"
)


EXPIRED_SENT = (
    "INSERT INTO {outbox} (scope, key, step, parent_key, method, payload_type, payload, state,"
    " sent_at) SELECT 's', 'sent-' || i, 'st', 'p', '/a.B/C', 't', '\\x00', 'sent',"
    " clock_timestamp() - interval '2 days' FROM generate_series(1, 5) i"
)


async def purge_signalled_while_waiting(
    dsn: str, store: Any, table: str, argv: list[str], sig: signal.Signals
) -> tuple[asyncio.subprocess.Process, bytes, bytes]:
    """The purge command ``argv`` run until one of its DELETEs on ``table`` waits on a lock the
    test holds, then sent ``sig``: the finished process, its stdout and stderr. Returns once the
    DELETE's backend is gone, the lock still held: the statement was stopped, not left waiting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "grpc_idempotency.cli", *argv, "--dsn", dsn,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:

        async def waiting_on_the_lock() -> int | None:
            assert proc.returncode is None, "the purge ended before it waited"
            return await delete_waiting_on_a_lock(store.pool, table)

        pid = await until("the purge's DELETE waiting on the lock", waiting_on_the_lock, 30)
        proc.send_signal(sig)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        await until("the purge's backend to exit", lambda: backend_gone(store.pool, pid), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc, out, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["purge", "outbox purge-sent"])
async def test_an_interrupted_purge_rolls_its_batch_back_says_so_and_exits_128_plus_the_signal(
    pg_dsn: str, db: Any, sig: signal.Signals, command: str
) -> None:
    """Ctrl-C printed a traceback (CancelledError, then KeyboardInterrupt) and SIGTERM killed
    the command without a word. The purge waits on a lock the test holds, so the signal arrives
    while its DELETE is on the wire, deterministically (not a row lock: a batch waits on one a
    bounded while, then is redone skipping the row).

    Then that DELETE ran on in PostgreSQL, waiting on the lock as long as it was held, and
    committed (each batch was a statement of its own): the rows went although the command had
    said they stayed. Now the batch is cancelled and rolled back before the command exits."""
    async with fresh_store(pg_dsn, "interrupted") as s:
        if command == "purge":
            table = f'"{s.schema}".records'
            await s.pool.execute(EXPIRED.format(records=table))
            # The batch after the first (old-1, old-2) waits on old-3: a trigger deleting it
            # waits on an advisory lock the test holds, redone skipping locked rows or not.
            gate = secrets.randbits(62)
            await s.pool.execute(
                f'CREATE FUNCTION "{s.schema}".gate() RETURNS trigger LANGUAGE plpgsql AS'
                f" $$BEGIN PERFORM pg_advisory_xact_lock({gate}); RETURN OLD; END$$;"
                f" CREATE TRIGGER gate BEFORE DELETE ON {table} FOR EACH ROW"
                f""" WHEN (OLD.key = 'old-3') EXECUTE FUNCTION "{s.schema}".gate()"""
            )
            lock = f"SELECT pg_advisory_xact_lock({gate})"
            argv = ["purge", "--batch-size", "2"]
        else:
            table = f'"{s.schema}".outbox'
            await s.pool.execute(EXPIRED_SENT.format(outbox=table))
            # Its batches skip locked rows: the table lock makes the first one wait.
            lock = f"LOCK TABLE {table} IN SHARE MODE"
            argv = ["outbox", "purge-sent", "--older-than", "3600", "--batch-size", "2"]
        tx = db.transaction()
        await tx.start()
        await db.execute(lock)
        try:
            proc, out, err = await purge_signalled_while_waiting(
                pg_dsn, s, table, [*argv, "--schema", s.schema], sig
            )
        finally:
            await tx.rollback()
        name = "interrupted" if sig == signal.SIGINT else "terminated"
        assert (proc.returncode, err.decode()) == (128 + sig, f"grpc-idempotency: {name}\n")
        left = await s.pool.fetchval(f"SELECT count(*) FROM {table}")
        if command == "purge":
            # The first batch (old-1, old-2) committed before the second met the lock.
            assert out == b"purged 2 expired records before it was stopped\n"
            assert left == 3
        else:
            assert out == b"purged 0 sent row(s) before it was stopped\n"
            assert left == 5


# Batches after the first four rows deleted (two batches of two) wait on advisory lock 4242 (the
# test holds it), in whatever order the purge takes the rows: the count lives in a table of its own.
GATE = """
CREATE TABLE {schema}.gate (n integer NOT NULL);
INSERT INTO {schema}.gate VALUES (0);
CREATE FUNCTION {schema}.gate() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE v integer;
BEGIN
    UPDATE {schema}.gate SET n = n + 1 RETURNING n INTO v;
    IF v > 4 THEN PERFORM pg_advisory_xact_lock(4242); END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER gate BEFORE DELETE ON {schema}.outbox FOR EACH ROW EXECUTE FUNCTION {schema}.gate();
"""


@pytest.mark.parametrize(
    ("command", "state", "said"),
    [("purge-sent", "sent", "sent row(s)"), ("purge-dead", "dead", "dead letter(s)")],
)
async def test_an_interrupted_outbox_purge_says_what_its_committed_batches_purged(
    pg_dsn: str, db: Any, command: str, state: str, said: str
) -> None:
    """As purge does: stopped after its first batch committed, an outbox purge printed nothing
    of the rows that batch deleted for good (only "interrupted"), and an operator purging a
    backlog could not tell whether anything went."""
    async with fresh_store(pg_dsn, "interrupted_outbox") as s:
        table = f'"{s.schema}".outbox'
        await s.pool.execute(
            f"INSERT INTO {table} (scope, key, step, parent_key, method, payload_type, payload,"
            " state, sent_at, next_attempt_at) SELECT 's', 'old-' || i, 'st', 'p', '/a.B/C', 't',"
            f" '\\x00', '{state}', clock_timestamp() - interval '2 days',"
            " clock_timestamp() - interval '2 days' FROM generate_series(1, 5) i"
        )
        await s.pool.execute(GATE.format(schema=f'"{s.schema}"'))
        await db.execute("SELECT pg_advisory_lock(4242)")
        argv = ["outbox", command, "--older-than", "3600", "--batch-size", "2"]
        try:
            proc, out, err = await purge_signalled_while_waiting(
                pg_dsn, s, table, [*argv, "--schema", s.schema], signal.SIGINT
            )
        finally:
            await db.execute("SELECT pg_advisory_unlock(4242)")
        assert (proc.returncode, err.decode()) == (130, "grpc-idempotency: interrupted\n")
        # Both committed batches, summed (not the last one's alone).
        assert out.decode() == f"purged 4 {said} before it was stopped\n"
        assert await s.pool.fetchval(f"SELECT count(*) FROM {table}") == 1


@pytest.mark.parametrize("command", [["inspect", "--scope", "s", "k"], ["list", "--scope", "s"]])
async def test_a_command_interrupted_while_connecting_says_so(command: list[str]) -> None:
    """inspect runs its look-ups in an event loop of its own, list in the store commands' one:
    Ctrl-C printed a traceback in both. The "server" reads the startup message and never
    answers, so the signal arrives while the command waits to connect."""
    reached = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(1)
        reached.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "grpc_idempotency.cli", *command,
            "--dsn", f"postgresql://app@127.0.0.1:{port}/db?sslmode=disable",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        await asyncio.wait_for(reached.wait(), 30)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        # Closed and awaited here, in this test's loop: a transport left for the garbage
        # collector detaches from a server already closed (3.13 prints an unraisable TypeError
        # from Server._wakeup in whichever test runs then).
        for writer in held:
            writer.close()
        server.close()
        for writer in held:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await server.wait_closed()
    assert (proc.returncode, err.decode()) == (130, "grpc-idempotency: interrupted\n")
    assert out == b""


# -- output cut short: `grpc-idempotency list ... | head` ---------------------------------------


@pytest.mark.parametrize("output", [[], ["--json"]], ids=["text", "json"])
async def test_a_reader_that_goes_early_ends_the_command_quietly_with_141(
    pg_dsn: str, output: list[str]
) -> None:
    """A BrokenPipeError traceback and exit 1, which says "unreachable, retry later". Now as
    a C tool under ``head``: nothing on stderr, and 141 (128 + SIGPIPE, what a shell reports
    for a writer the closed pipe killed)."""
    async with fresh_store(pg_dsn, "pipe") as s:
        await s.pool.execute(
            f'INSERT INTO "{s.schema}".records (scope, key, method, fingerprint, state,'
            " fencing_token, locked_until, status_code, completed_at, expires_at, retention)"
            " SELECT 's', 'k' || i, '/a.B/C', '\\x00', 'completed', 1, NULL, 0, now(),"
            " now() + interval '1 h', interval '1 h' FROM generate_series(1, 5000) i"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
        read_end, write_end = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "grpc_idempotency.cli", "list", "--scope", "s",
                "--limit", "5000", "--dsn", pg_dsn, "--schema", s.schema, *output,
                stdout=write_end, stderr=asyncio.subprocess.PIPE, env=env,
            )  # fmt: skip
        finally:
            os.close(write_end)  # the command has its own copy
        with os.fdopen(read_end, "rb") as reader:
            first = await asyncio.to_thread(reader.readline)  # as `head -1` reads
        # Closed, with ~0.5 MB still to come: far more than a pipe holds.
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert first.strip()
    assert (proc.returncode, err.decode()) == (141, "")


@pytest.mark.parametrize("stdout", ["reader gone", "closed"])
async def test_a_relay_whose_stdout_reader_went_goes_on_and_stops_cleanly(
    pg_dsn: str, stdout: str
) -> None:
    """A relay's stdout piped to a log shipper that restarts: its "ready" line raised
    BrokenPipeError, logged with its traceback as on_listening's bug, and the clean stop after
    SIGTERM exited 141, where the relay's is 0. The relay goes on delivering (its log is
    stderr's); what it still prints on stdout is dropped. The same for a relay started with
    stdout closed (``>&-``): dropping its lines asked ``None`` for its file descriptor."""
    async with fresh_store(pg_dsn, "relaypipe") as s:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the relay says it is ready
        # A shell closes it: preexec_fn is not safe in a process running threads.
        closing = ["sh", "-c", 'exec "$0" "$@" >&-'] if stdout == "closed" else []
        try:
            proc = await asyncio.create_subprocess_exec(
                *closing, sys.executable, "-m", "grpc_idempotency.cli",
                *relay_args(pg_dsn, "--schema", s.schema, "--no-listen", "--poll-interval", "60"),
                stdout=write_end, stderr=asyncio.subprocess.PIPE, env=env,
            )  # fmt: skip
        finally:
            os.close(write_end)
        assert proc.stderr is not None
        logged: list[str] = []
        # Logged right before the ready line is printed, in the same step of the event loop,
        # which runs the SIGTERM handler only after both.
        while not logged or "polling every" not in logged[-1]:
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert line, "".join(logged)
            logged.append(line.decode())
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    stderr = "".join(logged) + err.decode()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    # Said once, so that a supervisor's wait for the ready line has a reason to show.
    assert stderr.count("stdout cannot be written") == 1, stderr


FORGED = "2026-01-01 00:00:00,000 INFO grpc_idempotency.outbox: relay r: delivered"


async def relay_of_one_row(
    dsn: str, store: Any, port: int, *more: str, stdout: int = asyncio.subprocess.DEVNULL
) -> asyncio.subprocess.Process:
    """One pending outbox row in ``store``'s schema, and `grpc-idempotency relay` (polling, its
    stderr piped) delivering it to ``/a.B/C`` on the loopback ``port``, with ``more`` arguments."""
    await store.pool.execute(
        f'INSERT INTO "{store.schema}".outbox (scope, key, step, parent_key, method,'
        " payload_type, payload) VALUES ('s', 'k', 'e.v1', 'p', '/x.Y/Z', 'x.E', '')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    argv = ["relay", "--dsn", dsn, "--schema", store.schema, "--no-listen",
            "--grpc-target", f"127.0.0.1:{port}", "--method", "/a.B/C", *more]  # fmt: skip
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "grpc_idempotency.cli", *argv,
        stdout=stdout, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


async def relayed_row(
    dsn: str, store: Any, port: int, *more: str, columns: str, leaves: str
) -> tuple[Any, asyncio.subprocess.Process, bytes]:
    """``relay_of_one_row`` run until its row matches ``leaves`` (a WHERE clause), then stopped
    (SIGTERM): the row's ``columns``, the finished process and its stderr."""
    proc = await relay_of_one_row(dsn, store, port, *more)
    try:
        found = f'SELECT {columns} FROM "{store.schema}".outbox WHERE {leaves}'
        row = await until(
            "the delivery's outcome recorded", lambda: store.pool.fetchrow(found), timeout=30
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    return row, proc, err


async def test_a_downstream_error_cannot_add_or_overwrite_lines_of_the_relays_log(
    pg_dsn: str,
) -> None:
    """A failed delivery's error is the receiving server's status message, which may quote what
    its caller sent: the relay logged it as it came, so a newline added a forged log line and
    an ESC sequence rewrote the terminal's. Escaped, as inspect and outbox dead show it."""
    import grpc

    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"busy\n{FORGED}\x1b[1A\x1b[2K")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(refuse)})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with fresh_store(pg_dsn, "relaylog") as s:
            proc = await relay_of_one_row(pg_dsn, s, port)
            assert proc.stderr is not None
            logged: list[str] = []
            while not logged or "delivery 1 failed" not in logged[-1]:
                line = await asyncio.wait_for(proc.stderr.readline(), 30)
                assert line, "".join(logged)
                logged.append(line.decode())
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop(None)
    lines = "".join(logged).splitlines() + err.decode().splitlines()
    assert proc.returncode == 0, lines
    assert not [line for line in lines if line.startswith(FORGED[:10])], lines
    assert not [line for line in lines if "\x1b" in line], lines
    assert f"busy\\n{FORGED}\\x1b[1A" in logged[-1]  # shown, escaped


async def test_a_relay_told_to_dead_letter_on_unimplemented_parks_at_once(pg_dsn: str) -> None:
    """UNIMPLEMENTED is retried (a receiver may not have the method deployed yet); the CLI had
    no way to park such rows at once, as ``GrpcSink(permanent_codes=...)`` does in Python."""
    import grpc

    server = grpc.aio.server()  # serves no method at all: every call is UNIMPLEMENTED
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with fresh_store(pg_dsn, "relaydead") as s:
            more = ["--dead-letter-on", "unimplemented", "--max-attempts", "5"]
            row, proc, err = await relayed_row(
                pg_dsn, s, port, *more, columns="state, attempts", leaves="state <> 'pending'"
            )
    finally:
        await server.stop(None)
    assert proc.returncode == 0, err.decode()
    assert (row["state"], row["attempts"]) == ("dead", 1), dict(row)


TLS = Path(__file__).resolve().parent.parent / "support" / "tls"  # make.sh: localhost's


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_a_relay_takes_a_delivery_answered_with_a_large_response_as_delivered(
    pg_dsn: str, tls: bool
) -> None:
    """The relay drops the response, but its channel refused one over gRPC's default 4 MiB
    (RESOURCE_EXHAUSTED, retried): a receiver that had run the message and answered OK was
    called again on every retry, replayed its answer, and the row ended a dead letter. Over
    TLS (--tls-ca) too: a channel of its own kind."""
    import grpc

    calls: list[bytes] = []

    def answer_large(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls.append(request)
        return b"x" * (5 * 1024 * 1024)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(answer_large)})]
    )  # fmt: skip
    more: list[str] = []
    if tls:
        pem = (TLS / "server.key").read_bytes(), (TLS / "server.crt").read_bytes()
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pem]))
        more = ["--tls-ca", str(TLS / "ca.crt")]
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with fresh_store(pg_dsn, "relaylarge") as s:
            row, proc, err = await relayed_row(
                pg_dsn,
                s,
                port,
                *more,
                columns="state, failures, last_error",
                leaves="state <> 'pending' OR failures > 0",
            )
    finally:
        await server.stop(None)
    assert proc.returncode == 0, err.decode()
    assert (row["state"], row["failures"]) == ("sent", 0), dict(row)
    assert len(calls) == 1


# -- output that cannot be written: `grpc-idempotency purge > /dev/full` --------------------------

FULL = Path("/dev/full")  # every write fails with ENOSPC
NO_SPACE = "grpc-idempotency: cannot write the output: No space left on device\n"


def into_dev_full(*args: str) -> tuple[int, str]:
    """``grpc-idempotency <args> > /dev/full``: its exit status and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    with FULL.open("w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "grpc_idempotency.cli", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    return done.returncode, done.stderr


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")
async def test_a_purge_whose_report_cannot_be_written_exits_74_and_its_work_stays_done(
    pg_dsn: str,
) -> None:
    """An OSError traceback and exit 1, "unreachable, retry later", for a purge that had
    purged. Now one line and 74 (EX_IOERR): the records are gone, only the report is lost."""
    async with fresh_store(pg_dsn, "full") as s:
        await s.pool.execute(
            f'INSERT INTO "{s.schema}".records (scope, key, method, fingerprint, state,'
            " fencing_token, locked_until, status_code, completed_at, expires_at, retention)"
            " SELECT 's', 'k' || i, '/a.B/C', '\\x00', 'completed', 1, NULL, 0,"
            " now() - interval '2 h', now() - interval '1 h', interval '1 s'"
            " FROM generate_series(1, 3) i"
        )
        status, err = await asyncio.to_thread(
            into_dev_full, "purge", "--dsn", pg_dsn, "--schema", s.schema
        )
        left = await s.pool.fetchval(f'SELECT count(*) FROM "{s.schema}".records')
    assert (status, err) == (74, NO_SPACE)
    assert left == 0


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")
@pytest.mark.parametrize(
    "command",
    [["list", "--scope", "s", "--limit", "5000"], ["list", "--scope", "s", "--limit", "5000",
     "--json"], ["outbox", "stats"], ["include-path"], ["--version"]],
    ids=["list", "list --json", "outbox stats", "include-path", "--version"],
)  # fmt: skip
async def test_output_that_cannot_be_written_is_one_line_and_exit_74(
    pg_dsn: str, command: list[str]
) -> None:
    """``list``'s 5000 rows fail mid-command (the buffer fills), the others at the last flush."""
    async with fresh_store(pg_dsn, "full") as s:
        await s.pool.execute(
            f'INSERT INTO "{s.schema}".records (scope, key, method, fingerprint, state,'
            " fencing_token, locked_until, status_code, completed_at, expires_at, retention)"
            " SELECT 's', 'k' || i, '/a.B/C', '\\x00', 'completed', 1, NULL, 0, now(),"
            " now() + interval '1 h', interval '1 h' FROM generate_series(1, 5000) i"
        )
        database = (
            ["--dsn", pg_dsn, "--schema", s.schema] if command[0] in ("list", "outbox") else []
        )
        status, err = await asyncio.to_thread(into_dev_full, *command, *database)
    assert (status, err) == (74, NO_SPACE)


@pytest.mark.parametrize("closing", [">&-", ">&- 2>&-"])
def test_a_command_started_with_stdout_closed_exits_74_with_one_line(closing: str) -> None:
    """``grpc-idempotency inspect ... >&-``: Python starts with ``sys.stdout`` None, and every
    command's first print was an AttributeError traceback and exit 1 ("unreachable, retry
    later" for ``inspect`` and ``list``). With stderr closed too, 74 all the same: the line
    for stderr went to stdout (``print(file=None)``), which raised again (exit 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    done = subprocess.run(
        # A shell closes it: preexec_fn is not safe in a process running threads.
        ["sh", "-c", f'exec "$0" "$@" {closing}', sys.executable, "-m", "grpc_idempotency.cli",
         "include-path"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )  # fmt: skip
    said = "grpc-idempotency: cannot write the output: standard output is closed\n"
    assert (done.returncode, done.stderr) == (74, "" if "2>&-" in closing else said)


async def test_a_relay_leaves_a_connection_whose_receiver_went_silent_for_a_new_one(
    pg_dsn: str,
) -> None:
    """A connection that stays open while nothing comes back on it (the receiver's host gone,
    or the state of it lost at a NAT or load balancer on the way) is READY for gRPC: without
    keepalive, every delivery went out on it and failed DEADLINE_EXCEEDED (still so 100 s on),
    each a failure towards the row's dead letter, though a new connection reached a working
    receiver. The relay's channel pings within half of --timeout once nothing is read during
    a delivery, and closes the connection when the ping is not answered within the other
    half: the delivery after it reconnects."""
    import grpc

    from tests.support.blackhole import BlackholeProxy

    keys: list[str | bytes] = []

    def accept(request: bytes, context: grpc.ServicerContext) -> bytes:
        keys.append(dict(context.invocation_metadata())["idempotency-key"])
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(accept)})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = BlackholeProxy(f"postgresql://u@127.0.0.1:{port}/x")  # TCP only: any protocol
    await proxy.start()
    timeout = 2.0
    more = ["--timeout", f"{timeout:g}", "--lease", f"{2 * timeout:g}", "--poll-interval", "0.1",
            "--initial-backoff", "0.1", "--max-backoff", "0.1"]  # fmt: skip
    try:
        async with fresh_store(pg_dsn, "relaysilent") as s:
            proc = await relay_of_one_row(pg_dsn, s, proxy.port, *more)
            try:
                sent = (
                    f'SELECT state, failures FROM "{s.schema}".outbox'
                    " WHERE key = $1 AND state = 'sent'"
                )
                await until("the first row sent", lambda: s.pool.fetchrow(sent, "k"), 30)
                proxy.silence_open_connections()
                await s.pool.execute(
                    f'INSERT INTO "{s.schema}".outbox (scope, key, step, parent_key, method,'
                    " payload_type, payload) VALUES ('s', 'k2', 'e.v1', 'p2', '/x.Y/Z', 'x.E', '')"
                )
                started = time.monotonic()
                # Its first delivery fails by its deadline (the ping sent within half of it,
                # unanswered for the other half, closes the connection); the retry, due 0.1 s
                # later, reconnects. Without keepalive the connection was still used at 100 s.
                row = await until(
                    "the second row sent through a new connection",
                    lambda: s.pool.fetchrow(sent, "k2"),
                    timeout=2 * timeout + 2.0,
                )
                took = time.monotonic() - started
            finally:
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await proxy.close()
        await server.stop(None)
    assert proc.returncode == 0, err.decode()
    assert keys == ["k", "k2"], (keys, took)
    assert row["failures"] <= 1, dict(row)
    assert proxy.accepted == 2, proxy.accepted  # one reconnection
