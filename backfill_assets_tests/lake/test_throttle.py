"""The replay throttle splits a contract into exact, consecutive pieces."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from backfill_assets.errors import ReplayError
from backfill_assets.lake.offsets.contract import OffsetContract
from backfill_assets.lake.offsets.windows import Cell, Windows
from backfill_assets.lake.write.read import chunk_contract

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("max_records", [1, 7, 100, 1000, 10_000])
def test_pieces_cover_the_contract_exactly(max_records: int) -> None:
    contract = OffsetContract("t", T0, T0, {0: (10, 510), 1: (0, 0), 2: (300, 1337), 3: (5, 6)})
    pieces = chunk_contract(contract, max_records)
    assert all(0 < p.records <= max_records for p in pieces)
    assert sum(p.records for p in pieces) == contract.records
    for part, (start, end) in contract.ranges.items():
        cursor = start
        for piece in pieces:
            s, e = piece.ranges[part]
            assert s == cursor and e >= s
            cursor = e
        assert cursor == end


def test_pieces_of_a_windowed_contract_count_their_own_offsets() -> None:
    """A contract from the windows knows the whole range's committed records; a piece must not
    claim them (the throttle paced every chunk as if it held the whole range, 7x under its cap
    in bench/live_traffic.py)."""
    cells = {T0: {0: Cell(0, 600, records=590), 1: Cell(0, 400, records=400)}}
    windows = Windows("t", T0, T0, cells)
    contract = OffsetContract("t", T0, T0, windows.ranges, windows=windows)
    assert contract.records == 990
    pieces = chunk_contract(contract, 100)
    assert len(pieces) == 10
    assert all(p.windows is None and p.records == p.offsets == 100 for p in pieces)


def test_empty_contract_has_no_pieces_and_bad_sizes_are_refused() -> None:
    assert chunk_contract(OffsetContract("t", T0, T0, {0: (4, 4)}), 10) == []
    with pytest.raises(ReplayError, match="positive"):
        chunk_contract(OffsetContract("t", T0, T0, {0: (0, 4)}), 0)
