"""A tokenizer trained on one world's own text: the micro backbone's (issue 42), no download.

A model of a few million parameters learns on 2 CPU cores only if its episodes are short and its vocabulary small
(the LM head of a 49,152-token vocabulary alone costs three times a 4.5M-parameter body per token). So the micro
backbone's tokenizer is a byte-level BPE trained on the rendered gold episodes of its world:

- pre-tokenization splits at every newline (kept with its line), isolates every digit and every *atom* (the words
  the world's requests vary in: the micro world's item names). A line that recurs (the policy, each tool schema, a
  tool-call frame) becomes one token; an id or a value is always its digits one by one, and a name always its one
  token, so copying ``k42`` or ``fig`` from the user or a tool result is copying the same tokens wherever they are;
- the chat template's markers are special tokens at the ids the SmolLM2 tokenizer gives them (``<|endoftext|>`` 0,
  ``<|im_start|>`` 1, ``<|im_end|>`` 2, also the pad token: :data:`SPECIAL_TOKENS`), so no text merges across a turn
  boundary and the prompt / completion split of a training row tokenizes as the whole conversation does.

Training is deterministic: the same texts and vocabulary size give the same merges (``tokenizers``' BPE trainer
breaks frequency ties by the pair's bytes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# bump when the pre-tokenization or training rules change: every world tokenizer, and every warm start trained with
# one, gets a new cache key (splitting an id's letter prefix off its digits was tried and dropped: VARIANTS.md v9)
TOKENIZER_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (bos 1, eos 2, pad 2 as SmolLM2's)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the special tokens, before any merge


def train_world_tokenizer(texts: Iterable[str], vocab_size: int, chat_template: str,
                          atoms: Iterable[str] = ()) -> Any:
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` with at most ``vocab_size`` tokens (fewer when the
    texts run out of pairs to merge), with ``chat_template`` as its template; each of ``atoms`` (whole words: a letter,
    then letters or digits) is always split off as its own piece, before digits are isolated."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    if not texts:
        raise ValueError("train_world_tokenizer: no text to train on")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"train_world_tokenizer: vocab_size {vocab_size} is below the 256 bytes + specials")
    tok = Tokenizer(models.BPE())
    words = sorted({a for a in atoms if a}, key=lambda a: (-len(a), a))
    for a in words:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", a):
            raise ValueError(f"train_world_tokenizer: atom {a!r} is not one word (a letter, then letters or digits)")
    # one pass: an atom, else one digit (an id's digits are single tokens; its letter stays with what precedes it)
    pieces = "|".join([*([r"\b(?:" + "|".join(re.escape(a) for a in words) + r")\b"] if words else []), r"\d"])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pieces), "isolated"),
        pre_tokenizers.Split("\n", "merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token=None)
    out.chat_template = chat_template
    return out


def byte_tokenizer(chat_template: str) -> Any:
    """The 256 bytes and the special tokens, no merges: renders a chat template before any world tokenizer
    exists (the texts a world tokenizer is trained on are rendered with it)."""
    return train_world_tokenizer(["-"], 256 + len(SPECIAL_TOKENS), chat_template)
