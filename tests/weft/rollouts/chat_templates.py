"""Chat templates of the public formats, written here (no download), each rendering tools, native tool calls
and consecutive tool results. The assistant's own text (what the model writes, end-of-turn token included)
is wrapped in ``{% generation %}`` so that ``apply_chat_template(..., return_assistant_tokens_mask=True)``
gives an independent mask of the assistant tokens to compare samples against.

- ``CHATML_QWEN3``: Qwen3 style: tools in the system header, ``<tool_call>`` JSON blocks, consecutive tool
  results grouped in one user turn, thinking kept only for turns after the last user message. eot
  ``<|im_end|>``, then ``"\\n"``.
- ``LLAMA3``: Llama-3.1 style: header tokens, tools as JSON in the system turn, calls as
  ``{"name": ..., "parameters": ...}``, each tool result its own ``ipython`` turn, content trimmed. eot
  ``<|eot_id|>``, nothing after it; ``bos`` first.
- ``MISTRAL``: Mistral style: ``[AVAILABLE_TOOLS]`` up front, ``[INST]`` user turns, ``[TOOL_CALLS]`` with a
  JSON list, each result in ``[TOOL_RESULTS]``; the assistant text right after ``[/INST]``. eot ``</s>``.
- ``ADDED_TOKENS``: role markers that are added tokens (``[USER]`` ... ``[END]``), for WordPiece-like
  vocabularies. eot ``[END]``.
"""

CHATML_QWEN3 = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tc in message.tool_calls %}
                {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
                {%- if tc.function.arguments is string %}{{- tc.function.arguments }}
                {%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA3 = r"""
{{- bos_token }}
{%- set sys = messages[0].content | trim if messages[0].role == 'system' else '' %}
{%- if tools or sys %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if tools %}
        {{- 'Environment: ipython\nYou have access to the following functions:\n' }}
        {%- for t in tools %}{{- t | tojson + '\n' }}{%- endfor %}
    {%- endif %}
    {{- sys + '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- generation %}
        {%- if m.tool_calls %}
            {%- for tc in m.tool_calls %}
                {%- if not loop.first %}{{- '; ' }}{%- endif %}
                {{- '{"name": "' + tc.function.name + '", "parameters": ' }}
                {%- if tc.function.arguments is string %}{{- tc.function.arguments }}
                {%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
                {{- '}' }}
            {%- endfor %}
        {%- else %}
            {{- (m.content or '') | trim }}
        {%- endif %}
        {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- elif m.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
    {%- elif m.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL = r"""
{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {{- '[INST] ' + m.content + '\n\n' }}
    {%- elif m.role == 'user' %}
        {%- if loop.index0 == 1 and messages[0].role == 'system' %}{{- m.content + '[/INST]' }}
        {%- else %}{{- '[INST] ' + m.content + '[/INST]' }}{%- endif %}
    {%- elif m.role == 'assistant' %}
        {%- generation %}
        {%- if m.tool_calls %}
            {{- '[TOOL_CALLS] [' }}
            {%- for tc in m.tool_calls %}
                {%- if not loop.first %}{{- ', ' }}{%- endif %}
                {{- '{"name": "' + tc.function.name + '", "arguments": ' }}
                {%- if tc.function.arguments is string %}{{- tc.function.arguments }}
                {%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
                {{- ', "id": "' + tc.id + '"}' }}
            {%- endfor %}
            {{- ']' }}
        {%- else %}
            {{- m.content or '' }}
        {%- endif %}
        {{- eos_token }}
        {%- endgeneration %}
    {%- elif m.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + m.content | tojson + '}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

ADDED_TOKENS = r"""
{%- if tools %}{{- '[SYSTEM]tools: ' + tools | tojson + '[END]' }}{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {{- '[ASSISTANT]' }}
        {%- generation %}
        {{- m.content or '' }}
        {%- for tc in m.tool_calls or [] %}
            {{- '[CALL]' + tc.function.name + ' ' }}
            {%- if tc.function.arguments is string %}{{- tc.function.arguments }}
            {%- else %}{{- tc.function.arguments | tojson }}{%- endif %}
        {%- endfor %}
        {{- '[END]' }}
        {%- endgeneration %}
    {%- else %}
        {{- '[' + m.role | upper + ']' + m.content + '[END]' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '[ASSISTANT]' }}{%- endif %}
"""

# name: (template, eot / eos token, bos token)
TEMPLATES = {"chatml_qwen3": (CHATML_QWEN3, "<|im_end|>", None),
             "llama3": (LLAMA3, "<|eot_id|>", "<|begin_of_text|>"),
             "mistral": (MISTRAL, "</s>", "<s>"), "added_tokens": (ADDED_TOKENS, "[END]", None)}
