"""``bench serve --goodput``: vLLM's goodput and the SLO attainment, computed on hand-made request records (no
server, no timing)."""

import pytest

from gpt2_core.__main__ import build_parser
from gpt2_core.bench.registry import run_benchmark
from gpt2_core.bench.serve import goodput, parse_goodput, request_slo_values, summarize, summary_line
from gpt2_core.errors import InvalidInputError


def record(ttft, e2e, tokens, status=200, itl=None):
    """What ``Client.complete`` records for one request (inter-token gaps only matter without a usage count)."""
    return {"priority": 1, "status": status, "ttft_s": ttft, "itl_s": itl or [], "e2e_s": e2e, "tokens": tokens,
            "complete": status == 200}


# ttft, e2e (s), tokens -> tpot = (e2e - ttft) / (tokens - 1)
FAST = record(0.125, 1.125, 9)  # tpot 0.125
SLOW_START = record(0.75, 1.0, 5)  # ttft 0.75 misses 0.5; tpot 0.0625
SLOW_TOKENS = record(0.25, 2.75, 11)  # tpot 0.25 misses 0.2
ONE_TOKEN = record(0.375, 0.375, 1)  # tpot 0 (vLLM's rule for a single token)
ON_THE_LINE = record(0.5, 1.5, 9)  # ttft exactly the SLO: met (vLLM counts value <= SLO); tpot 0.125


def test_tpot_is_time_per_output_token_after_the_first():
    assert request_slo_values(FAST) == {"ttft": 0.125, "tpot": 0.125, "e2el": 1.125}
    assert request_slo_values(ONE_TOKEN)["tpot"] == 0.0
    no_usage = record(0.5, 1.5, 0, itl=[0.25, 0.25, 0.5])  # a server that sent no usage: tokens from the stream
    assert request_slo_values(no_usage)["tpot"] == pytest.approx(1.0 / 3)
    no_text = record(None, 0.25, 0)  # nothing streamed: its first token is its end
    assert request_slo_values(no_text) == {"ttft": 0.25, "tpot": 0.0, "e2el": 0.25}


def test_goodput_counts_requests_that_meet_every_slo():
    done = [FAST, SLOW_START, SLOW_TOKENS, ONE_TOKEN, ON_THE_LINE]
    slos = {"ttft": 0.5, "tpot": 0.2}
    # good: FAST, ONE_TOKEN, ON_THE_LINE (3 of 5 completed; 8 sent, 3 of them refused or lost); a 4 s run
    assert goodput(done, sent=8, wall=4.0, slos=slos) == {"good_requests": 3, "goodput_requests_per_s": 0.75,
                                                          "slo_attainment": 3 / 8}
    assert goodput(done, 8, 4.0, {"ttft": 0.5})["good_requests"] == 4  # only the slow start misses
    assert goodput(done, 8, 4.0, {"tpot": 0.2})["good_requests"] == 4  # only the slow tokens miss
    assert goodput(done, 8, 4.0, {"e2el": 1.125})["good_requests"] == 3  # FAST, SLOW_START, ONE_TOKEN
    assert goodput(done, 8, 4.0, {"ttft": 0.1})["good_requests"] == 0
    assert goodput([], 0, 0.0, slos) == {"good_requests": 0, "goodput_requests_per_s": 0.0, "slo_attainment": None}


def test_summarize_adds_goodput_only_when_slos_are_given():
    records = [FAST, SLOW_START, record(None, 0.01, 0, status=429)]
    plain = summarize(records, sent=3, unanswered=0, rate=1.0, sent_s=2.0, wall=2.0)
    assert "goodput_requests_per_s" not in plain and plain["completed"] == 2 and plain["rejected"] == 1
    assert plain["tpot_p50_s"] == pytest.approx((0.125 + 0.0625) / 2)
    withslo = summarize(records, 3, 0, 1.0, 2.0, 2.0, slos={"ttft": 0.5})
    assert withslo["good_requests"] == 1 and withslo["goodput_requests_per_s"] == 0.5
    assert withslo["slo_attainment"] == pytest.approx(1 / 3)  # the refused request missed its SLO
    line = summary_line(withslo)
    assert "TTFT p50" in line and "ITL p50" in line and "goodput 0.50 req/s of 1.00" in line and "33.3%" in line
    assert "goodput" not in summary_line(plain)


def test_summarize_counts_what_went_wrong_by_kind():
    """Requests never answered (no status: the client's exception), one cut mid-stream, a 500 and those still
    unanswered after the drain are counted by kind, an exception by its type whatever its message, with one message
    kept per kind; refusals (429) are not errors."""
    cut = {**record(0.1, 0.5, 3), "complete": False, "error": "RemoteProtocolError: peer closed connection"}
    never = [{**record(None, None, 0, status=None), "error": f"ConnectTimeout: attempt {i}"} for i in range(2)]
    out = summarize([FAST, cut, *never, record(None, 0.01, 0, status=500), record(None, 0.01, 0, status=429)],
                    sent=7, unanswered=1, rate=1.0, sent_s=2.0, wall=2.0)
    assert out["errors"] == {"ConnectTimeout": 2, "HTTP 500": 1, "RemoteProtocolError": 1,
                             "unanswered when the drain ended": 1}
    assert out["error_examples"]["ConnectTimeout"] == "ConnectTimeout: attempt 0"
    assert out["error_examples"]["RemoteProtocolError"] == "RemoteProtocolError: peer closed connection"
    assert out["other_errors"] == 3 and out["lost"] == 2 and out["rejected"] == 1
    assert summarize([FAST], 1, 0, 1.0, 2.0, 2.0)["errors"] == {}
    assert "errors: 2 x ConnectTimeout, 1 x HTTP 500" in summary_line(out)


def test_goodput_flags_are_read_as_vllm_reads_them():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0005}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["ttft:"], ["ttft:abc"], ["ttft:-1"], ["itl:5"], ["ttft:nan"], ["ttft:5", "ttft:6"]):
        with pytest.raises(InvalidInputError, match="--goodput"):
            parse_goodput(bad)
    args = build_parser().parse_args(["bench", "serve", "--goodput", "ttft:500", "tpot:50", "--quick"])
    assert args.goodput == ["ttft:500", "tpot:50"] and args.quick
    with pytest.raises(InvalidInputError, match="--goodput applies to serve"):
        run_benchmark("kv-cache", goodput=["ttft:500"])
