"""SSE framing (`sse.py`), step by step and against a line-by-line reading of the SSE spec under every chunking."""

from __future__ import annotations

import random

import pytest

from basin_runtime.gateway.sse import Frame, SseFramer, event_data, is_comment

# Every line ending the spec allows, mixed: LF, CRLF, CR, a comment, a multi-line event, a `data` with no colon.
MIXED = (b'data: {"a": 1}\n\n'
         b'data: {"b": 2}\r\n\r\n'
         b'data: {"c": 3}\r\r'
         b": ping\n\n"
         b"event: x\r\ndata: line one\r\ndata:line two\n\r\n"
         b"data\n\n"
         b"data: [DONE]\r\n\r\n")


def spec_events(stream: bytes) -> list[bytes]:
    """The data of each event the SSE spec dispatches from the whole stream (independent of `sse.py`)."""
    events, data, is_pending, k = [], [], False, 0
    while True:
        ends = [i for i in (stream.find(b"\r", k), stream.find(b"\n", k)) if i >= 0]
        if not ends:
            return events  # an unfinished last line or event is dropped, as the spec says
        end = min(ends)
        line = stream[k:end]
        k = end + (2 if stream[end:end + 2] == b"\r\n" else 1)
        if not line:
            if is_pending:
                events.append(b"\n".join(data))
            data, is_pending = [], False
        elif not line.startswith(b":"):
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)
                is_pending = True


def frame_all(chunks: list[bytes], max_event_bytes: int = 1 << 20) -> tuple[list[Frame], bytes]:
    framer = SseFramer(max_event_bytes)
    frames = [frame for chunk in chunks for frame in framer.feed(chunk)]
    return frames, framer.rest()


def test_events_are_given_out_whole_byte_for_byte_under_each_line_ending() -> None:
    frames, rest = frame_all([MIXED])
    assert [f.data for f in frames] == [
        b'data: {"a": 1}\n\n', b'data: {"b": 2}\r\n\r\n', b'data: {"c": 3}\r\r', b": ping\n\n",
        b"event: x\r\ndata: line one\r\ndata:line two\n\r\n", b"data\n\n", b"data: [DONE]\r\n\r\n"]
    assert all(f.is_whole for f in frames) and rest == b""
    assert [event_data(f.data) for f in frames] == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', None,
                                                    b"line one\nline two", b"", b"[DONE]"]
    assert [is_comment(f.data) for f in frames] == [False, False, False, True, False, False, False]


def test_a_crlf_is_one_line_ending_even_split_across_chunks() -> None:
    framer = SseFramer(1 << 20)
    assert framer.feed(b"data: a\r") == []
    assert framer.feed(b"\ndata: b\r") == []  # `\r` `\n` is one line break, not a blank line
    assert framer.feed(b"\n\r\n") == [Frame(b"data: a\r\ndata: b\r\n\r\n", True)]
    assert framer.held_bytes == 0


@pytest.mark.parametrize("seed", range(30))
def test_any_chunking_gives_the_same_events_and_passes_every_byte_on(seed: int) -> None:
    rng = random.Random(seed)
    stream = MIXED * 3 + b"data: unfinished"
    cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 40)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    frames, rest = frame_all(chunks)

    assert b"".join(f.data for f in frames) + rest == stream
    assert rest.lstrip(b"\n") == b"data: unfinished"  # a CRLF cut after its CR leaves its LF to the next event
    dispatched = [d for f in frames if (d := event_data(f.data)) is not None]
    assert dispatched == spec_events(stream)


def test_every_two_way_split_gives_the_same_events() -> None:
    for cut in range(1, len(MIXED)):
        frames, rest = frame_all([MIXED[:cut], MIXED[cut:]])
        assert b"".join(f.data for f in frames) + rest == MIXED, cut
        assert [d for f in frames if (d := event_data(f.data)) is not None] == spec_events(MIXED), cut


def test_an_event_past_the_bound_is_passed_on_in_pieces_then_framing_goes_on() -> None:
    framer = SseFramer(max_event_bytes=100)
    big = b"data: " + b"x" * 1000 + b"\r\n\r\n"
    frames = []
    for k in range(0, len(big), 64):
        frames += framer.feed(big[k:k + 64])
        assert framer.held_bytes <= 100 + 64
    frames += framer.feed(b"data: next\n\n")

    assert b"".join(f.data for f in frames) == big + b"data: next\n\n"
    assert [f.is_whole for f in frames][-1] is True and frames[-1].data == b"data: next\n\n"
    assert not any(f.is_whole for f in frames[:-1])  # the big one is never handed out as parseable
    assert not framer.is_passing and framer.rest() == b""


def test_a_separator_split_across_pieces_of_an_oversized_event_ends_it() -> None:
    framer = SseFramer(max_event_bytes=10)
    frames = framer.feed(b"data: 0123456789abc\r\n")
    assert framer.is_passing and [f.is_whole for f in frames] == [False]
    frames += framer.feed(b"\r\ndata: after\n\n")
    assert b"".join(f.data for f in frames) == b"data: 0123456789abc\r\n\r\ndata: after\n\n"
    assert frames[-1] == Frame(b"data: after\n\n", True) and not framer.is_passing


def test_an_oversized_event_unfinished_at_the_end_leaves_nothing_held() -> None:
    framer = SseFramer(max_event_bytes=10)
    framer.feed(b"data: " + b"y" * 50)
    assert framer.is_passing and framer.held_bytes == 0 and framer.rest() == b""


def test_the_bound_must_leave_room_for_a_separator() -> None:
    with pytest.raises(ValueError, match="max_event_bytes"):
        SseFramer(3)
