"""Tool-aware chat templates (Jinja) for the bundled and tiny backbones.

Hub backbones (Qwen3, Qwen3.6) ship their own templates; these two are for the tokenizers that do
not: the bundled SmolLM2 GGUF carries a plain ChatML template with no ``tools=`` support.

- ``QWEN3_TOOLS_TEMPLATE`` renders the Qwen3 / Hermes layout: tool signatures inside ``<tools>``
  in the system turn, each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  tool results grouped into one user turn of ``<tool_response>`` blocks.
- ``SMOLLM2_TOOLS_TEMPLATE`` renders SmolLM2's function-calling layout: the signatures as a JSON
  list inside ``<tools>``, all calls of a turn as one JSON list ``<tool_call>[{...}, ...]</tool_call>``,
  tool results as ``tool`` turns.

Both expect messages as produced by ``Message.to_chat()`` (arguments as dicts or JSON strings).
"""

from __future__ import annotations

# A call's arguments may arrive as a dict (our messages) or as a JSON string (OpenAI style).
_ARGS = "(fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson))"
_FN = "{%- set fn = call['function'] if call['function'] is defined else call -%}"

_SPLIT_SYSTEM = """\
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system_message = messages[0]['content'] -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_message = none -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
"""

QWEN3_TOOLS_TEMPLATE = (
    _SPLIT_SYSTEM
    + """\
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if system_message -%}{{- system_message + '\\n\\n' -}}{%- endif -%}
  {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
      'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
      '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif system_message is not none -%}
  {{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}
    {%- for call in (message['tool_calls'] or []) -%}
      """
    + _FN
    + """
      {%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' + """
    + _ARGS
    + """ + '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif message['role'] == 'tool' -%}
    {%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' -}}
    {%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOLS_TEMPLATE = (
    _SPLIT_SYSTEM
    + """\
{{- '<|im_start|>system\\n' + (system_message if system_message is not none else '"""
    + SMOLLM2_DEFAULT_SYSTEM
    + """') -}}
{%- if tools -%}
  {{- '\\n\\nYou have access to the following tools, given as a JSON list within <tools></tools> tags:\\n<tools>[' -}}
  {%- for tool in tools -%}
    {{- ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}
    {%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
  {%- endfor -%}
  {{- ']</tools>\\n\\nTo call tools, reply with only <tool_call>[{"name": "func_name", "arguments": '
      '{"arg": "value"}}, ... (more calls as required)]</tool_call>. Otherwise reply to the user in plain text.' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}
    {%- if message['tool_calls'] -%}
      {{- '<tool_call>[' -}}
      {%- for call in message['tool_calls'] -%}
        """
    + _FN
    + """
        {{- '{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + """
    + _ARGS
    + """ + '}' -}}
        {%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
      {%- endfor -%}
      {{- ']</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)

TEMPLATES = {"qwen3": QWEN3_TOOLS_TEMPLATE, "smollm2": SMOLLM2_TOOLS_TEMPLATE}
