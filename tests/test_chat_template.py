"""Chat templates: the prompt string equals transformers' apply_chat_template for the same template and chat.

A ChatML template (the synthetic model's, Qwen2.5's layout with Hermes tools) and a GLM-style one, with and without a
system message, tools, tool calls and results, reasoning, add_generation_prompt on and off, enable_thinking. The
sandbox holds: a template cannot reach Python internals, and raise_exception is a ChatTemplateError.
"""

from __future__ import annotations

import pytest

from chat_templates import CHATS, GLM_STYLE, TOOLS
from moetier.model.chat_template import ChatTemplateError, render_chat
from moetier.model.synth_tokenizer import CHATML_TEMPLATE
from moetier.model.tokenizer import load_tokenizer
from tokenizer_files import text_model

TEMPLATES = {"chatml": CHATML_TEMPLATE, "glm": GLM_STYLE}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_prompt_equals_transformers(template, chat, folder, reference):
    tokenizer = load_tokenizer(folder)
    for add_generation_prompt in (True, False):
        for tools in (None, TOOLS):
            for variables in ({}, {"enable_thinking": False}):
                ours = render_chat(TEMPLATES[template], CHATS[chat], tools=tools, add_generation_prompt=add_generation_prompt,
                                   special_tokens=tokenizer.specials.template_tokens, **variables)
                theirs = reference.apply_chat_template(CHATS[chat], tools=tools, tokenize=False, chat_template=TEMPLATES[template],
                                                       add_generation_prompt=add_generation_prompt, **variables)
                assert ours == theirs
    ids = reference.apply_chat_template(CHATS[chat], tokenize=True, chat_template=TEMPLATES[template], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    rendered = render_chat(TEMPLATES[template], CHATS[chat], special_tokens=tokenizer.specials.template_tokens)
    assert tokenizer.encode(rendered) == list(ids)


def test_the_synthetic_model_ships_its_template(folder):
    tokenizer = load_tokenizer(folder)
    prompt = render_chat(tokenizer.chat_template(), CHATS["system and user"])
    assert prompt.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")


def test_the_sandbox_and_the_template_s_own_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", CHATS["one user turn"])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", CHATS["one user turn"])
    with pytest.raises(ChatTemplateError):
        render_chat("{% set ns = namespace(_x=1) %}", CHATS["one user turn"])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", CHATS["one user turn"])
    with pytest.raises(ChatTemplateError, match="no messages"):
        render_chat(CHATML_TEMPLATE, [])
