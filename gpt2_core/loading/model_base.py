"""What every model of the package shares, whatever its architecture: the tokenizer stand-in, token ids checked
against the config, the size. ``loading.weights.GPT2Model`` and ``loading.llama.LlamaModel`` extend it."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInputError
from .tokenizer import MissingTokenizer


class ModelBase:
    """What every model of the package does the same way, whatever its architecture (GPT-2 here, Llama in
    ``loading.llama``): a tokenizer or a clear stand-in, token ids checked against its config, its size. A subclass
    is a dataclass with ``config``, ``params``, ``tokenizer`` and ``source``, and says what ``state_dict`` holds."""

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = MissingTokenizer(f"{self.source or 'this model'} was made without a tokenizer; it takes "
                                              "token ids, not text")

    def check_tokens(self, token_ids) -> np.ndarray:
        """``token_ids`` as an int64 array [T], or an ``InvalidInputError`` naming what is wrong."""
        try:
            ids = np.asarray(token_ids)
        except (ValueError, TypeError) as e:  # e.g. a ragged nested list
            raise InvalidInputError(f"token_ids must be a 1-D sequence of ints ({e})") from None
        if ids.ndim != 1:
            raise InvalidInputError(f"token_ids must be a 1-D sequence of ints, got shape {ids.shape}")
        if ids.size == 0:
            raise InvalidInputError("token_ids is empty: the prompt needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidInputError(f"token_ids must be integers, got dtype {ids.dtype}")
        n_ctx, V = self.config.n_positions, self.config.vocab_size
        if len(ids) > n_ctx:
            raise InvalidInputError(f"sequence of {len(ids)} tokens is longer than the context n_ctx={n_ctx}")
        bad = ids[(ids < 0) | (ids >= V)]
        if bad.size:
            raise InvalidInputError(f"token id {int(bad[0])} is out of range [0, {V}) (vocab_size={V})")
        return ids.astype(np.int64, copy=False)

    def state_dict(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def num_parameters(self) -> int:
        return sum(a.size for a in self.state_dict().values())

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state_dict().values())
