"""Command line: ``python -m gpt2_core generate "prompt"`` and ``python -m gpt2_core bench NAME``."""

from __future__ import annotations

import argparse
import sys

from .errors import GPT2Error


def _generate(args) -> int:
    from .weights import load_model

    model = load_model(args.model)
    if model.tokenizer is None:
        raise GPT2Error(f"{model.source}: no tokenizer found beside the checkpoint (tokenizer.json)")
    stream = _engine(args.engine)
    prompt_ids = model.tokenizer.encode(args.prompt)
    tokens = stream(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    for piece in model.tokenizer.decode_stream(tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _engine(name: str):
    if name == "naive":
        from .generation import generate_stream
    else:
        from .kv_cache import generate_stream
    return generate_stream


def _bench(args) -> int:
    from .bench import run_benchmark

    run_benchmark(args.name, json_path=args.json, trace=args.trace, quick=args.quick)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt2_core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=50)
    g.add_argument("--model", default=None, help="directory, .safetensors/.bin file or hub name "
                                                 "(default: the embedded model in data/embedded)")
    g.add_argument("--engine", choices=["naive", "kv"], default="kv",
                   help="naive = recompute the sequence each step (chapter 1); kv = KV cache (chapter 2)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="run a benchmark (GPT-2 124M-shaped random weights)")
    b.add_argument("name", choices=["naive", "kv-cache", "batching", "paged"])
    b.add_argument("--json", default=None, help="write the results here as JSON")
    b.add_argument("--trace", default=None, help="JSONL workload trace (batching, paged)")
    b.add_argument("--quick", action="store_true", help="small sizes (seconds instead of minutes)")
    b.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except GPT2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
