"""`TextStream`, one request's streamed text: stop strings held back while ambiguous and released when they are not,
never emitted when they are, and everything held back (a stop-string prefix, an unfinished UTF-8 character) released
at the end."""
import pytest
from mini_infer.engine.outputs import TextStream


class CharTok:
    "Token id = Unicode code point."
    def decode(self, ids, skip_special_tokens=True): return "".join(map(chr, ids))


class ByteTok:
    "Token id = one UTF-8 byte, so a character can take several tokens."
    def decode(self, ids, skip_special_tokens=True): return bytes(ids).decode("utf-8", errors="replace")


def feed(stream, ids):
    return [stream.add([i]) for i in ids]


def test_held_back_prefix_is_released_when_it_cannot_become_a_stop():
    text = "1, 2, 3, 4, 5, 6"
    ts = TextStream(CharTok(), stop=["4, X"])
    deltas = feed(ts, map(ord, text))
    assert "".join(deltas) == text and not ts.stopped          # released as soon as "5" rules "4, X" out, not only at the end
    assert deltas[text.index("4"):text.index("5")] == ["", "", ""]  # "4", ",", " " waited
    assert ts.flush() == ""


def test_stop_string_in_pieces_is_cut_and_never_sent():
    ts = TextStream(CharTok(), stop=["###", "zz"])
    deltas = feed(ts, map(ord, "Hi #there ##! ### never"))
    assert ts.stopped and "".join(deltas) + ts.flush() == "Hi #there ##! "
    assert all("###" not in d for d in deltas)
    assert ts.add([ord("x")]) == ""                             # nothing after the stop


def test_earliest_of_several_stop_strings_wins():
    ts = TextStream(CharTok(), stop=["cd", "b"])
    assert "".join(feed(ts, map(ord, "abcd"))) == "a" and ts.stopped


def test_flush_releases_a_pending_stop_prefix():
    "A request that ends (max_tokens) while its tail could still grow into a stop string gets that tail."
    ts = TextStream(CharTok(), stop=["###"])
    deltas = feed(ts, map(ord, "abc ##"))
    assert "".join(deltas) == "abc " and ts.flush() == "##"


def test_flush_releases_an_unfinished_character():
    "A request that ends in the middle of a multi-byte character ends with what decoding all its tokens gives."
    ids = list("ab é".encode())[:-1]
    ts = TextStream(ByteTok())
    deltas = feed(ts, ids)
    assert "".join(deltas) == "ab "                              # the half character is held back while streaming
    assert "".join(deltas) + ts.flush() == ByteTok().decode(ids) == "ab \ufffd"


def test_multibyte_characters_stream_whole():
    text = "né 👋🏽 世界"
    ts = TextStream(ByteTok())
    deltas = feed(ts, text.encode())
    assert "".join(deltas) + ts.flush() == text and all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text,stop,want", [("aXbXc", ["Xc"], "aXb"), ("abab", ["bab"], "a"), ("aaa", ["aa"], "")])
def test_overlapping_stops(text, stop, want):
    ts = TextStream(CharTok(), stop=stop)
    assert "".join(feed(ts, map(ord, text))) + ts.flush() == want and ts.stopped
