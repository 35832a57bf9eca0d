"""Which signals a command or a server may take over to stop cleanly."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable


def catchable(signals: Iterable[signal.Signals]) -> tuple[signal.Signals, ...]:
    """The signals of ``signals`` to install a stop handler for: none off the main thread
    (asyncio handles signals there only: ``add_signal_handler`` raised RuntimeError and the
    command never ran), and none the process inherited as ignored (``nohup`` ignores SIGHUP, a
    shell's background job SIGINT): taken over, they stopped what the user had shielded."""
    if threading.current_thread() is not threading.main_thread():
        return ()
    return tuple(s for s in signals if signal.getsignal(s) is not signal.SIG_IGN)
