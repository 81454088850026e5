"""torch's own error output while the planner tries a model, moved to autoplan's debug log.

Why: capture and the probes run a model in ways expected to fail on some models (export with
data-dependent sizes, a sharded style on fake tensors) and catch the failure, which then becomes a
typed error or a note of the plan. torch writes each such failure out before raising it -- the
fake-tensor kernel failure as an ERROR with its traceback, the partial FX graph of a failed export
printed to stderr -- so planning one vision-language model wrote a megabyte of stderr the plan
itself had already said in a line. Inside :func:`quiet_torch`, records of torch's loggers below
CRITICAL and anything printed to ``sys.stderr`` go to this module's logger at DEBUG instead (so
``logging.DEBUG`` or ``autoplan -v`` still shows them); autoplan's own warnings pass unchanged.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading

__all__ = ["quiet_torch"]

log = logging.getLogger(__name__)
_lock = threading.Lock()
_depth = 0


class _TorchToDebug(logging.Filter):
    """Drop a torch record below CRITICAL from a handler, logging it here at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("torch") or record.levelno >= logging.CRITICAL:
            return True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s", record.name, record.getMessage(), exc_info=record.exc_info)
        return False


_FILTER = _TorchToDebug()


def _handlers() -> list[logging.Handler]:
    """The handlers a torch record can reach: those torch's logging gives its own loggers (which do
    not propagate), the root's and the last resort."""
    loggers = [lg for name, lg in list(logging.Logger.manager.loggerDict.items())
               if name.startswith("torch") and isinstance(lg, logging.Logger)]
    found = {id(h): h for lg in loggers + [logging.getLogger()] for h in lg.handlers}
    if logging.lastResort is not None:
        found[id(logging.lastResort)] = logging.lastResort
    return list(found.values())


@contextlib.contextmanager
def quiet_torch(prints: bool = False):
    """torch's log records go to the debug log for the duration of the block (re-entrant: only the
    outermost block installs and removes the filter); with ``prints``, whatever is printed to
    ``sys.stderr`` too -- only around a call where nothing but torch writes (``torch.export``), since
    autoplan's own warnings reach stderr through the same stream."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            for h in _handlers():
                if _FILTER not in h.filters:
                    h.addFilter(_FILTER)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed) if prints else contextlib.nullcontext():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for h in _handlers():
                    if _FILTER in h.filters:
                        h.removeFilter(_FILTER)
        text = printed.getvalue()
        if text:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("written to stderr while trying a model:\n%s", text)
