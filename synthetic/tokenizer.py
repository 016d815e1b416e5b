"""A byte-level tokenizer with a chat template: every UTF-8 string round-trips, no files needed.

The embedded demo serves it, and synthetic models (`synthetic/models.py`) carry it by default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTES = 256

# Each turn is `<|role|>\n{content}` closed by the EOS token, so a model trained on this format
# (and the engine's stop condition) ends the assistant turn on the one id it already stops on.
# Role markers are plain text (bytes), not special tokens. Content may be a string or a list of
# OpenAI-style parts, whose text parts are joined.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def _byte_symbols() -> list[str]:
    """The printable character that stands for each byte value, indexed by byte.

    This is the byte-level BPE convention (GPT-2 and its descendants): bytes that are already
    printable, non-space characters keep their own code point; the rest are moved, in order, to
    code points from 256 up, so no symbol is whitespace or a control character.
    """
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    kept = set(keep)
    symbols: list[str] = []
    moved = 0
    for b in range(NUM_BYTES):
        if b in kept:
            symbols.append(chr(b))
        else:
            symbols.append(chr(NUM_BYTES + moved))
            moved += 1
    return symbols


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-255 are the bytes, 256-258 are `<|bos|>`, `<|eos|>`, `<|pad|>`.

    There are no merges, so every UTF-8 string encodes to its bytes and decodes back unchanged.
    Plain `encode` adds no special tokens; the chat template (`<|bos|>`, then `<|role|>\\n{content}
    <|eos|>` per message, then `<|assistant|>\\n` for a generation prompt) is where BOS comes from.
    The result saves with `save_pretrained` and loads back with `AutoTokenizer.from_pretrained`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space and no regex split: with no merges, splitting words would change nothing,
    # and a prefix space would break the round trip.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    ids = tokenizer.convert_tokens_to_ids([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    assert ids == [NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2], ids
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """`tokenizer.save_pretrained(out_dir)`, loadable by transformers 4 as well as 5.

    transformers 5 records its own class name, `TokenizersBackend`, which transformers 4 does not
    know; `PreTrainedTokenizerFast` names the same thing in both (as Llama 3's hub files do).
    """
    tokenizer.save_pretrained(out_dir)
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
