"""Chat templates: the jinja template a model ships, rendered in a sandbox exactly as transformers renders it.

`render_chat(template, messages, tools=None, add_generation_prompt=True,
special_tokens=..., **variables)` gives the prompt string transformers'
`apply_chat_template(..., tokenize=False)` gives for the same inputs: an
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls,
transformers' `tojson` (no HTML escaping), `raise_exception`, `strftime_now`, a
`namespace` that refuses underscore names, and the `{% generation %}` tag; the
messages with their None-valued keys dropped and reasoning under its aliases;
the model's special tokens (bos_token, eos_token, ...) as variables, which
`variables` (e.g. enable_thinking) may override. Templates are untrusted code:
nothing outside plain JSON data reaches them. A template that fails (a syntax
error, raise_exception) is a ChatTemplateError with the template's message.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat that the model's template refuses, or a template that does not compile."""


def _plain(value):
    """Plain JSON data only: what a sandboxed template may see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} ... {% endgeneration %}: marks assistant text; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template does not compile ({type(err).__name__}: {err})") from None


def _message(message: dict) -> dict:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(template: str, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **variables) -> str:
    """The prompt text for `messages` (see the module docstring)."""
    import jinja2

    if not messages:
        raise ChatTemplateError("the chat has no messages (expected at least one)")
    if not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("every message must be an object with a role and content")
    compiled = compile_template(template)
    chat = [_message(m) for m in _plain(list(messages))]
    context = {**_plain(special_tokens or {}), **_plain(variables)}
    try:
        return compiled.render(messages=chat, tools=_plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the model's chat template refused the chat: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:  # a template that trips on the data
        raise ChatTemplateError(f"the model's chat template failed on the chat ({type(err).__name__}: {err})") from None
