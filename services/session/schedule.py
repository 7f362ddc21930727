"""When an automation's occurrences fall: cron expressions evaluated in an
IANA timezone (``cronsim`` over ``zoneinfo``, so DST gaps and repeats follow
cron's usual rules), and the catch-up rule after downtime.

Catch-up: an automation whose due occurrence passed while no scheduler ran
fires **once**, for the most recent occurrence that is due; the earlier
missed occurrences are dropped (coalesced), and the schedule continues with
the first occurrence after now. A one-time automation fires once, however
late.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from services.core.errors import InvalidArgument

__all__ = ["check_timezone", "check_expression", "next_occurrence", "due_occurrence"]


def check_timezone(name: str, param: str = "timezone") -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidArgument(f"unknown timezone {name!r}", param=param) from exc


def check_expression(expression: str, timezone: str, param: str = "expression") -> None:
    """A five-field cron expression that has an occurrence."""
    if len(expression.split()) != 5:
        raise InvalidArgument("expression must be a five-field cron expression", param=param)
    zone = check_timezone(timezone)
    try:
        next(CronSim(expression, datetime.now(zone)))
    except (CronSimError, StopIteration) as exc:
        raise InvalidArgument(f"invalid cron expression {expression!r}", param=param) from exc


def next_occurrence(expression: str, timezone: str, after: float) -> float:
    """The first occurrence strictly after ``after`` (Unix seconds)."""
    zone = ZoneInfo(timezone)
    return next(CronSim(expression, datetime.fromtimestamp(after, zone))).timestamp()


def due_occurrence(expression: str, timezone: str, next_run_at: float, now: float) -> tuple[float, float]:
    """For a periodic automation due at ``next_run_at <= now``: the occurrence
    to fire (the latest one at or before ``now``, by the catch-up rule) and
    the next occurrence after it."""
    zone = ZoneInfo(timezone)
    # Reverse iteration yields occurrences strictly before its start; cron
    # has minute resolution, so a second past now includes now itself.
    latest = next(CronSim(expression, datetime.fromtimestamp(now, zone) + timedelta(seconds=1), reverse=True)).timestamp()
    occurrence = max(latest, next_run_at)
    return occurrence, next_occurrence(expression, timezone, max(occurrence, now))
