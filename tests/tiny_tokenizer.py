"""A tiny tokenizer with a ChatML template that takes tools, built in the suite, so the public API
(SplitClient, conversations, the OpenAI endpoint, tools and JSON, the attested handshake) runs end to end on
a tiny random model without a packaged one.

Its tokens are the 128 ASCII bytes, byte-level as GPT-2 writes them, three special tokens and the two
tool-call tags, with no merges: whatever ids a random model picks decode to valid text, and that text
encodes back to the same ids (a text has one tokenization), as a trained model's answers do in practice.
Its template renders tools and asks for calls the way Qwen2.5's does (`<tool_call>` JSON
`</tool_call>`), which `api/tools.py` reads.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]  # one token each, as in Qwen2.5's vocabulary (a grammar names them)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and tools %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_char(b: int) -> str:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


VOCAB = len(SPECIALS) + len(TOOL_TAGS) + 128


def save_tiny_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and its config (the template above, `<|im_end|>` ends a turn) into `folder`."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *TOOL_TAGS, *map(_byte_char, range(128))])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(TOOL_TAGS)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=TEMPLATE).save_pretrained(folder)
