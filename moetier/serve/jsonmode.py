"""response_format {"type": "json_object"}: decoding constrained to text that stays a prefix of one JSON object.

`JsonPrefix` is an incremental validator, a state machine over bytes
(strings with escapes and \\uXXXX, UTF-8 sequences inside them, numbers,
true/false/null, nesting, whitespace); `advanced(data)` is the state after
more bytes, or None when no JSON object begins with the text so far. The top
level is one object; once it closes only whitespace may follow. Whitespace
outside strings comes in runs of at most MAX_WHITESPACE bytes (llama.cpp's
JSON grammar bounds it too), so a model cannot spend max_tokens on it. `JsonMode`
holds a generation's state and picks each token with
moetier.engine.generate.pick_allowed: the token the unconstrained pick would
take from the sampling distribution restricted to the tokens whose bytes keep
the text valid (greedy: the highest logit among them). A stop token is valid
only once the object is complete; other control tokens and empty ones never.
`string_step` and `number_step` are the lexer both this validator and the
schema-constrained one (moetier.serve.schemaprefix) read strings and numbers with.
Invariant: every prefix of the generated text is a prefix of a valid object,
and a generation that ends "stop" is one (json.loads reads it), unless a stop
string cut it.
"""

from __future__ import annotations

import torch

from moetier.engine.generate import Sampling, pick_allowed

WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrtu')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
MAX_WHITESPACE = 20  # bytes in a row outside strings

# modes: where the text is
START, VALUE, KEY_OR_END, KEY, COLON, VALUE_OR_END, AFTER, STRING, NUMBER, LITERAL, DONE = range(11)
# number sub-states: after "-", after a leading "0", in the integer's digits, after ".", in the fraction,
# after "e", after the exponent's sign, in the exponent
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(8)
NUMBER_ENDS = frozenset({N_ZERO, N_INT, N_FRAC, N_EXP})  # where a number may stop
# string sub-states: 0 plain text, 1-3 UTF-8 continuation bytes left, ESCAPED after a backslash, ESCAPED + d with
# d \\u hex digits left, then the UTF-8 leads whose next byte has a narrower range (no overlong form, no
# surrogate, nothing past U+10FFFF: RFC 3629); STRING_END: the byte was the closing quote
ESCAPED, STRING_END = 4, -1
NARROW = {0xE0: (9, 0xA0, 0xBF, 1), 0xED: (10, 0x80, 0x9F, 1), 0xF0: (11, 0x90, 0xBF, 2), 0xF4: (12, 0x80, 0x8F, 2)}
AFTER_LEAD = {state: (low, high, left) for state, low, high, left in NARROW.values()}


def string_step(state: int, b: int) -> int | None:
    """A string's sub-state after byte b (the opening quote read before), or None when b cannot come next."""
    if state == 0:
        if b == 0x22:  # "
            return STRING_END
        if b == 0x5C:  # backslash
            return ESCAPED
        if b < 0x20:
            return None
        if b < 0x80:
            return 0
        if b in NARROW:
            return NARROW[b][0]
        return 1 if 0xC2 <= b <= 0xDF else 2 if 0xE1 <= b <= 0xEF else 3 if 0xF1 <= b <= 0xF3 else None
    if state < ESCAPED:  # inside a UTF-8 sequence
        return state - 1 if 0x80 <= b <= 0xBF else None
    if state in AFTER_LEAD:
        low, high, left = AFTER_LEAD[state]
        return left if low <= b <= high else None
    if state == ESCAPED:
        return (ESCAPED + 4 if b == 0x75 else 0) if b in ESCAPES else None
    return (0 if state == ESCAPED + 1 else state - 1) if b in HEX else None


def number_step(state: int, b: int) -> int | None:
    """A number's sub-state after byte b, or None when b is no part of it."""
    digit = b in DIGITS
    if state == N_MINUS:
        return (N_ZERO if b == 0x30 else N_INT) if digit else None
    if state in (N_ZERO, N_INT):
        if digit:
            return N_INT if state == N_INT else None
        return N_DOT if b == 0x2E else N_E if b in (0x65, 0x45) else None
    if state in (N_DOT, N_FRAC):
        if digit:
            return N_FRAC
        return N_E if state == N_FRAC and b in (0x65, 0x45) else None
    if state == N_E:
        return N_EXP if digit else N_ESIGN if b in (0x2B, 0x2D) else None
    return N_EXP if digit else None  # N_ESIGN, N_EXP


class JsonPrefix:
    """One point of the text: immutable, so a token is tried on the state without copying it back."""

    __slots__ = ("mode", "stack", "aux", "key", "run")

    def __init__(self, mode: int = START, stack: str = "", aux=0, key: bool = False, run: int = 0):
        self.mode, self.stack, self.aux, self.key, self.run = mode, stack, aux, key, run  # run: whitespace bytes so far
        # aux: a number's sub-state, a literal's remaining bytes, or a string's sub-state

    @property
    def complete(self) -> bool:
        return self.mode == DONE

    finished = complete  # once the object closes, nothing but whitespace may follow

    def advanced(self, data: bytes) -> JsonPrefix | None:
        mode, stack, aux, key, run = self.mode, self.stack, self.aux, self.key, self.run
        for b in data:
            if mode == STRING:
                aux = string_step(aux, b)
                if aux is None:
                    return None
                if aux == STRING_END:
                    mode, aux = COLON if key else AFTER, 0
                continue
            if mode == LITERAL:
                if b != aux[0]:
                    return None
                aux = aux[1:]
                if not aux:
                    mode, aux = AFTER, 0
                continue
            if mode == NUMBER:
                step = number_step(aux, b)
                if step is not None:
                    aux = step
                    continue
                if aux not in NUMBER_ENDS:
                    return None
                mode, aux = AFTER, 0  # the byte ends the number: read it after the value
            if b in WHITESPACE:
                run += 1
                if run > MAX_WHITESPACE:
                    return None
                continue
            run = 0
            if mode == START:
                if b != 0x7B:  # the top level is an object
                    return None
                mode, stack = KEY_OR_END, "{"
            elif mode == KEY_OR_END and b == 0x7D or mode in (AFTER, VALUE_OR_END) and b in (0x7D, 0x5D):
                if not stack or stack[-1] != ("{" if b == 0x7D else "["):
                    return None
                stack = stack[:-1]
                mode = AFTER if stack else DONE
            elif mode in (KEY_OR_END, KEY):
                if b != 0x22:
                    return None
                mode, key = STRING, True
            elif mode == COLON:
                if b != 0x3A:
                    return None
                mode, key = VALUE, False
            elif mode == AFTER:
                if b != 0x2C:  # ,
                    return None
                mode = KEY if stack[-1] == "{" else VALUE
            elif mode in (VALUE, VALUE_OR_END):
                if b == 0x22:
                    mode, key = STRING, False
                elif b in (0x7B, 0x5B):
                    stack += "{" if b == 0x7B else "["
                    mode = KEY_OR_END if b == 0x7B else VALUE_OR_END
                elif b == 0x2D:
                    mode, aux = NUMBER, N_MINUS
                elif b in DIGITS:
                    mode, aux = NUMBER, N_ZERO if b == 0x30 else N_INT
                elif b in LITERALS:
                    mode, aux = LITERAL, LITERALS[b]
                else:
                    return None
            else:  # DONE: only whitespace may follow the object
                return None
        return JsonPrefix(mode, stack, aux, key, run)


class JsonMode:
    """A generation's JSON state over a tokenizer's token bytes (see the module docstring). `start`: the state
    before the first byte, JsonPrefix() or any state with the same interface (moetier.serve.schemaprefix:
    advanced, complete, finished)."""

    def __init__(self, pieces: list[bytes], stop_ids: frozenset[int], control_ids: frozenset[int], start=None,
                 what: str = "json_object"):
        self.pieces, self.stop_ids, self.what = pieces, stop_ids, what
        self.never = frozenset(i for i, p in enumerate(pieces) if not p or i in control_ids) - stop_ids
        # each id's first byte (256: none), so a step masks every token whose first byte cannot follow at once
        self.first = torch.tensor([p[0] if p else 256 for p in pieces], dtype=torch.int64)  # [V]
        self.state = start if start is not None else JsonPrefix()

    @property
    def complete(self) -> bool:
        return self.state.complete

    @property
    def finished(self) -> bool:
        """Complete, and no byte but whitespace may follow: the generation ends here."""
        return self.state.finished

    def allowed(self, token: int) -> bool:
        if token in self.stop_ids:
            return self.state.complete
        return token not in self.never and self.state.advanced(self.pieces[token]) is not None

    def candidates(self) -> torch.Tensor:
        """[V] bool: the ids whose first byte may follow (stop tokens when complete); a superset of the valid ids."""
        follows = torch.tensor([self.state.advanced(bytes([b])) is not None for b in range(256)] + [False])  # [257]
        mask = follows[self.first]  # [V]
        if self.state.complete:
            mask[list(self.stop_ids)] = True
        return mask

    def pick(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
             generated: list[int]) -> int:
        token = pick_allowed(logits, sampling, generator, generated, self.allowed, self.candidates())
        if token is None:
            raise ValueError(f"response_format {self.what}: no token of the vocabulary continues the JSON text")
        if token not in self.stop_ids:
            self.state = self.state.advanced(self.pieces[token])
        return token
