"""configure_logging writes to sys.stderr as it is at each log call: a
logger set up while stderr was replaced (a test's capture, a notebook)
does not keep a stream that is closed later."""

from __future__ import annotations

import io
import sys

import structlog

from kvstrata.logs import configure_logging


def test_logs_follow_sys_stderr_after_it_is_replaced():
    saved_config, saved_stderr = structlog.get_config(), sys.stderr
    first, second = io.StringIO(), io.StringIO()
    try:
        sys.stderr = first
        configure_logging("WARNING", json=True)
        log = structlog.get_logger("kvstrata.test")
        log.warning("one")
        sys.stderr = second
        first.close()  # what a capture does when its test ends
        log.warning("two")
        log.info("below the level")
        assert '"event": "two"' in second.getvalue() and "below the level" not in second.getvalue()
    finally:
        sys.stderr = saved_stderr
        structlog.configure(**saved_config)


def test_logs_never_go_to_stdout_in_either_rendering(capsys):
    """stdout is the commands' output (`kvstrata run`'s report, `bench`'s
    JSON): log lines, JSON or console, go to stderr only."""
    saved_config = structlog.get_config()
    try:
        for json in (True, False):
            configure_logging("INFO", json=json)
            structlog.get_logger("kvstrata.test").info("engine_ready", pid=1)
            out, err = capsys.readouterr()
            assert out == "" and "engine_ready" in err
    finally:
        structlog.configure(**saved_config)
