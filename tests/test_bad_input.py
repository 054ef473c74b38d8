"""Bad input anywhere in the public API: a package error that names the problem, and no state left half changed.

Each case here once gave a raw Python error, a silent wrong result, a hang or an engine that could not step
again (found by a bug hunt on 2026-12-04).
"""

import numpy as np
import pytest
from helpers import TINY, config_json, tiny_model

import gpt2_core
from gpt2_core import kv_cache; from gpt2_core.ch03_batching import model_runner
from gpt2_core.bench import workload as wl
from gpt2_core.loading.config import GPT2Config
from gpt2_core.bench.replay import replay
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.errors import CheckpointError, InvalidInputError
from gpt2_core.ch03_batching.kv_store import ContiguousKVStore
from gpt2_core.ch04_paged.paged_kv_store import PagedKVStore
from gpt2_core.ch01_forward.sampling import Sampler, SamplingParams
from gpt2_core.ch03_batching.sequence import FinishReason, Request
from gpt2_core.ch03_batching.static_batching import static_generate


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def alone(model, r):
    return kv_cache.generate(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos)


def test_a_store_of_another_shape_or_a_max_len_beside_a_store_is_refused_when_the_engine_is_built(model):
    other = GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_head=4, n_layer=2)
    with pytest.raises(InvalidInputError, match="KV store holds 2 layers x 4 heads"):
        LLMEngine(model, store=ContiguousKVStore(other, 2))
    with pytest.raises(InvalidInputError, match="max_len"):
        LLMEngine(model, store=PagedKVStore(TINY, num_blocks=8, block_size=4), max_len=4)


def test_a_model_step_that_raises_leaves_the_engine_able_to_go_on(model, monkeypatch):
    engine = LLMEngine(model, max_num_seqs=2, max_len=16)
    requests = [Request("a", [1, 2, 3], 5, stop_at_eos=False), Request("b", [4, 5], 4, stop_at_eos=False)]
    for r in requests:
        engine.add_request(r)
    engine.step()  # both prefilled
    real, calls = model_runner.ragged_forward, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a step, after some layers wrote their K/V
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", fails_once)  # the engine's model step
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.store.reserved_tokens() == 0 and len(engine.scheduler.waiting) == 2  # both wait again, KV freed
    engine.run_until_done()
    assert [engine.get_sequence(r.request_id).output_token_ids for r in requests] == [alone(model, r) for r in requests]
    assert engine.store.reserved_tokens() == 0


def test_generate_many_refuses_a_repeated_request_id_before_queuing_anything(model):
    engine = LLMEngine(model, max_num_seqs=2, max_len=16)
    with pytest.raises(InvalidInputError, match="'a' is already"):
        engine.generate_many([Request("a", [1, 2], 3), Request("b", [1], 3), Request("a", [3], 3)])
    assert not engine.has_unfinished() and not engine.sequences
    out = engine.generate_many([Request("a", [1, 2], 3, stop_at_eos=False)])  # the ids are still free
    assert out[0].output_token_ids == alone(model, Request("a", [1, 2], 3, stop_at_eos=False))


def test_requests_of_the_wrong_kind_are_refused_by_name(model):
    engine = LLMEngine(model, max_num_seqs=2, max_len=16)
    for bad, match in ((None, "expected a Request"), ({"request_id": 1}, "expected a Request"),
                       (Request([1], [1, 2], 3), "hashable")):
        with pytest.raises(InvalidInputError, match=match):
            engine.add_request(bad)
    with pytest.raises(InvalidInputError, match="arrival_time"):
        engine.add_request(Request("t", [1], 2), arrival_time="soon")
    for call in (lambda i: next(engine.stream(i)), engine.get_sequence):
        with pytest.raises(InvalidInputError, match="no request 'nope'"):
            call("nope")
    engine.add_request(Request("s", [1, 2], 2, stop_at_eos="no"))  # fails alone, with its reason
    assert engine.get_sequence("s").finish_reason is FinishReason.ERROR
    assert "stop_at_eos" in engine.get_sequence("s").error and not engine.sequences.keys() - {0}


def test_replay_refuses_a_time_scale_that_would_never_let_a_request_arrive(model):
    for bad in (float("nan"), float("inf"), -1, "x", None):
        with pytest.raises(InvalidInputError, match="time_scale"):
            replay(LLMEngine(model, max_num_seqs=1, max_len=16), [Request(1, [1, 2], 2)], time_scale=bad)


def test_greedy_sampling_refuses_nan_or_all_minus_inf_logits_as_sampled_decoding_does():
    for logits in (np.full(101, np.nan, np.float32), np.full(101, -np.inf, np.float32),
                   np.r_[np.zeros(100), np.nan].astype(np.float32)):
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0)):
            with pytest.raises(InvalidInputError, match="NaN or all -inf"):
                Sampler(params)(logits)
    assert Sampler(SamplingParams())(np.r_[np.zeros(100), np.inf]) == 100  # +inf is simply the most likely


def test_a_logits_processor_banning_every_token_fails_its_request_alone_under_greedy(model):
    engine = LLMEngine(model, max_num_seqs=2, max_len=16)
    ban = Request("ban", [1, 2], 3, logits_processor=lambda ids, logits: np.full_like(logits, -np.inf))
    ok = Request("ok", [3, 4], 3, stop_at_eos=False)
    out = engine.generate_many([ban, ok])
    assert out[0].finish_reason is FinishReason.ERROR and "NaN or all -inf" in out[0].error
    assert out[1].output_token_ids == alone(model, ok) and engine.store.reserved_tokens() == 0


def test_a_kv_cache_made_for_another_shape_is_refused_and_left_as_it_was(model):
    for other in (GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_head=4, n_layer=2),
                  GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_head=3, n_layer=3),
                  GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_head=3, n_layer=1)):
        cache = kv_cache.KVCache(other, 8)
        with pytest.raises(InvalidInputError, match="KV cache holds"):
            kv_cache.decode_step(model, 5, cache)
        assert cache.length == 0


def test_static_batching_checks_every_row_value_before_it_starts(model):
    prompts = [[1, 2], [3]]
    for kwargs, match in (({"stop_token_ids": 5000}, "stop_token_ids"), ({"stop_token_ids": -1}, "stop_token_ids"),
                          ({"stop_at_eos": "no"}, "stop_at_eos"), ({"pad_id": 10**6}, "pad_id"),
                          ({"sampling_params": "greedy"}, "sampling_params"),
                          ({"sampling_params": {"temp": 1}}, "sampling_params")):
        with pytest.raises(InvalidInputError, match=match):
            static_generate(model, prompts, 3, **kwargs)
    with pytest.raises(InvalidInputError, match="list of prompts"):
        static_generate(model, None, 3)
    per_row = static_generate(model, prompts, 3, stop_at_eos=np.array([False, False]), stop_token_ids=np.array([7, 8]))
    assert per_row.output_token_ids == static_generate(model, prompts, 3, stop_at_eos=[False, False],
                                                       stop_token_ids=[7, 8]).output_token_ids


def test_workloads_and_traces_name_what_is_wrong(tmp_path):
    for kwargs, match in (({"num_requests": 0}, "num_requests"), ({"num_requests": 2.5}, "num_requests"),
                          ({"request_rate": 0}, "request_rate"), ({"request_rate": -1}, "request_rate"),
                          ({"vocab_size": 0}, "vocab_size")):
        args = {"num_requests": 3, "request_rate": 1.0, "vocab_size": 101, **kwargs}
        with pytest.raises(InvalidInputError, match=match):
            wl.poisson_workload(**args)
    assert len(wl.poisson_workload(3, float("inf"), 101)) == 3
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(InvalidInputError, match="cannot read the trace"):
            wl.load_trace(path, vocab_size=101)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt_len": 3, "note": "\xe9"}\n')
    with pytest.raises(InvalidInputError, match="cannot read the trace"):
        wl.load_trace(latin, vocab_size=101)
    bad_id = tmp_path / "bad_id.jsonl"
    bad_id.write_text('{"request_id": [1], "prompt_len": 3}\n')
    with pytest.raises(InvalidInputError, match=r"bad_id.jsonl:1: 'request_id'"):
        wl.load_trace(bad_id, vocab_size=101)


def test_decode_refuses_ids_outside_the_vocabulary_instead_of_truncating_them():
    tok = gpt2_core.load_model().tokenizer
    for bad in ([999_999], [1.7, 2.2], [-1], [True], np.array([[1, 2]])):
        with pytest.raises(InvalidInputError, match="decode"):
            tok.decode(bad)
        with pytest.raises(InvalidInputError, match="decode"):
            list(tok.decode_stream(bad))
    assert tok.decode(np.array([5, 6])) == tok.decode([5, 6])


def test_a_vocabulary_with_gaps_bounds_ids_by_its_largest_id_not_its_token_count(tmp_path):
    """vocab.json may skip ids: {a: 0, b: 1, ab: 500} encodes 'ab' as 500, so decode must take 500 back, and a model
    with vocab_size=101 (which has no row 500) must refuse this tokenizer when it is loaded."""
    import json

    from helpers import write_checkpoint

    from gpt2_core.loading.tokenizer import Tokenizer

    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 500}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = Tokenizer.from_vocab_merges(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert tok.vocab_size == 501 and tok.encode("ab") == [500]
    assert tok.decode([500, 0]) == "aba" and "".join(tok.decode_stream([500])) == "ab"
    with pytest.raises(InvalidInputError, match=r"501 is not a token id in \[0, 501\)"):
        tok.decode([501])
    write_checkpoint(tmp_path, tiny_model())  # vocab_size=101
    with pytest.raises(CheckpointError, match="tokenizer has token ids up to 500 but the model's vocab_size is 101"):
        gpt2_core.load_model(tmp_path)


def test_a_paged_budget_checks_its_block_size_and_a_config_path_that_is_a_directory_is_a_checkpoint_error(tmp_path):
    with pytest.raises(InvalidInputError, match="block_size"):
        PagedKVStore.from_budget(TINY, 10**6, block_size=0)
    (tmp_path / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="cannot read config.json"):
        GPT2Config.from_json(tmp_path / "config.json")


def test_save_trace_writes_numpy_values_as_json_and_refuses_what_load_trace_could_not_read(tmp_path):
    path = tmp_path / "t.jsonl"
    wl.save_trace([Request(np.int64(1), [1, 2, 3], np.int64(4), arrival_s=np.float32(0.5),
                           sampling_params={"temperature": np.float32(0.5), "seed": np.int64(3)})], path)
    (back,) = wl.load_trace(path, vocab_size=101)
    assert (back.request_id, back.max_new_tokens, back.arrival_s) == (1, 4, 0.5)
    assert SamplingParams(**back.sampling_params) == SamplingParams(temperature=0.5, seed=3)
    for bad, match in ((Request([1], [1], 2), "request_id"), (Request(2, [1], 2, sampling_params={"temp": 1}), "temp")):
        with pytest.raises(InvalidInputError, match=match):
            wl.save_trace([bad], tmp_path / "refused.jsonl")
        assert not (tmp_path / "refused.jsonl").exists()  # nothing written


def test_random_model_names_a_bad_seed_or_shape():
    for kwargs, match in (({"seed": -1}, "seed"), ({"seed": "a"}, "seed"), ({"seed": 1.5}, "seed"),
                          ({"name_or_config": 123}, "preset name or a GPT2Config")):
        with pytest.raises(InvalidInputError, match=match):
            gpt2_core.random_model(**{"name_or_config": TINY, **kwargs})
    assert gpt2_core.random_model(TINY, seed=np.int64(1)).config == TINY


def run_cli(*args):
    import subprocess
    import sys

    from helpers import ROOT
    return subprocess.run([sys.executable, "-m", "gpt2_core", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_the_cli_refuses_an_unwritable_json_path_and_a_misplaced_trace_before_any_work(tmp_path):
    for args, message in ((("bench", "kv-cache", "--quick", "--json", str(tmp_path / "no" / "x.json")), "--json"),
                          (("bench", "kv-cache", "--quick", "--json", str(tmp_path)), "--json"),
                          (("bench", "kv-cache", "--quick", "--trace", str(tmp_path / "t.jsonl")), "--trace applies to")):
        r = run_cli(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("generate", "Emma", "--max-new-tokens", "2", "--temperature", "0", "--seed", "3")  # greedy
    assert r.returncode == 0 and "note: --seed only applies when sampling" in r.stderr


def test_loading_and_tokenising_bad_bytes_give_package_errors(tmp_path):
    import json
    import struct

    header = json.dumps({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match="dtype"):
        gpt2_core.loading.safetensors_io.load_safetensors(bad)
    with pytest.raises(CheckpointError, match="cannot read"):
        gpt2_core.loading.safetensors_io.load_safetensors(tmp_path)  # a directory
    (tmp_path / "config.json").write_text(json.dumps(config_json(TINY)))
    (tmp_path / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        gpt2_core.load_model(tmp_path)
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        gpt2_core.load_model().tokenizer.encode("caf\udcc3")  # how Python hands over undecodable argv bytes


def test_find_submissions_refuses_a_folder_or_a_dead_link_named_like_a_notebook(tmp_path):
    from gpt2_core import classroom

    (tmp_path / "bob" / "01_small.ipynb").mkdir(parents=True)
    with pytest.raises(classroom.ClassroomError, match="not a notebook file"):
        classroom.find_submissions(tmp_path, ["01_small"])
    with pytest.raises(classroom.ClassroomError, match="--out"):
        classroom.autograde(tmp_path, out_csv=tmp_path / "missing" / "grades.csv")
