"""TextStream on the real GPT-2 tokenizer: stop sequences across token boundaries, multi-byte characters split
over tokens, chat's leading whitespace, and the tokens released with each piece of text."""
from __future__ import annotations

import pytest

from dtrain.node.config import DEFAULT_STATIC_DIR
from dtrain.node.serve import chat_template
from dtrain.node.serve.text import TextStream
from dtrain.node.tokenizer import load_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_STATIC_DIR)


def _run(tok, text: str, stop=(), strip=False):
    """Push the tokens of `text` one by one: (pieces released per push, the stream)."""
    stream = TextStream(lambda ids: tok.decode(list(ids)), stop, strip)
    pieces = []
    for token in tok.encode(text).ids:
        if stream.done:
            break
        pieces.append(stream.push(token))
    if not stream.done:
        pieces.append(stream.finish())
    return pieces, stream


def test_without_stops_every_token_is_released_at_once(tok):
    pieces, stream = _run(tok, "To be, or not to be")
    assert [p.text for p in pieces[:-1]] == [tok.decode([t]) for t in tok.encode("To be, or not to be").ids]
    assert stream.text == "To be, or not to be" and pieces[-1].text == ""
    assert all(len(p.tokens) == 1 for p in pieces[:-1])


def test_stop_sequence_spanning_tokens_ends_the_text_before_it(tok):
    pieces, stream = _run(tok, "Answer: 42\nUser: more please", stop=("\nUser:",))
    assert stream.text == "Answer: 42" and stream.done and pieces[-1].stopped
    assert "".join(p.text for p in pieces) == "Answer: 42"
    # the tokens released add up to the text released, and the newline's token is held back, never sent
    assert "".join(text for p in pieces for _, text in p.tokens) == "Answer: 42"


def test_a_suffix_that_may_start_a_stop_is_held_until_settled(tok):
    stream = TextStream(lambda ids: tok.decode(list(ids)), ("END",))
    released = [stream.push(t).text for t in tok.encode("The EN").ids]
    assert "".join(released) == "The "  # "EN" could become "END"
    assert stream.push(tok.encode("IGMA").ids[0]).text.startswith("EN")  # it did not


def test_multibyte_characters_split_over_tokens_are_never_sent_half(tok):
    text = "snow ❄ and 雪"
    pieces, stream = _run(tok, text)
    assert stream.text == text
    assert all("\ufffd" not in p.text for p in pieces)
    assert len(tok.encode("❄").ids) > 1  # the case under test: one character, several byte-level tokens


def test_chat_drops_the_leading_whitespace_of_the_reply(tok):
    pieces, stream = _run(tok, "  \n Four.\nUser: again", stop=chat_template.STOP, strip=True)
    assert stream.text == "Four." and pieces[-1].stopped


def test_chat_template_is_the_documented_text():
    prompt = chat_template.render([("system", "Be brief."), ("user", " What is 2+2? "), ("assistant", "4"),
                                   ("user", "And 3+3?")])
    assert prompt == "System: Be brief.\n\nUser: What is 2+2?\n\nAssistant: 4\n\nUser: And 3+3?\n\nAssistant:"
    with pytest.raises(chat_template.ChatTemplateError, match="role"):
        chat_template.render([("tool", "x")])
