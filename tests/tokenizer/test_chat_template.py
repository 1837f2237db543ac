"""Chat templates: fastllm renders the Qwen3 template exactly as transformers does, and says
clearly when there is no template or the template refuses the conversation."""

import shutil

import jinja2
import pytest
from tokenizer_util import GGUF, QWEN3, STORIES, hf_tokenizer, load, model_file

from fastllm.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi!"}],
    "system_user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語 please 😀"},
    ],
    "assistant_with_thinking": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "easy"},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
    "none_content_dropped": [{"role": "user", "content": "Hi", "name": None}],
}

VARIANTS = {
    "default": {},
    "no_generation_prompt": {"add_generation_prompt": False},
    "no_thinking": {"enable_thinking": False},
    "tools": {"tools": [WEATHER_TOOL]},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_qwen3_template_matches_hf(conversation, variant):
    ours, hf = load(QWEN3), hf_tokenizer(QWEN3)
    messages = CONVERSATIONS[conversation]
    kwargs = dict(VARIANTS[variant])
    add = kwargs.pop("add_generation_prompt", True)
    text = ours.apply_chat_template(messages, add_generation_prompt=add, **kwargs)
    expected = hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=False, **kwargs)
    assert text == expected
    ids = ours.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, **kwargs)
    assert ids == hf.encode(expected, add_special_tokens=False)
    assert ids[0] == ours.convert_tokens_to_ids("<|im_start|>")


def test_qwen3_generation_prompt_and_thinking_switch():
    ours = load(QWEN3)
    messages = CONVERSATIONS["user"]
    expected = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert ours.apply_chat_template(messages) == expected
    assert ours.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_template_variables_are_hf_ones():
    """The special tokens are template variables (bos_token, eos_token...), kwargs override
    them, ``raise_exception`` raises, and ``tojson`` keeps non-ASCII as it is."""
    ours = load(STORIES)
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}"
                "{{ eos_token }}{% endfor %}{{ extra | tojson }}"
                "{% if add_generation_prompt %}>{% endif %}")
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                    extra={"k": "é<>"})
    assert text == '<s>[user] hi</s>{"k": "é<>"}>'
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                    eos_token="<END>", extra=None, add_generation_prompt=False)
    assert text == "<s>[user] hi<END>null"
    refuse = ("{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}"
              "{% endif %}")
    with pytest.raises(jinja2.TemplateError, match="need a system turn"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=refuse)
    # trim_blocks / lstrip_blocks, loop controls and {% generation %} as HF's environment has them
    blocks = ("{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
              "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}")
    assert ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user",
                                                                         "content": "b"}],
                                    chat_template=blocks) == "a"


def test_template_sandbox():
    """Templates are untrusted code: no dunder access, no mutation of the inputs."""
    ours = load(STORIES)
    messages = [{"role": "user", "content": "x"}]
    for template in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            ours.apply_chat_template(messages, chat_template=template)
    assert messages == [{"role": "user", "content": "x"}]


def test_no_template_is_a_clear_error():
    for name in (STORIES, GGUF):  # neither file carries a chat template
        with pytest.raises(ValueError, match="no chat template"):
            load(name).apply_chat_template([{"role": "user", "content": "hi"}])


def test_empty_conversation_is_an_error():
    with pytest.raises(ValueError, match="empty conversation"):
        load(QWEN3).apply_chat_template([])


def test_named_templates_and_template_files(tmp_path):
    """tokenizer_config.json may hold named templates; chat_template.jinja next to it wins."""
    shutil.copy(model_file(STORIES) / "tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},'
        ' {"name": "tool_use", "template": "T{{ tools | length }}"}]}')
    tok = Tokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "Dx"
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == "T1"
    assert tok.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "T0"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == "J1"
