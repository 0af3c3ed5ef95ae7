"""Stop strings split across streamed pieces are caught; text that cannot start one is not held."""
import random

from lily_py.generation import StopMatcher


def run(pieces, stops):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_across_pieces():
    assert run(["Hello wo", "rld, END", "ING"], ["END"]) == ("Hello world, ", True)
    assert run(["a<", "|st", "op|>b"], ["<|stop|>"]) == ("a", True)


def test_earliest_stop_wins():
    assert run(["xx BB AA"], ["AA", "BB"]) == ("xx ", True)
    m = StopMatcher(["AA", "BB"])
    assert m.matched == "" and m.push("xx B") == ("xx ", False) and m.matched == ""
    assert m.push("B AA") == ("", True) and m.matched == "BB"     # which one: the earliest


def test_no_stop_returns_everything():
    assert run(["abc", "E", "N"], ["END"]) == ("abcEN", False)


def test_text_is_held_only_while_it_could_start_a_stop():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("x") == ("STx", False)


def test_random_split_points():
    rng = random.Random()
    text = "the quick brown fox jumps over the lazy dog" * 3
    for _ in range(200):
        stop = text[rng.randrange(10, 60):][:rng.randrange(1, 6)]
        cut = sorted(rng.sample(range(1, len(text)), 8))
        pieces = [text[a:b] for a, b in zip([0] + cut, cut + [len(text)])]
        assert run(pieces, [stop]) == (text[:text.find(stop)], True)
