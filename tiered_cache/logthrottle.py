"""Rate-limited log lines for what a client or a peer can repeat at will.

A server that writes a line for every bad frame lets anyone who reaches it fill the disk
and bury the lines that matter (the soak fuzzer measured more than one line per bad
frame). ``LogThrottle`` writes at most one line per key every ``every_s`` seconds; the
lines it holds back are counted, and the next line of that key says how many. Keys name
a kind of event (a refusal reason, an operation), never a client: their number stays
bounded whatever arrives.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable

LOG_EVERY_S = 60.0  # at most one line per key this often


class LogThrottle:
    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self._clock = clock
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (last line, held back)

    def log(
        self,
        key: Hashable,
        level: int,
        msg: str,
        *args: object,
        exc_info: bool = False,
    ) -> bool:
        """Log ``msg % args`` (on one line: newlines in it are folded) unless a line of
        ``key`` went out less than ``every_s`` ago; True when it was logged. With
        ``exc_info`` the line carries the traceback of the exception being handled."""
        now = self._clock()
        last, held = self._last.get(key, (-math.inf, 0))
        if now - last < self.every_s:
            self._last[key] = (last, held + 1)
            return False
        self._last[key] = (now, 0)
        text = (msg % args if args else msg).replace("\r", " ").replace("\n", " | ")
        more = f" ({held} more since the last such line)" if held else ""
        self.logger.log(level, "%s%s", text, more, exc_info=exc_info)
        return True
