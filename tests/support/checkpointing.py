"""Helpers of the checkpointing tests that compare llmmem with torch."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def torch_debug_logs_stay_with_torch():
    """torch's checkpoint debug mode logs every operator to ``logging.getLogger("LoggingTensor")``
    with records that only its own handler can format. Once torch has made that logger
    non-propagating, pytest (>= 8) attaches its capture handler to it for every test, and that
    handler raises on such a record, inside the checkpointed forward. Detached for the block."""
    logger = logging.getLogger("LoggingTensor")
    foreign = [h for h in logger.handlers if type(h).__module__.startswith("_pytest")]
    for h in foreign:
        logger.removeHandler(h)
    try:
        yield
    finally:
        for h in foreign:
            logger.addHandler(h)
