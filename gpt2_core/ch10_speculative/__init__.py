"""Chapter 10, speculative decoding: a cheap drafter guesses k tokens (``drafters``: prompt lookup, a quantized
draft model), the target scores all k + 1 positions in one pass and keeps what it agrees with (``acceptance``:
greedy, and the rejection sampling that keeps the target's distribution), the KV of the rest is rolled back
(``rollback``); for one sequence over chapter 2's cache (``speculative``) and inside chapter 5's engine
(``spec_engine``)."""
