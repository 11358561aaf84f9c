"""The hand-written array and interval literals read back exactly as the values they encode."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st

from pgreserve.db import literals as lit

HOSTILE = ['a', 'NULL', 'null', ' spaced ', 'q"uote', 'back\\slash', '\\"', '{brace}', 'a,b',
           "it's", 'ünïcødé ✓', '\t\n', '"', '\\', '{}', '{"x"}',
           'x)); DROP TABLE tenant; --']


def test_hostile_text_round_trips(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        got = conn.execute("SELECT %s::text[]", (lit.text_array(HOSTILE),)).fetchone()
        assert got is not None and got[0] == HOSTILE


def test_any_values_round_trip(dsn: str) -> None:
    """Any text (no NUL), any integer, any interval up to two days: exactly what was sent."""
    with psycopg.connect(dsn) as conn:

        @settings(max_examples=300, deadline=None, database=None)
        @given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00",
                                                       blacklist_categories=["Cs"]),
                                min_size=1), min_size=1, max_size=5),
               st.lists(st.integers(min_value=-2**31, max_value=2**31 - 1), min_size=1,
                        max_size=5),
               st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=2)))
        def round_trip(texts: list[str], ints: list[int], span: timedelta) -> None:
            row = conn.execute("SELECT %s::text[], %s::integer[], %s::interval",
                               (lit.text_array(texts), lit.int_array(ints),
                                lit.interval(span))).fetchone()
            assert row == (texts, ints, span)

        round_trip()
