import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

import pytest  # noqa: E402


@pytest.fixture(params=[0, None], ids=["in place always", "by the rule"])
def run_cost_tokens(request, monkeypatch):
    """Chapter 5's store both ways: reading every decoding sequence in place however scattered its blocks
    (``run_cost_tokens = 0``) and by its rule (on the tests' short sequences the rule gathers nearly every sequence
    in more than one run, so the in-place path over many runs would otherwise go untested in the engines)."""
    from gpt2_core.ch05_sharing.paged_attention import PagedAttentionKVStore

    if request.param is not None:
        monkeypatch.setattr(PagedAttentionKVStore, "run_cost_tokens", request.param)
    return PagedAttentionKVStore.run_cost_tokens
