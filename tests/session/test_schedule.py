"""Occurrences of cron expressions in a timezone, and the catch-up rule."""

from __future__ import annotations

from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest

from services.core.errors import InvalidArgument
from services.session.schedule import check_expression, check_timezone, due_occurrence, next_occurrence


def ts(text: str, zone: str = "UTC") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp()


def test_an_expression_is_read_in_its_timezone_across_a_dst_change() -> None:
    # 09:00 in Paris is 08:00 UTC in winter and 07:00 UTC after the spring change.
    assert next_occurrence("0 9 * * *", "Europe/Paris", ts("2026-03-28 12:00")) == ts("2026-03-29 07:00")
    assert next_occurrence("0 9 * * *", "Europe/Paris", ts("2026-03-27 12:00")) == ts("2026-03-28 08:00")


def test_the_next_occurrence_is_strictly_after_the_given_time() -> None:
    assert next_occurrence("* * * * *", "UTC", ts("2026-01-01 00:01")) == ts("2026-01-01 00:02")


def test_missed_occurrences_coalesce_into_the_latest_due_one() -> None:
    occurrence, following = due_occurrence("*/5 * * * *", "UTC", ts("2026-01-01 00:05"), ts("2026-01-01 01:07:30"))
    assert (occurrence, following) == (ts("2026-01-01 01:05"), ts("2026-01-01 01:10"))


def test_an_occurrence_due_exactly_now_fires_now() -> None:
    now = ts("2026-01-01 00:05")
    assert due_occurrence("*/5 * * * *", "UTC", now, now) == (now, ts("2026-01-01 00:10"))


@pytest.mark.parametrize("expression", ["61 * * * *", "* * * *", "* * * * * *", "@reboot", "0 0 31 2 *"])
def test_an_expression_without_occurrences_or_five_fields_is_refused(expression: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_expression(expression, "UTC")
    assert raised.value.param == "expression"


def test_an_unknown_timezone_is_refused() -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_timezone("Mars/Olympus")
    assert raised.value.param == "timezone"
    assert check_timezone("UTC").utcoffset(datetime.now(timezone.utc)) is not None
