"""`tokenfleet generate`: offline generation streamed to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenfleet.runtime.config import DEFAULT_MODEL


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenfleet generate", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, .gguf file or HF checkpoint dir")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from tokenfleet.runtime.engine.llm import LLM
    from tokenfleet.runtime.engine.sampling_params import SamplingParams
    from tokenfleet.runtime.errors import TokenfleetError

    try:
        llm = LLM(args.model, dtype=args.dtype)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        single = len(args.prompt) == 1
        if single:
            sys.stdout.write(args.prompt[0] if not args.chat else "")
            sys.stdout.flush()

        def show(deltas) -> None:
            if single:
                for delta in deltas:
                    sys.stdout.write(delta.new_text)
                sys.stdout.flush()

        # One prompt streams its text; a batch shows a progress bar, then each answer.
        options = {"use_tqdm": not single, "on_step": show}
        start = time.perf_counter()
        if args.chat:
            conversations = [[{"role": "user", "content": p}] for p in args.prompt]
            results = llm.chat(conversations, params, **options)
        else:
            results = llm.generate(args.prompt, params, **options)
        elapsed = time.perf_counter() - start
        if single:
            sys.stdout.write("\n")
        else:
            for prompt, res in zip(args.prompt, results, strict=True):
                print(f"--- {prompt!r}\n{res.outputs[0].text}")
        n = sum(len(c.token_ids) for r in results for c in r.outputs)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    except TokenfleetError as e:
        print(f"tokenfleet generate: {e}", file=sys.stderr)
        return 1
    return 0
