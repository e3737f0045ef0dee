"""Chat templates render byte for byte as transformers' `apply_chat_template(..., tokenize=False)`.

Real templates written out here (Llama 3.1/3.2's, with `raise_exception`, `strftime_now` and `tojson`;
Qwen2.5's, with tools), each on several conversations, with and without the generation prompt.
SmolLM2's, read from its GGUF file, is checked in test_smollm2.py against transformers' own tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replicas.model import ChatTemplate, ChatTemplateError, CheckpointError, checkpoint_chat_template

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN2_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TEMPLATES = {
    "llama3": (LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2": (QWEN2_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — «météo»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich, 東京"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system-user": [
        {"role": "system", "content": "  You answer briefly.\n"},
        {"role": "user", "content": "Name a prime number."},
    ],
    "multi-turn": [
        {"role": "system", "content": "You are a translator."},
        {"role": "user", "content": "Translate 'good morning' to French."},
        {"role": "assistant", "content": "Bonjour."},
        {"role": "user", "content": "And to Japanese? 🌅 \t "},
    ],
    "unicode-and-markup": [
        {"role": "user", "content": 'Quote: "<b>café</b>" & {{ not a template }} — 你好, мир, مرحبا'},
        {"role": "assistant", "content": "Noted.", "name": None},
        {"role": "user", "content": "\n\n  indented\n\tline  \n"},
    ],
    "tool-call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": '{"temperature": 21, "unit": "°C"}'},
    ],
}


@pytest.fixture(scope="module")
def transformers_tokenizers() -> dict[str, Any]:
    """Per template, a transformers tokenizer with its special tokens, to call `apply_chat_template` on
    (the vocabulary plays no part in rendering)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return {
        name: PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), **special
        )
        for name, (_, special) in TEMPLATES.items()
    }


def reference(tokenizer: Any, template: str, messages: Any, **kwargs: Any) -> str:
    rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_is_byte_identical_to_apply_chat_template(
    name: str, conversation: str, generation_prompt: bool, transformers_tokenizers: dict[str, Any]
) -> None:
    template, special = TEMPLATES[name]
    messages = CONVERSATIONS[conversation]
    want = reference(
        transformers_tokenizers[name], template, messages, add_generation_prompt=generation_prompt
    )
    got = ChatTemplate(template, special_tokens=special).render(
        messages, add_generation_prompt=generation_prompt
    )
    assert got.encode() == want.encode()


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tools_and_extra_variables_render_like_apply_chat_template(
    name: str, transformers_tokenizers: dict[str, Any]
) -> None:
    template, special = TEMPLATES[name]
    messages = CONVERSATIONS["system-user"]
    for kwargs in (
        {"tools": [WEATHER_TOOL]},
        {"tools": [WEATHER_TOOL], "tools_in_user_message": False, "date_string": "01 Jan 2025"},
    ):
        want = reference(
            transformers_tokenizers[name], template, messages, add_generation_prompt=True, **kwargs
        )
        got = ChatTemplate(template, special_tokens=special).render(
            messages, add_generation_prompt=True, **kwargs
        )
        assert got.encode() == want.encode()
        assert "get_weather" in got


def test_raise_exception_is_a_chat_template_error_with_the_templates_message(
    transformers_tokenizers: dict[str, Any],
) -> None:
    import jinja2

    template, special = TEMPLATES["llama3"]
    two_calls = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "tool_calls": [TOOL_CALL, TOOL_CALL]},
    ]
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        reference(transformers_tokenizers["llama3"], template, two_calls)
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls at once"):
        ChatTemplate(template, special_tokens=special).render(two_calls)


def test_templates_are_sandboxed_and_bad_ones_refused_with_the_file_named(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"unsafe|access"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate("{{ messages }}").render([])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json.*not a valid Jinja template"):
        checkpoint_chat_template(tmp_path)


def test_checkpoint_template_sources(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert checkpoint_chat_template(tmp_path) is None
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = checkpoint_chat_template(tmp_path)
    assert template is not None and template.render(messages) == "<s>hi</s>"
    (tmp_path / "chat_template.jinja").write_text(
        "{% generation %}[{{ messages | length }}]{% endgeneration %}"
    )
    template = checkpoint_chat_template(tmp_path)
    assert template is not None and template.render(messages) == "[1]"
