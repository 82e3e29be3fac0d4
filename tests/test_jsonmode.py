"""JSON mode's parts: the JSON-prefix validator against json.loads, and pick_allowed's restricted distribution."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moetier.engine.generate import Sampling, pick_allowed
from moetier.serve.jsonmode import MAX_WHITESPACE, JsonPrefix

VALID = ['{}', ' {"a": 1}', '{"a": [1, 2.5e-3, -0, 1E+2, true, false, null, {"b": "x\\u00e9\\n\\"\\\\"}], "c": {}}\n',
         '{"é": "日本 🙂"}', '{"a":[[]],"b":[{}]}']
INVALID = ['[]', '1', '"a"', '{"a" 1}', '{"a": 01}', '{"a": -}', '{"a": 1.}', '{"a": tru}', '{"a": "\x01"}',
           '{"a": "\\x"}', '{}}', '{} x', '{"a": 1,}', '{,', '{"a": [1,]}', '{"a": 1e}', '{"a": "\\u12g4"}', '{"a":1]',
           "{'a': 1}", '{"a": nul}', '{"a": [}']


def _state(text: str | bytes):
    return JsonPrefix().advanced(text.encode() if isinstance(text, str) else text)


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_complete_and_every_prefix_is_valid(text):
    data = text.encode()
    assert _state(data).complete
    assert all(_state(data[:i]) is not None and not _state(data[:i]).complete for i in range(len(data.rstrip()) - 1))


@pytest.mark.parametrize("text", INVALID)
def test_invalid_text_is_refused_or_never_complete(text):
    state = _state(text)
    assert state is None or not state.complete


def test_the_validator_agrees_with_json_loads_on_random_text():
    rng = random.Random(0)
    alphabet = list('{}[]",:0123456789-+.eEtruefalsn \\u')
    complete = 0
    for _ in range(30000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        state = _state(text)
        try:
            parsed = isinstance(json.loads(text), dict)
        except json.JSONDecodeError as err:
            parsed = False
            prefix = err.pos >= len(text) or err.msg.startswith("Unterminated") or (
                err.msg.startswith("Invalid \\uXXXX") and err.pos + 6 > len(text))
            assert (state is not None) == prefix, (text, err.msg, err.pos)
        assert (state is not None and state.complete) == parsed, text
        complete += parsed
    assert complete > 30  # the random text made objects too, so both sides were compared


def test_utf8_inside_strings_and_whitespace_runs():
    assert _state(b'{"a": "\xc3') is not None and _state(b'{"a": "\xc3"') is None  # a character cut by the quote
    assert _state(b'{"a": "\xc3\xa9"}').complete and _state(b'{"a": "\xff"}') is None
    assert _state("{" + " " * MAX_WHITESPACE) is not None and _state("{" + " " * (MAX_WHITESPACE + 1)) is None
    assert _state('{"' + " " * 100 + '": 1}').complete  # inside a string, spaces are text


def test_pick_allowed_greedy_takes_the_largest_allowed_logit():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 4.0])
    assert pick_allowed(logits, Sampling(), None, [], lambda t: t != 1) == 3  # the lowest id of equals, as argmax
    assert pick_allowed(logits, Sampling(), None, [], lambda t: t in (0, 2)) == 2
    assert pick_allowed(logits, Sampling(), None, [], lambda t: False) is None
    penalised = Sampling(presence_penalty=2.0)
    assert pick_allowed(logits, penalised, None, [3], lambda t: t != 1) == 4


def test_pick_allowed_samples_the_restricted_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, 3.0])
    allowed = {1, 2, 3, 4}  # 0 and 5, the two likeliest, are never valid
    sampling = Sampling(temperature=0.8, seed=1)
    generator = torch.Generator().manual_seed(1)
    draws = 20000
    counts = torch.zeros(6)
    for _ in range(draws):
        counts[pick_allowed(logits, sampling, generator, [], allowed.__contains__)] += 1
    expected = torch.softmax(logits / 0.8 + torch.tensor([-1e9, 0, 0, 0, 0, -1e9]), dim=-1)
    assert counts[0] == counts[5] == 0
    assert torch.allclose(counts / draws, expected, atol=0.012), (counts / draws, expected)
    # top_p keeps only tokens 5 and 0 (p ~ 0.53 and 0.20): none allowed, so the draw is of the whole distribution restricted
    nucleus = Sampling(temperature=1.0, top_p=0.6, seed=2)
    picks = {pick_allowed(logits, nucleus, generator, [], allowed.__contains__) for _ in range(400)}
    assert picks <= allowed and len(picks) >= 3
    # a top_p whose nucleus holds an allowed token samples only the nucleus
    assert {pick_allowed(logits, nucleus, generator, [], {0, 2}.__contains__) for _ in range(200)} == {0}


def test_utf8_inside_strings_is_rfc_3629():
    for bad in (b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xc0\x80", b"\xf5"):
        assert _state(b'{"a": "' + bad) is None, bad  # overlong forms, surrogates, past U+10FFFF
    for good in ("\u0800", "\ud7ff", "\ue000", "\U00010000", "\U0010ffff"):
        assert _state('{"a": "' + good + '"}').complete
