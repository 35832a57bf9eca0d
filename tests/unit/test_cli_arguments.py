"""The command's arguments that are refused before anything connects (exit status 2): relay
headers gRPC would refuse at send time, TLS files, numbers and text the database would refuse.

Run through the parser, as ``main`` does; no database, no server (tests/integration/test_cli.py
runs the command against real ones)."""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import unicodedata
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from grpc_idempotency.cli import _check_outbox, _check_relay, _parser, main
from grpc_idempotency.core.keys import scope_problem
from grpc_idempotency.inspect_cli import ConfigError, config_of
from grpc_idempotency.inspect_cli.commands import list_cursor_mismatch
from grpc_idempotency.inspect_cli.cursor import ListCursor, Listing
from grpc_idempotency.inspect_cli.parsers import scope_text

RELAY = ["relay", "--dsn", "postgresql://u@db/app", "--grpc-target", "t:1", "--method", "/a.B/C"]


def parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(argv)


def refused(*argv: str) -> str:
    """The error argparse prints for ``argv``, which must exit with status 2."""
    parser = _parser()
    with pytest.raises(SystemExit) as exited:
        args = parser.parse_args(argv)
        if args.command == "relay":
            _check_relay(parser, args)
        if args.command == "outbox":
            _check_outbox(parser, args)
    assert exited.value.code == 2
    return str(exited.value.__context__ or "")


@pytest.mark.parametrize(
    "header, sent",
    [
        ("x-tenant=acme", ("x-tenant", "acme")),
        ("X-Tenant=acme", ("x-tenant", "acme")),  # HTTP/2 names are lowercase: normalised
        ("x.a_b-1= v ~!", ("x.a_b-1", " v ~!")),
        ("x-empty=", ("x-empty", "")),
        ("x-token=a=b", ("x-token", "a=b")),
        ("x-blob-bin=AP8", ("x-blob-bin", b"\x00\xff")),  # base64, unpadded as on the wire
        ("x-blob-bin=AP8=", ("x-blob-bin", b"\x00\xff")),
    ],
)
def test_headers_gRPC_sends_are_accepted(header: str, sent: tuple[str, str | bytes]) -> None:
    assert parse(*RELAY, "--header", header).header == [sent]


@pytest.mark.parametrize(
    "header",
    [
        "x tenant=acme",  # gRPC: "Illegal header key"
        "x@tenant=acme",
        ":path=/x",
        "=acme",
        "x-tenant",
        "x-tenant=acme\n",  # gRPC: "Illegal header value"
        "x-tenant=a\tb",
        "x-tenant=caf\u00e9",
        "x-tenant=a\x7fb",
        "x-blob-bin=not base64!",  # gRPC: a -bin value must be bytes (TypeError when sent)
        "x-blob-bin=caf\u00e9",
        "idempotency-key=k",  # the relay's own: one per row
        "Idempotency-Key=k",
        "idempotency-key-bin=YWJj",  # its binary form: the server refuses a call with it
        "x-grpc-idempotency-step=charge.v1",  # the library's own too
        "grpc-timeout=1S",  # reserved by gRPC
        "te=trailers",  # HTTP/2 transport
    ],
)
def test_headers_gRPC_would_refuse_are_refused(header: str) -> None:
    refused(*RELAY, "--header", header)


def test_the_scope_header_is_checked_too() -> None:
    assert parse(*RELAY, "--scope-header", "X-Tenant-Id").scope_header == "x-tenant-id"
    refused(*RELAY, "--scope-header", "x tenant")
    refused(*RELAY, "--scope-header", "idempotency-key")
    refused(*RELAY, "--scope-header", "x-tenant", "--header", "x-tenant=acme")
    # What forward_scope refuses, refused before connecting (it was made once connected).
    refused(*RELAY, "--scope-header", "x-tenant-bin")
    refused(*RELAY, "--scope-header", "user-agent")
    refused(*RELAY, "--scope-header", "x-tenant", "--scope-prefix", "tenant\x00")
    # A prefix no scope may start with (MetadataScope refuses it): every row a dead letter.
    said = refused(*RELAY, "--scope-header", "x-tenant", "--scope-prefix", "\u202etenant:")
    assert "--scope-prefix" in said and "U+202E" in said, said  # the option at fault, named
    said = refused(*RELAY, "--scope-header", "x-tenant", "--scope-prefix", "t" * 1024)
    assert "--scope-prefix" in said, said
    assert "--scope-header" in refused(*RELAY, "--scope-header", "x-tenant-bin")


def test_dead_letter_codes_are_grpc_status_names_other_than_ok() -> None:
    import grpc

    assert parse(*RELAY).dead_letter_on == []
    args = parse(*RELAY, "--dead-letter-on", "unimplemented", "--dead-letter-on", "UNAVAILABLE")
    assert args.dead_letter_on == [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE]
    assert "UNIMPLEMENTED" in refused(*RELAY, "--dead-letter-on", "UNIMPLMENTED")  # the names
    refused(*RELAY, "--dead-letter-on", "OK")  # an answered delivery was delivered
    refused(*RELAY, "--dead-letter-on", "12")


NOT_PEM = os.devnull  # a file that holds no PEM


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--initial-backoff", "10", "--max-backoff", "1"],
         "--max-backoff (1) must not be smaller than --initial-backoff (10)"),
        (["--grpc-target", " "], "--grpc-target is empty (an unset variable?): give HOST:PORT"),
        # Cut to half the lease without a word, and each call cancelled before its deadline.
        (["--lease", "10", "--timeout", "6"],
         "--timeout (6) is more than half of --lease (10), the most a delivery gets: raise"
         " --lease to at least 12"),
        (["--scope-header", "x-t", "--header", "x-t=a"], "--header x-t is also the --scope-header"),
        (["--method", "bad"], "--method: method must look like /package.Service/Method, not 'bad'"),
        (["--scope-header", "x-t-bin"],
         "--scope-header: 'x-t-bin' is binary metadata (-bin), whose values are bytes;"
         " send the tenant as text"),
        (["--scope-header", "x-t", "--scope-prefix", "t\x00"],
         "--scope-prefix: the prefix holds NUL, which no scope can hold"),
        (["--tls-cert", NOT_PEM],
         "--tls-cert and --tls-key go together (the client certificate and its key)"),
        (["--tls-ca", "/nonexistent/ca.pem"],
         "--tls-ca /nonexistent/ca.pem: cannot read: No such file or directory"),
        (["--tls-ca", NOT_PEM], f"--tls-ca {NOT_PEM}: holds no PEM certificate"),
    ],
)  # fmt: skip
def test_a_relay_check_after_parsing_says_relay_once(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checks made after argparse's (arguments that only together are wrong, files) are errors
    of relay's parser, which names the command: they read "grpc-idempotency relay: error:
    relay: ...". Now each reads as argparse's own, the command named once."""
    refused(*RELAY, *options)
    err = capsys.readouterr().err
    assert err.startswith("usage: grpc-idempotency relay ")
    assert err.splitlines()[-1] == f"grpc-idempotency relay: error: {message}"


@pytest.mark.parametrize("method", ["bad", "a.B/C", "/a.B/C/D", "/a.B/", "//C"])
def test_a_relay_method_that_is_no_method_path_is_refused_before_connecting(
    method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """GrpcSink refused it, made once the relay had connected: with the database down, the
    mistake exited 1 ("retry later"). With relay's usage, not the top-level command list."""
    refused(*RELAY[:-1], method)
    err = capsys.readouterr().err
    assert err.startswith("usage: grpc-idempotency relay ") and "COMMAND" not in err


CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


@pytest.mark.parametrize(
    "files, used",
    [
        ({}, set()),
        ({"--tls-ca": CERT}, {"--tls-ca"}),
        ({"--tls-cert": CERT, "--tls-key": KEY}, {"--tls-cert", "--tls-key"}),
        ({"--tls-ca": CERT, "--tls-cert": CERT, "--tls-key": KEY.replace(b" PRIV", b" RSA PRIV")},
         {"--tls-ca", "--tls-cert", "--tls-key"}),
    ],
)  # fmt: skip
def test_tls_files_are_read_before_connecting(
    tmp_path: Path, files: dict[str, bytes], used: set[str]
) -> None:
    argv = list(RELAY)
    for option, pem in files.items():
        path = tmp_path / option.strip("-")
        path.write_bytes(pem)
        argv += [option, str(path)]
    parser = _parser()
    args = parser.parse_args(argv)
    _check_relay(parser, args)
    assert args.tls_pem == {option: files[option] for option in used}


BIGINT_MAX = 2**63 - 1


@pytest.mark.parametrize(
    "argv",
    [
        # purge --pause: inf slept forever after the first batch, nan meant no pause.
        ["purge", "--pause", "inf"],
        ["purge", "--pause", "nan"],
        ["purge", "--pause", "-1"],
        # Beyond bigint: asyncpg's DataError, reported as a database failure (exit 1).
        ["purge", "--batch-size", str(BIGINT_MAX + 1)],
        ["purge", "--batch-size", "0"],
        ["purge", "--max-batches", "0"],
        ["outbox", "retry", str(BIGINT_MAX + 1)],
        ["outbox", "retry", str(-BIGINT_MAX - 2)],
        ["outbox", "dead", "--limit", str(BIGINT_MAX + 1)],
        ["list", "--scope", "s", "--limit", str(BIGINT_MAX + 1)],
        ["list", "--scope", "s", "--limit", "0"],
        ["relay", *RELAY[1:], "--batch-size", str(BIGINT_MAX + 1)],
        # Not UTF-8 (a byte 0xff in argv): no encoding to the database accepts it.
        ["list", "--scope", "tenant:\udcff"],
        ["list", "--scope", "s", "--method", "/a.B/\udcff"],
        ["inspect", "--scope", "tenant:\udcff", "k"],
        ["inspect", "--scope", "s", "k\udcff"],
        # pg_ names are reserved: CREATE SCHEMA fails with SQLSTATE 42939.
        ["migrate", "--schema", "pg_x"],
        ["purge", "--schema", "pg_temp"],
        ["inspect", "--schema", "pg_x", "--scope", "s", "k"],
        ["migrate", "--schema", "Has-Dash"],
        # PostgreSQL's own schema, which exists everywhere and which pg_dump leaves out.
        ["migrate", "--schema", "information_schema"],
        # Each delivery gets half the lease: a lease of milliseconds dead-letters every row.
        [*RELAY, "--lease", "0.001"],
        [*RELAY, "--lease", "0.99"],
        ["outbox", "stats", "--statement-cache-size", "-1"],
        # migrate --command-timeout: a finite positive number of seconds.
        ["migrate", "--command-timeout", "0"],
        ["migrate", "--command-timeout", "inf"],
        ["migrate", "--command-timeout", "nan"],
        # Durations past 36500 days overflow the database's timestamps (SQLSTATE 22008),
        # which read as the store being down (exit 1).
        ["outbox", "purge-dead", "--older-than", "1e12"],
        ["outbox", "purge-sent", "--older-than", "1e12"],
        [*RELAY, "--lease", "1e13"],
        [*RELAY, "--max-backoff", "1e13"],
        [*RELAY, "--sent-retention", "1e13"],
        ["outbox", "purge-sent", "--older-than", str(36500 * 86400 + 1)],  # just past the cap
    ],
)
def test_input_the_database_would_refuse_is_refused_up_front(argv: list[str]) -> None:
    refused(*argv)


def test_the_bounds_themselves_are_accepted() -> None:
    assert parse("purge", "--pause", "0.5", "--batch-size", str(BIGINT_MAX)).pause == 0.5
    assert parse("outbox", "retry", str(BIGINT_MAX), "1").ids == [BIGINT_MAX, 1]
    assert parse("list", "--scope", "tenant:caf\u00e9", "--limit", str(BIGINT_MAX)).limit == (
        BIGINT_MAX
    )
    assert parse("migrate", "--schema", "app_pg_x").schema == "app_pg_x"
    assert parse("migrate", "--schema", "information_schema_x").schema == "information_schema_x"
    assert parse(*RELAY, "--lease", "1").lease == 1.0
    assert parse("migrate", "--command-timeout", "3600").command_timeout == 3600.0
    assert parse("migrate").command_timeout is None  # the store's default
    longest = str(36500 * 86400)
    assert parse("outbox", "purge-dead", "--older-than", longest).older_than == 36500 * 86400
    assert parse(*RELAY, "--lease", longest).lease == 36500 * 86400


@pytest.mark.parametrize("ids", [[], ["--all", "7"]])
def test_outbox_retry_takes_ids_or_all_checked_before_connecting(
    ids: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    refused("outbox", "retry", "--dsn", "postgresql://u@db/app", *ids)
    err = capsys.readouterr().err
    # The command named once, by its parser (it read "outbox retry: error: outbox retry ...").
    last = err.strip().splitlines()[-1]
    assert (
        last
        == "grpc-idempotency outbox retry: error: give dead letter IDs or --all, one of the two"
    )
    # The subcommand's usage, not the top-level one's command list.
    assert err.startswith("usage: grpc-idempotency outbox retry ") and "COMMAND" not in err
    assert parse("outbox", "retry", "--all").all and parse("outbox", "retry", "7").ids == [7]


@pytest.mark.parametrize("name", ["relay-1\nrelay-1 stopped: delivered 0", "r\x1b[2J", "r\u202e1"])
def test_a_relay_name_that_would_split_or_disguise_its_lines_is_refused(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Printed bare in the relay's ready and stopped lines: a newline forged a line of its own."""
    refused(*RELAY, "--name", name)
    err = capsys.readouterr().err
    assert "--name: a relay name holds no control" in err and name not in err
    unsafe = next(char for char in name if not char.isprintable())
    assert f"holds U+{ord(unsafe):04X}" in err  # named by code point, not shown
    assert parse(*RELAY, "--name", "relay caf\u00e9:1").name == "relay caf\u00e9:1"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("relay\udcff", "a relay name is valid UTF-8, and this one is not: it holds U+DCFF"),
        ("r\x00", "a relay name holds no control, line-separator or format character, and"
         " this one holds U+0000"),
    ],
)  # fmt: skip
def test_a_relay_name_claimed_by_cannot_store_is_refused(
    name: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stored in claimed_by: PostgreSQL takes neither a lone surrogate (an argument that is not
    UTF-8) nor NUL (with the scopes' rule alone the surrogate was taken, and the relay failed
    on its first claim). Named by code point, as the other refused characters are."""
    refused(*RELAY, "--name", name)
    err = capsys.readouterr().err
    assert f"--name: {says}" in err and name not in err


@pytest.mark.parametrize(
    "header",
    [
        "authorization: Bearer s3cr3t-t0ken",  # ":" for "="
        "authorization: Bearer s3cr3t-t0ken==",  # ... and a base64 token's padding
        "authorization=Bearer s3cr3t-t0ken\n",
        "authorization=Bearer s3cr3t-t0k\u00e9n",
        "authorization-bin=s3cr3t-t0ken!",
        "authorization-bin=s3cr3t-t0k\u00e9n",  # not ASCII: b64decode's plain ValueError
    ],
)
def test_a_refused_header_is_not_echoed(header: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A delivery's header is how a relay authenticates to its receiver (authorization=Bearer
    ...): the error for a malformed one printed the whole argument, credential included, to
    stderr and so to the deploy's log. It says what is wrong without the value."""
    message = refused(*RELAY, "--header", header)
    printed = capsys.readouterr().err
    assert "--header" in printed
    for text in (message, printed):
        assert "s3cr3t" not in text and "t0k" not in text, text


SECRET_DSN = "postgresql://app:hunter22@db.internal:5432/shop"


@pytest.mark.parametrize(
    "argv",
    [
        ["list", "--scope", "s", "--dns", SECRET_DSN],  # a mistyped option
        ["list", "--scope", "s", SECRET_DSN],  # --dsn forgotten
        ["include-path", "--dsn", SECRET_DSN],  # a command that takes no --dsn
        ["export-protos", "out", f"--dsn={SECRET_DSN}"],
        [SECRET_DSN],  # no command: "invalid choice: '...'"
        ["purge", "--dsn", SECRET_DSN, "host=db password=hunter22"],  # keyword form
        # --OPTION=VALUE to an option whose type refuses it: argparse quotes the value alone
        ["migrate", f"--command-timeout={SECRET_DSN}"],
        ["migrate", f"--schema={SECRET_DSN}"],
        ["outbox", "dead", "--limit=host=db password=hunter22"],
    ],
)
def test_a_dsn_that_argparse_quotes_back_has_its_password_masked(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's "unrecognized arguments" and "invalid choice" errors quote the arguments they
    did not take: a DSN given to the wrong option, or without its option, printed its password
    to stderr, and so to a deploy's or CI's log."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    printed = capsys.readouterr().err
    assert "hunter22" not in printed, printed
    assert "***" in printed, printed  # the argument is still named, masked


@pytest.mark.parametrize(
    "scope, says",
    [
        ('"a\\u0000b"', "NUL"),  # PostgreSQL's text cannot hold one: exit 1, "retry later"
        ('""', "never empty"),  # was taken for no scope at all: the inspected one
        (f'"{"s" * 1025}"', "at most 1024 bytes"),  # no record can have it
    ],
    ids=["nul", "empty", "long"],
)
def test_a_config_scope_no_record_can_have_is_refused(
    tmp_path: Path, scope: str, says: str
) -> None:
    """``inspect --config``'s ``scope`` of a service, checked as ``--scope`` is: one holding a
    NUL was sent to the database with the child look-ups, and its refusal reported as the store
    being unavailable (exit 1, "retry later") for a configuration that can never work."""
    config = tmp_path / "inspect.toml"
    config.write_text(f'[services.a]\ndsn = "postgresql://u@db/app"\nscope = {scope}\n')
    args = parse("inspect", "--config", str(config), "--scope", "s", "k")
    with pytest.raises(ConfigError, match=says):
        config_of(args)


def test_stores_of_one_schema_are_named_by_where_they_connect() -> None:
    """Named as the log names a store (``dsn_where``): the user and password left out, and a
    host the DSN leaves to the driver said to be the default one, not left blank."""
    args = parse(
        "inspect",
        *("--dsn", "postgresql://u:s3cret@db:6432/app", "--dsn", "postgresql://u:s3cret@/app"),
        *("--scope", "s", "k"),
    )
    names = [store.name for store in config_of(args).stores]
    assert names == ["grpc_idempotency@db:6432/app", "grpc_idempotency@(default host)/app"], names


def _scope_taken(scope: str) -> bool:
    try:
        scope_text(scope)
    except argparse.ArgumentTypeError:
        return False
    return True


def test_scope_takes_exactly_the_scopes_the_server_takes() -> None:
    """``--scope`` (and a ``--config`` service's ``scope``) is ``validate_scope``'s rule: a
    scope the server refuses has no record (exit 2, not "no record"), and one it takes may have
    one, so is never refused. Every control, line-separator and format character (ZWNJ and
    ZWJ, which a server takes, among them), a NUL, a lone surrogate, the size bounds and
    ordinary text, each checked against ``scope_problem``."""
    unsafe_categories = {"Cc", "Cf", "Zl", "Zp"}
    special = [chr(c) for c in range(sys.maxunicode + 1) if c < 0xD800 or c > 0xDFFF]
    special = [c for c in special if unicodedata.category(c) in unsafe_categories]
    assert "\u200d" in special and "\u202e" in special and "\n" in special
    texts = [f"tenant:a{c}b" for c in [*special, "\ud800", " ", "\u00e9", "\U0001f469"]]
    texts += ["", "s" * 1024, "s" * 1025, "\u00e9" * 512, "\u00e9" * 512 + "s"]
    for text in texts:
        assert _scope_taken(text) == (scope_problem(text) is None), ascii(text)
    assert _scope_taken("t:\U0001f469\u200d\U0001f4bb")  # ZWJ: an emoji sequence
    assert not _scope_taken("tenant:a\u200bb")  # zero width space


def test_the_help_names_every_exit_status_the_readme_names() -> None:
    """The README's Operations section lists the exit statuses; ``--help`` left out 4 (inspect:
    a child key on more than one record) and 74 (the output could not be written), and a script
    author reading only the help took a 74 for an unknown failure."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    operations = readme.split("## Operations", 1)[1].split("**Migrations.**", 1)[0]
    helped = " ".join(_parser().format_help().split())
    for status in ("1", "2", "3", "4", "130", "143", "141", "74"):
        assert re.search(rf"\b{status}\b", operations), status
        assert re.search(rf"\b{status}\b", helped), status


def test_relay_step_selectors_are_checked_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--step`` takes ``Relay(steps=...)``'s selectors, repeated; a wrong one is bad usage
    (exit 2), as the relay would refuse it only once connected."""
    assert parse(*RELAY).steps is None  # every step
    assert parse(*RELAY, "--step", "receipt-email.v1", "--step", "order").steps == [
        "receipt-email.v1",
        "order",
    ]
    refused(*RELAY, "--step", "Receipt-Email")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("grpc-idempotency relay: error: argument --step: 'Receipt-Email' is")
    assert "steps:" not in err


def _b64url(doc: str) -> str:
    return base64.urlsafe_b64encode(doc.encode()).rstrip(b"=").decode()


def test_a_list_cursor_reads_back_the_instant_and_key_it_was_made_of() -> None:
    """Exact to the microsecond whatever time zone the record's time came in (the binary
    protocol's is UTC; another is the same instant), and whatever the key holds."""
    at = datetime(
        2026, 3, 29, 1, 59, 59, 999_999, tzinfo=timezone(timedelta(hours=-3, minutes=-30))
    )
    made = ListCursor.of(Listing("s"), at, 'k"é,\\ 1')
    assert parse("list", "--scope", "s", "--after", made.encode()).after == made


@pytest.mark.parametrize(
    "doc",
    [
        '["v","t","k","s","l"]',  # JSON holding the five names, but no object
        '{"v":2,"t":1,"k":"a","s":"0a1b2c3d","l":"0a1b2c3d","x":0}',
        '{"v":true,"t":1,"k":"a","s":"0a1b2c3d","l":"0a1b2c3d"}',
        '{"v":3,"t":1,"k":"a","s":"0a1b2c3d","l":"0a1b2c3d"}',  # another release's
        '{"v":1,"t":1,"k":"a"}',  # one without its listing, as none was released
        '{"v":2,"t":1,"k":"a"}',
        '{"v":2,"t":1.5,"k":"a","s":"0a1b2c3d","l":"0a1b2c3d"}',
        '{"v":2,"t":"1","k":"a","s":"0a1b2c3d","l":"0a1b2c3d"}',
        '{"v":2,"t":1,"k":5,"s":"0a1b2c3d","l":"0a1b2c3d"}',
        '{"v":2,"t":1,"k":"","s":"0a1b2c3d","l":"0a1b2c3d"}',
        '{"v":2,"t":1,"k":"\\ud800","s":"0a1b2c3d","l":"0a1b2c3d"}',  # a lone surrogate
        '{"v":2,"t":1,"k":"a","s":"0A1B2C3D","l":"0a1b2c3d"}',
        '{"v":2,"t":1,"k":"a","s":"0a1b2c3d","l":5}',
        '{"v":2,"t":1,"k":"a","s":5,"l":"0a1b2c3d"}',
        '{"v":2,"t":1,"k":"a","s":"0a1b2c3d","l":"0a1b2c"}',
        "[" * 100_000,  # past the JSON parser's depth
    ],
)
def test_a_list_cursor_list_never_printed_is_bad_usage(doc: str) -> None:
    """Refused before connecting (exit 2), saying what is wrong; sent, these failed as a
    database error to retry (exit 1), or were argparse's "invalid list_cursor value"."""
    error = refused("list", "--scope", "s", "--after", _b64url(doc))
    assert re.match(r"argument --after: (not a cursor|a cursor of another release)", error), error


@pytest.mark.parametrize(
    ("doc", "version"),
    [
        ('{"v":1,"t":1,"k":"a"}', 1),  # the first format: no listing digests
        ('{"v":3,"t":1,"k":"a","s":"0a1b2c3d","l":"0a1b2c3d"}', 3),
        ('{"v":3,"t":1,"k":"a","x":[]}', 3),  # another release's fields
    ],
)
def test_a_list_cursor_of_another_format_says_so_whatever_its_fields(
    doc: str, version: int
) -> None:
    """Its version is read before its fields: another release's hold others, and taken for
    no cursor it said "cut short or mistyped?" of one copied whole."""
    error = refused("list", "--scope", "s", "--after", _b64url(doc))
    assert f"argument --after: a cursor of another release (version {version})" in error, error


def test_a_list_cursor_pages_only_the_listing_that_printed_it() -> None:
    """Taken from ``--scope A --method M``, it paged ``--scope B`` (or A under another filter)
    from a place in another order, silently. Refused, saying whether the scope or the filters
    differ; the spellings --method takes of one method, and another --limit, are one listing."""
    made = ListCursor.of(Listing("A", method=POST_METHOD), T, "k").encode()

    def mismatch(*argv: str) -> str | None:
        return list_cursor_mismatch(parse("list", *argv, "--after", made))

    assert mismatch("--scope", "A", "--method", POST_METHOD) is None
    assert mismatch("--scope", "A", "--method", POST_METHOD.lstrip("/"), "--limit", "7") is None
    assert mismatch("--scope", "A", "--method", "testsvc.v1.LedgerService.Post") is None
    other_scope = mismatch("--scope", "B", "--method", POST_METHOD)
    assert other_scope is not None and "another scope's listing" in other_scope, other_scope
    for filters in [[], ["--state", "completed"], ["--method", "/testsvc.v1.LedgerService/Get"],
                    ["--method", POST_METHOD, "--state", "error"]]:  # fmt: skip
        differs = mismatch("--scope", "A", *filters)
        assert differs is not None and "other filters" in differs, (filters, differs)


POST_METHOD = "/testsvc.v1.LedgerService/Post"
T = datetime(2026, 1, 1, tzinfo=UTC)
