"""The package's own exception types.

Every error a learner can cause (a bad file, a bad prompt, a bad sampling parameter) is raised as one of these,
with a message that names the file, tensor, shape or parameter at fault. Catch ``GPT2Error`` to catch them all.
``is_integer`` and ``is_real`` are the two type checks every such message starts from; ``is_writable_file`` the
check of an output path, made before the work whose result it will hold.
"""

import math
import os
from pathlib import Path

import numpy as np


# What json.loads raises on a damaged or hostile text, besides JSONDecodeError (itself a ValueError): a
# UnicodeDecodeError (a ValueError), a ValueError for a number of thousands of digits, and a RecursionError for
# '[' nested thousands deep. Every reader of a JSON file catches these and names the file.
BAD_JSON = (ValueError, RecursionError)


class GPT2Error(Exception):
    """Base class of every error raised on purpose by ``gpt2_core``."""


class CheckpointError(GPT2Error):
    """A checkpoint file or directory is missing, truncated, corrupt, unsafe or does not fit the config."""


class InvalidInputError(GPT2Error, ValueError):
    """A prompt, token id or generation parameter is out of range."""


class CacheCapacityError(InvalidInputError):
    """A KV cache (or the context window) has no room for the tokens asked for."""


class MissingDependencyError(GPT2Error, ImportError):
    """An optional feature was asked for whose extra is not installed; the message names the extra."""


class WorkerError(GPT2Error, RuntimeError):
    """A worker process of a parallel model (chapter 8) died or failed; the message names the worker. The group of
    workers is shut down when this is raised: its other processes stopped, its shared memory freed."""


def is_integer(value, least: int | None = None, most: int | None = None) -> bool:
    """``value`` is a whole number from ``least`` to ``most`` (a bound left None is open): a Python or NumPy integer
    (``np.arange`` hands out ``np.int64``), never a bool, which Python counts as an ``int``."""
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and (least is None or value >= least) and (most is None or value <= most))


def is_real(value) -> bool:
    """``value`` is a finite real number: a Python or NumPy integer or float (``np.float32`` is not a ``float`` to
    Python), never a bool."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400), as a JSON file may hold
        return False


def is_writable_file(path) -> bool:
    """A file could be written at ``path``: not a folder, in a folder that exists and that we may write to."""
    path = Path(path)
    return not path.is_dir() and path.parent.is_dir() and os.access(path.parent, os.W_OK)


def check_sampling(temperature, top_k=None, top_p=None, seed=None) -> tuple:
    """The sampling parameters as Python numbers (``np.float32(0.75)`` -> ``0.75``), or an ``InvalidInputError``
    naming the first bad one: temperature >= 0 (0 = greedy), top_k >= 0 (0 or None = all), top_p in (0, 1],
    seed >= 0. Chapter 1's ``SamplingParams`` and the loader's ``sampling_defaults`` both check with it."""
    t, k, p = temperature, top_k, top_p
    if not is_real(t) or t < 0:
        raise InvalidInputError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
    if k is not None and not is_integer(k, 0):
        raise InvalidInputError(f"top_k must be an integer >= 0 (0 = no limit), got {k!r}")
    if p is not None and (not is_real(p) or not 0 < p <= 1):
        raise InvalidInputError(f"top_p must be in (0, 1] (1 = no limit), got {p!r}")
    if seed is not None and not is_integer(seed, 0):
        raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
    return (float(t), None if k is None else int(k), None if p is None else float(p),
            None if seed is None else int(seed))
