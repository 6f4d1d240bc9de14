"""A tiny random Qwen2 checkpoint whose chat template renders tools the way Qwen2.5 / Hermes do
(`<tools>` in the system turn, calls as `<tool_call>` JSON, results as `<tool_response>`)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizerBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}{% for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tool_checkpoint(directory: Path, generation_config: dict | None = None) -> Path:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', "the weather in Tokyo"]
    backend.train_from_iterator(corpus * 20, trainer)
    tok_file = directory / "tokenizer.json"
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(tok_file))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_file), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # plain added tokens, as in Qwen2.5
    tok.chat_template = TOOLS_TEMPLATE
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=1024,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    if generation_config is not None:
        import json

        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory
