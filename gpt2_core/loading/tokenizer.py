"""Text <-> token ids with HuggingFace ``tokenizers`` (GPT-2's byte-level BPE, or the embedded model's own), and the
chat template and special tokens of the folder it came from (``tokenizer_config.json``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, InvalidInputError, is_integer
from .config import read_json_object

EOT = "<|endoftext|>"


class Tokenizer:
    """A thin wrapper: ``encode(text) -> list[int]``, ``decode(ids) -> str``, and the ``<|endoftext|>`` id.

    ``<|endoftext|>`` written in the text is read as the special token (as HF does), so documents can be joined
    with it. Byte-level BPE can split one character over several tokens, so streamed text is decoded with
    ``decode_stream``, which holds bytes back until they form whole characters.

    ``chat_template`` is the model's Jinja2 chat format (None when its folder has none) and ``special_tokens`` the
    special tokens a template sees (``{"bos_token": ..., "eos_token": ...}``), both read from the folder's
    ``tokenizer_config.json`` by ``tokenizer_for_directory``; ``apply_chat_template`` renders a conversation.
    """

    def __init__(self, hf_tokenizer, source: str = "", chat_template: str | None = None,
                 special_tokens: dict | None = None):
        self.hf = hf_tokenizer
        self.source = source
        self.eos_token_id = self.hf.token_to_id(EOT)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (``[{"role": ..., "content": ...}, ...]``), rendered with the model's
        chat template as transformers' ``apply_chat_template(..., tokenize=False)`` renders it; a
        ``TemplateError`` (an ``InvalidInputError``) if the model has no template or the template refuses."""
        from .chat_template import apply_chat_template

        return apply_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)

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
    chat_template = None
    special_tokens: dict = {}

    def __init__(self, reason: str):
        self.reason = reason
        self.source = ""

    def _fail(self, *args, **kwargs):
        raise CheckpointError(self.reason)

    encode = decode = decode_stream = apply_chat_template = _fail

    @property
    def vocab_size(self) -> int:
        self._fail()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"MissingTokenizer({self.reason!r})"


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_for_directory(directory: Path) -> Tokenizer | None:
    """The tokenizer stored beside a checkpoint: ``tokenizer.json``, else ``vocab.json`` + ``merges.txt``; with the
    folder's chat template and special tokens (``read_chat_settings``)."""
    if (directory / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(directory / "tokenizer.json")
    elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        tokenizer = Tokenizer.from_vocab_merges(directory / "vocab.json", directory / "merges.txt")
    else:
        return None
    tokenizer.chat_template, tokenizer.special_tokens = read_chat_settings(directory)
    return tokenizer


def read_chat_settings(directory: Path) -> tuple[str | None, dict]:
    """(the chat template, the special tokens a template sees) of a checkpoint folder, as transformers reads them:
    ``chat_template.jinja`` if present (where transformers saves a template since 4.49), else ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates whose ``default`` is used); special tokens
    are strings or ``{"content": ...}`` objects there. (None, {}) for a folder without that file."""
    file = directory / "tokenizer_config.json"
    config = read_json_object(file)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{file}: chat_template must be text (a Jinja2 template), got {type(template).__name__}")
    special = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return template or None, special
