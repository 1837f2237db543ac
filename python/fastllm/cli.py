"""The ``fastllm`` command line.

    fastllm generate --model PATH --prompt "Once upon a time" --max-tokens 64 --temperature 0.7
    fastllm generate --model PATH --prompt "What is 2 + 2?" --chat
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text, streamed to the terminal",
                                   description="Generates a completion of --prompt and streams "
                                               "it to stdout.")
    parser.add_argument("--model", required=True, help="HF model folder or .gguf file")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string (repeatable); it is not printed")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> None:
    from fastllm import LLM, SamplingParams  # here, so --help needs no torch import

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    prompt = (llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat
              else args.prompt)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastllm", description="fast LLM inference")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as error:
        parser.exit(2, f"fastllm {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
