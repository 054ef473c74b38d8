"""Text <-> token ids with HuggingFace ``tokenizers`` (GPT-2's byte-level BPE, or the embedded model's own)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, InvalidInputError, is_integer

EOT = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper: ``encode(text) -> list[int]``, ``decode(ids) -> str``, and the ``<|endoftext|>`` id.

    ``<|endoftext|>`` written in the text is read as the special token (as HF does), so documents can be joined
    with it. Byte-level BPE can split one character over several tokens, so streamed text is decoded with
    ``decode_stream``, which holds bytes back until they form whole characters.
    """

    def __init__(self, hf_tokenizer, source: str = ""):
        self.hf = hf_tokenizer
        self.source = source
        self.eos_token_id = self.hf.token_to_id(EOT)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer file not found")
        try:
            return cls(HFTokenizer.from_file(str(path)), str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path) -> "Tokenizer":
        """The older HF layout: ``vocab.json`` + ``merges.txt`` (GPT-2's encoder.json / vocab.bpe)."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        for p in (vocab, merges):
            if not Path(p).is_file():
                raise CheckpointError(f"{p}: tokenizer file not found")
        try:
            tok = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"{vocab} + {merges}: not a valid vocab/merges pair ({e})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOT) is not None:
            tok.add_special_tokens([EOT])
        return cls(tok, f"{vocab} + {merges}")

    @cached_property
    def vocab_size(self) -> int:
        """The largest token id + 1: every id is below it. Not the number of tokens (``get_vocab_size``), which is
        smaller when the ids have gaps, as a vocab.json may have."""
        return max(self.hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidInputError(f"encode: expected text (str), got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: bytes the terminal could not decode as UTF-8
            raise InvalidInputError(f"encode: the text is not valid UTF-8 ({e.reason} at position {e.start})") from None
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids) -> list[int]:
        """``ids`` as a list of ints, each a token id of this vocabulary (no silent truncation of 1.7 to 1)."""
        if isinstance(ids, np.ndarray) and ids.ndim != 1:
            raise InvalidInputError(f"decode: expected a 1-D sequence of token ids, got an array of shape {ids.shape}")
        ids = list(ids)
        bad = next((i for i in ids if not is_integer(i, 0, self.vocab_size - 1)), None)
        if bad is not None:
            raise InvalidInputError(f"decode: {bad!r} is not a token id in [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
        """Yield text pieces as tokens arrive; a piece is emitted once its bytes form whole characters."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for i in ids:
            piece = stream.step(self.hf, self._check_ids([i])[0])
            if piece:
                yield piece

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


class MissingTokenizer:
    """The tokenizer of a model that has none (``random_model`` of a custom shape, a checkpoint folder without
    tokenizer files): encoding or decoding text raises a ``CheckpointError`` that says why, instead of an
    ``AttributeError`` on ``None``. False in a boolean test. Token ids work without it."""

    eos_token_id = None

    def __init__(self, reason: str):
        self.reason = reason
        self.source = ""

    def _fail(self, *args, **kwargs):
        raise CheckpointError(self.reason)

    encode = decode = decode_stream = _fail

    @property
    def vocab_size(self) -> int:
        self._fail()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"MissingTokenizer({self.reason!r})"


def tokenizer_for_directory(directory: Path) -> Tokenizer | None:
    """The tokenizer stored beside a checkpoint: ``tokenizer.json``, else ``vocab.json`` + ``merges.txt``."""
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(directory / "tokenizer.json")
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        return Tokenizer.from_vocab_merges(directory / "vocab.json", directory / "merges.txt")
    return None
