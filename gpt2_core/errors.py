"""The package's own exception types.

Every error a learner can cause (a bad file, a bad prompt, a bad sampling parameter) is raised as one of these,
with a message that names the file, tensor, shape or parameter at fault. Catch ``GPT2Error`` to catch them all.
"""


class GPT2Error(Exception):
    """Base class of every error raised on purpose by ``gpt2_core``."""


class CheckpointError(GPT2Error):
    """A checkpoint file or directory is missing, truncated, corrupt, unsafe or does not fit the config."""


class InvalidInputError(GPT2Error, ValueError):
    """A prompt, token id or generation parameter is out of range."""


class CacheCapacityError(InvalidInputError):
    """A KV cache (or the context window) has no room for the tokens asked for."""
