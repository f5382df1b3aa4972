"""How far a resharding rank reads ahead of a saved file in a bucket alone (``client.staged_ranges``)."""

from __future__ import annotations

from stowaway.client.staged_ranges import MAX_AHEAD_BYTES, MIN_AHEAD_BYTES, Readahead


def staged(ahead: Readahead, position: int, wanted: int) -> int:
    nbytes = ahead.next_size(position, wanted)
    ahead.keep(position, bytearray(nbytes))
    return nbytes


def test_a_sequential_reader_reads_ahead_twice_as_far_at_each_miss_up_to_the_most():
    ahead, position, sizes = Readahead(), 0, []
    for _ in range(12):
        sizes.append(staged(ahead, position, 100))
        position += sizes[-1]
    assert sizes[0] == 100 + MIN_AHEAD_BYTES
    assert sizes[1] == 100 + 2 * MIN_AHEAD_BYTES
    assert sizes[-1] == 100 + MAX_AHEAD_BYTES, "never more than the most ahead"


def test_a_jump_reads_ahead_the_least_again_and_the_last_two_windows_serve_reads():
    ahead = Readahead()
    first = staged(ahead, 0, 10)
    second = staged(ahead, first, 10)
    assert second > first
    assert ahead.find(first - 1) == (0, bytearray(first)), "a piece straddling two windows is served from both"
    assert ahead.find(first + second) is None
    assert staged(ahead, 50 * MAX_AHEAD_BYTES, 10) == 10 + MIN_AHEAD_BYTES, "a scattered read stages little"
    assert ahead.find(0) is None, "only the last two windows are kept"
