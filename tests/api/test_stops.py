"""Stop strings, unit level: the matcher (api/stops.py) and one output's text (door.OutputText).

Every expectation is exact: the text released at each feed, what is held back, the
string matched and the tokens kept.
"""

from __future__ import annotations

import pytest

from pddgw.api.door import OutputText
from pddgw.api.errors import ApiError
from pddgw.api.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher, parse_stop
from pddgw.engines.tokenizer import ByteTokenizer


def feed_all(m: StopMatcher, pieces: list[str]) -> list[str]:
    return [m.feed(p) for p in pieces]


def test_a_stop_spanning_pieces_is_found_and_its_head_was_held_back():
    m = StopMatcher(("STOP",))
    assert feed_all(m, ["abc S", "T", "Ox", "P!S"]) == ["abc ", "", "STOx", "P!"]
    # "S", "ST" could start STOP (held); "STOx" cannot (released); the last "S" is held to the end.
    assert m.matched is None and m.held == 1 and m.flush() == "S" and m.held == 0
    m = StopMatcher(("STOP",))
    assert feed_all(m, ["abc S", "T", "O", "P tail"]) == ["abc ", "", "", ""]
    assert m.matched == "STOP" and m.feed("more") == "" and m.flush() == ""


def test_include_stop_str_in_output_releases_through_the_stop_and_holds_nothing():
    m = StopMatcher(("STOP",), include=True)
    assert feed_all(m, ["abc S", "T", "OP tail", "x"]) == ["abc S", "T", "OP", ""]
    assert m.matched == "STOP"


def test_a_stop_at_the_very_first_characters():
    m = StopMatcher(("ab",))
    assert m.feed("abc") == "" and m.matched == "ab"
    m = StopMatcher(("ab",), include=True)
    assert m.feed("a") == "a" and m.feed("bcd") == "b" and m.matched == "ab"


def test_several_stops_the_first_complete_one_wins_whatever_the_list_order():
    # "b" completes before "xyz" (earlier end), though listed after it.
    m = StopMatcher(("xyz", "b"))
    assert m.feed("axyb") == "axy" and m.matched == "b"
    m = StopMatcher(("xyz", "b"))
    assert m.feed("axyzb") == "a" and m.matched == "xyz"
    # Both end at the same character: the longer one (starting first) is cut.
    m = StopMatcher(("c", "bc"))
    assert m.feed("abcd") == "a" and m.matched == "bc"


def test_hold_back_is_the_longest_suffix_that_could_start_a_stop():
    m = StopMatcher(("abcd", "xx"))
    assert m.feed("zab") == "z" and m.held == 2         # "ab" could start "abcd"
    assert m.feed("c") == "" and m.held == 3            # "abc"
    assert m.feed("x") == "abc" and m.held == 1         # "abcx" cannot; "x" could start "xx"
    assert m.feed("y") == "xy" and m.held == 0
    assert m.flush() == ""


@pytest.mark.parametrize("stops,include", [(("ab",), False), (("abc", "ca", "b b"), False),
                                           (("abc", "ca"), True), (("zz",), False)])
def test_the_cut_depends_on_the_text_alone_not_on_its_pieces(stops, include):
    text = "xxab cab b abcaxx"

    def run(pieces: list[str]) -> tuple[str, str | None]:
        m = StopMatcher(stops, include)
        out = "".join(m.feed(p) for p in pieces)
        return out + m.flush(), m.matched

    whole = run([text])
    assert run(list(text)) == whole
    assert run([text[i:i + 3] for i in range(0, len(text), 3)]) == whole
    assert run([text[:5], text[5:6], text[6:]]) == whole
    # And it is the first complete occurrence of any stop.
    ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if ends:
        end, start, s = min(ends)
        assert whole == (text[:end] if include else text[:start], s)
    else:
        assert whole == (text, None)


def test_unchecked_text_never_matches_but_a_stop_completed_later_does():
    m = StopMatcher(("ab",))
    assert m.feed("xab", check=False) == "xab" and m.matched is None    # wholly inside unchecked text
    assert m.feed("a", check=False) == "" and m.feed("b") == "" and m.matched == "ab"


def test_parse_stop():
    assert parse_stop(None) == () and parse_stop("x") == ("x",) and parse_stop([]) == ()
    assert parse_stop(["a", "b", "a"]) == ("a", "b")
    assert len(parse_stop(["s"] * MAX_STOPS)) == 1 and len(parse_stop([str(i) for i in range(MAX_STOPS)])) == 16
    for bad, msg in [(["a"] * (MAX_STOPS + 1), "at most 16 strings"), (3, "at most 16 strings"),
                     ([""], "'stop[0]' must be a non-empty string"), ("x" * (MAX_STOP_CHARS + 1), "'stop' must be"),
                     (["a", None], "'stop[1]'")]:
        with pytest.raises(ApiError) as ei:
            parse_stop(bad)
        assert ei.value.param == "stop" and msg in str(ei.value), (bad, str(ei.value))


def tok_ids(tok: ByteTokenizer, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text))


def test_output_text_cuts_at_the_token_a_stop_completes_and_counts_the_tokens_kept():
    tok = ByteTokenizer()
    ids = tok_ids(tok, "hello world, bye")
    ot = OutputText(tok, ("o w",))
    # One run of all tokens: the stop completes at the 'w' (token 6), tokens 0..6 are kept.
    text, kept = ot.push(ids)
    assert (text, kept, ot.stop, ot.ids) == ("hell", 7, "o w", list(ids[:7]))
    assert ot.end() == "" and ot.text == "hell"
    # The same tokens in runs of any size: the same cut and count.
    ot = OutputText(tok, ("o w",))
    pieces = [ot.push(ids[i:i + 2]) for i in range(0, 8, 2)]
    assert pieces == [("he", 2), ("ll", 2), ("", 2), ("", 1)]       # "o " held: it could start "o w"
    assert (ot.text, len(ot.ids)) == ("hell", 7)


def test_output_text_min_tokens_and_the_held_end_of_an_unstopped_output():
    tok = ByteTokenizer()
    ids = tok_ids(tok, "abab")
    ot = OutputText(tok, ("ab",), min_tokens=2)     # tokens 1, 2 are not checked: "ab" there is ignored
    assert ot.push(ids) == ("ab", 4) and ot.stop == "ab" and ot.text == "ab"
    ot = OutputText(tok, ("abc",))
    assert ot.push(ids) == ("ab", 4) and ot.stop is None
    assert ot.end() == "ab" and ot.text == "abab"      # the held "ab" once no more tokens come
