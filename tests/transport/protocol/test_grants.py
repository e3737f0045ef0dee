"""A granted round's landing check (`GrantedRound.refusal_of`) against a row-by-row reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from transport.protocol.landing import CLEARED_KEPT, GrantedRound


def granted_rows(blocks: tuple[int, ...], landing_offset: int, tokens: int, block_size: int) -> set[int]:
    """Every flat row the grant covers, one at a time."""
    return {
        blocks[t // block_size] * block_size + t % block_size
        for t in range(landing_offset, landing_offset + tokens)
    }


@st.composite
def grants(draw: st.DrawFn) -> GrantedRound:
    block_size = draw(st.integers(1, 8))
    blocks = tuple(draw(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True)))
    landing_offset = draw(st.integers(0, block_size - 1))
    tokens = draw(st.integers(0, len(blocks) * block_size - landing_offset))
    return GrantedRound(0, 0, tokens, blocks, landing_offset, block_size)


@settings(max_examples=300, deadline=None)
@given(grant=grants(), data=st.data())
def test_a_segment_list_passes_exactly_when_every_row_is_granted(
    grant: GrantedRound, data: st.DataObject
) -> None:
    rows_in_pool = 31 * grant.block_size
    segment = st.integers(0, rows_in_pool - 1).flatmap(
        lambda row: st.tuples(st.just(row), st.integers(1, rows_in_pool - row))
    )
    allowed = granted_rows(grant.blocks, grant.landing_offset, grant.tokens, grant.block_size)
    for _ in range(3):  # a few lists in a row, so remembered lists are checked too
        segments = data.draw(st.lists(segment, min_size=1, max_size=4))
        inside = all(row in allowed for start, rows in segments for row in range(start, start + rows))
        for _again in range(2):
            refusal = grant.refusal_of(segments)
            assert (refusal is None) == inside, (segments, refusal)
            if refusal is not None:
                assert refusal.startswith("round 0: bytes for rows ") and refusal.endswith(
                    ", which are not granted"
                )


def test_a_grant_remembers_its_last_cleared_lists_only() -> None:
    grant = GrantedRound(0, 0, 4 * (CLEARED_KEPT + 1), tuple(range(CLEARED_KEPT + 1)), 0, 4)
    lists = [[(4 * block, 4)] for block in range(CLEARED_KEPT + 1)]
    for segments in lists:
        assert grant.refusal_of(segments) is None
    assert grant.cleared == lists[:0:-1]
