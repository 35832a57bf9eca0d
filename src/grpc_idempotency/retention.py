"""Retention: delete records past retention in bounded batches, now or in the background.

Deleting is an optimisation, not a correctness need: a record past retention is already treated
as new by the claim (the database clock decides). Batches keep each DELETE short and walk the
``expires_at`` index in order (``Store.purge``); the DELETE re-checks retention and leases on any
row a concurrent takeover changed, so it never removes a record that an attempt wrote (a phased
claim, a completion). An atomic attempt at READ COMMITTED that takes over a record past
retention writes nothing until its completion: that record may be purged under it, and the
completion then inserts the record anew (migration 0009); the key stays the attempt's, under its
claim lock, meanwhile. A batch waits on a row another transaction holds for
``PURGE_LOCK_WAIT_S`` at most (store/postgres.py): past it, it is rolled back and redone
skipping locked rows, so that it never keeps the rows it already deleted, and the claims of
their keys, waiting behind an unrelated long transaction; a skipped row goes in a later run.
Several purgers (one per replica) may run: one that meets another's batch waits for it, finds
its rows gone, and ends its run (or, past that bound, skips them and goes on).
"""

from __future__ import annotations

import asyncio
import contextlib

from grpc_idempotency.core.errors import StoreUnavailable
from grpc_idempotency.core.seconds import checked_seconds
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.store.postgres import Store
from grpc_idempotency.store.shards import ShardedStores

log = library_logger("grpc_idempotency.retention")


class Purger:
    """A background task purging expired records every ``interval`` seconds, in batches of
    ``batch_size``, ``pause`` seconds apart (``Store.purge``).

    ``async with Purger(store):`` or ``start()`` / ``await stop()``. Given ``ShardedStores``, it
    purges every shard, each on a schedule of its own: a shard that cannot be reached (each of
    its statements waits out its timeout) or has a long backlog holds up no other. Shards on one
    database and schema (one ``Store`` under two names, or two ``Store``s connected to it, DSNs
    spelled alike or not) share one schedule.

    ``purged`` counts the records of every committed batch; ``stop()`` rolls back the batch
    under way, if any.

    A run that fails is tried again at the next interval: an outage (``StoreUnavailable``) is
    logged as a warning ("purge stopped after N rows" when batches of the run committed first,
    which stay purged; "purge skipped" when none did), anything else (a bug) as an error with
    its traceback; neither stops
    the purger, nor, sharded, another shard's schedule. A store the application closed
    (``Store.closed``) ends its schedule, with one warning: no later run could purge it.
    """

    def __init__(
        self,
        store: Store | ShardedStores,
        *,
        interval: float = 60.0,
        batch_size: int = 1000,
        pause: float = 0.0,
    ) -> None:
        # asyncio.sleep(nan) (or inf) never returns: the purger would stop after its first run,
        # silently, and the table grow without bound; 10**400 (below math.inf) raised
        # OverflowError after the first run, ending the purger's task unseen until stop().
        checked_seconds("interval", interval, positive=True)
        checked_seconds("pause", pause)
        # Checked here as Store.purge checks it: refused only at the first run, the error ended
        # the purger's task, unseen until stop(), and nothing was purged meanwhile.
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            # TypeError, as interval and pause above (and Store.purge's).
            raise TypeError(f"batch_size must be a whole number, not {batch_size!r}")
        if not 0 < batch_size <= 2**63 - 1:
            raise ValueError("batch_size must be positive and at most 2**63 - 1 (a bigint)")
        if not isinstance(store, Store | ShardedStores):
            # Else its task died at the first run (unseen until stop()), and nothing was purged.
            raise TypeError(f"Purger takes a Store or ShardedStores, not {type(store).__name__}")
        self.store = store
        self.interval = interval
        self.batch_size = batch_size
        self.pause = pause
        self.purged = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="purger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Purger:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        if not isinstance(self.store, ShardedStores):
            await self._purge_every_interval(self.store, "")
            return
        # One schedule per Store, not per name: two shards on one database (one Store under two
        # names) had two purges of one table side by side, each batch waiting on the rows the
        # other was deleting, and every outage said twice.
        names: dict[int, tuple[Store, list[str]]] = {}
        for name, store in self.store.shards.items():
            names.setdefault(id(store), (store, []))[1].append(name)
        # And one per database: two Stores connected to one database and schema (one per name,
        # from DSNs that need not be spelled alike) were two purges of one table all the same.
        # Which database a store reaches is known only by asking it, each run (a DSN's host may
        # move): the first schedule to name a database purges it while it runs, the others skip.
        owners: dict[tuple[object, ...], tuple[object, str]] | None = {} if len(names) > 1 else None
        async with asyncio.TaskGroup() as shards:
            for store, named in names.values():
                what = "shards" if len(named) > 1 else "shard"
                label = f"{what} {', '.join(map(repr, named))}"
                shards.create_task(self._purge_every_interval(store, f" on {label}", owners, label))

    async def _purge_every_interval(
        self,
        store: Store,
        where: str,
        owners: dict[tuple[object, ...], tuple[object, str]] | None = None,
        label: str = "",
    ) -> None:
        me = object()
        claimed: tuple[object, ...] | None = None
        told: str | None = None  # the schedule this one was last said to be left to
        try:
            while True:
                if owners is not None:
                    identity = await _identity_of(store)
                    if claimed is not None and claimed != identity:
                        del owners[claimed]  # its database moved: another schedule may take it
                        claimed = None
                    if identity is not None:
                        owner, owner_label = owners.setdefault(identity, (me, label))
                        if owner is not me:
                            if told != owner_label:
                                told = owner_label
                                log.info(
                                    "%s is purged by the schedule of %s: they are one database"
                                    " and schema",
                                    label,
                                    owner_label,
                                )
                            await asyncio.sleep(self.interval)
                            continue
                        claimed, told = identity, None
                if not await self._purge_once(store, where):
                    return
                await asyncio.sleep(self.interval)
        finally:
            # Ended (its store closed, or stopped): another schedule on its database takes over.
            if owners is not None and claimed is not None:
                del owners[claimed]

    async def _purge_once(self, store: Store, where: str) -> bool:
        """One run; ``False`` when no later run could purge (the store was closed)."""
        run = [0]  # this run's committed batches: the log of a run that fails says them

        def count(deleted: int, run: list[int] = run) -> None:
            self.purged += deleted
            run[0] += deleted

        try:
            # Counted per committed batch: a purge stopped midway left its committed batches
            # out of ``purged``.
            await store.purge(batch_size=self.batch_size, pause=self.pause, on_batch=count)
        except StoreUnavailable as err:
            if store.closed:
                # store.close() (a shutdown that closed the store before stopping the
                # purger): every later run failed alike, and said so every interval for as
                # long as the process lived. Sharded, the other shards' loops go on.
                log.warning(
                    "purger stopped%s: its store was closed (store.close()); stop the purger"
                    " first to end it quietly",
                    where,
                )
                return False
            if run[0]:
                # Its committed batches stay purged: "skipped" read as if nothing had gone.
                log.warning("purge stopped%s after %d rows: %s", where, run[0], err)
            else:
                log.warning("purge skipped%s: %s", where, err)
        except Exception:
            # No outage: a bug, or a driver's error the store does not map. Raised, it ended
            # this loop for good, unseen until stop() (sharded, the TaskGroup cancelled every
            # other shard's loop with it), and the table grew without bound. Deleting is
            # housekeeping a later run may well complete: said with its traceback, every
            # interval while it lasts. stop()'s cancellation is no Exception: it ends the loop.
            log.exception(
                "purge failed%s after %d rows; trying again in %gs",
                where,
                run[0],
                self.interval,
            )
        return True


async def _identity_of(store: Store) -> tuple[object, ...] | None:
    """The database and schema ``store`` reaches, or ``None`` when that cannot be told now (the
    store down or closed: its run then purges, or fails and says so, as it would alone)."""
    try:
        return await store.database_identity()
    except StoreUnavailable:
        return None
    except Exception:
        # Not worth a schedule: the run that follows meets the same trouble and says it.
        log.debug("could not identify a store's database", exc_info=True)
        return None
