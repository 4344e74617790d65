"""A character tokenizer for the embedded CPU task: one token per character, plus pad/bos/eos.

Ids: ``pad = 0``, ``bos = 1``, ``eos = 2``, then one id per character of ``alphabet`` in order.
The vocabulary the model sees (``vocab_size``) is rounded up to a multiple of
``pad_vocab_to_multiple_of`` (megatron shards the embedding and output layer by rows across TP
ranks, so the size must divide by the TP size; 16 covers TP = 1, 2, 4, 8, 16). The padding ids
are never produced by ``encode``; a model learns to give them ~zero probability.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
DEFAULT_ALPHABET = "0123456789+-*/=,:> "


@dataclass
class TokenizerConfig:
    """Validated in ``__post_init__`` (ValueError naming the key)."""

    alphabet: str = DEFAULT_ALPHABET
    pad_vocab_to_multiple_of: int = 16

    def __post_init__(self) -> None:
        if not self.alphabet:
            raise ValueError("tokenizer.alphabet must not be empty")
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"tokenizer.alphabet={self.alphabet!r} has repeated characters")
        if self.pad_vocab_to_multiple_of < 1:
            raise ValueError(
                f"tokenizer.pad_vocab_to_multiple_of={self.pad_vocab_to_multiple_of} must be >= 1"
            )

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


class CharTokenizer:
    """Characters <-> ids. ``encode`` never adds bos/eos; callers add them where they belong."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, config: TokenizerConfig = None):
        self.config = config if config is not None else TokenizerConfig()
        self.alphabet = self.config.alphabet
        self._char_to_id = {ch: NUM_SPECIAL + i for i, ch in enumerate(self.alphabet)}
        self.num_real_tokens = NUM_SPECIAL + len(self.alphabet)
        multiple = self.config.pad_vocab_to_multiple_of
        self.vocab_size = -(-self.num_real_tokens // multiple) * multiple

    def encode(self, text: str) -> List[int]:
        """One id per character; ValueError naming the character if it is not in the alphabet."""
        try:
            return [self._char_to_id[ch] for ch in text]
        except KeyError as error:
            raise ValueError(f"character {error.args[0]!r} of {text!r} is not in the tokenizer alphabet") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of the ids up to the first EOS; pad, bos and padding-vocab ids are dropped."""
        chars = []
        for token in ids:
            token = int(token)
            if token == EOS_ID:
                break
            if NUM_SPECIAL <= token < self.num_real_tokens:
                chars.append(self.alphabet[token - NUM_SPECIAL])
        return "".join(chars)

    def encode_prompt(self, prompt: str) -> List[int]:
        """``[bos] + encode(prompt)``: what a model is conditioned on."""
        return [BOS_ID] + self.encode(prompt)

    def encode_response(self, response: str) -> List[int]:
        """``encode(response) + [eos]``: a complete response."""
        return self.encode(response) + [EOS_ID]
