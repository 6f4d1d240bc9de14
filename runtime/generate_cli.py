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
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
            for p in args.prompt
        ]
        ids = [llm.tokenizer.encode(p, add_special_tokens=False) if args.chat else p for p in prompts]
        single = len(prompts) == 1
        if single:
            sys.stdout.write(args.prompt[0] if not args.chat else "")
            sys.stdout.flush()

        def show(outputs) -> None:
            if single:
                for out in outputs:
                    sys.stdout.write(out.new_text)
                sys.stdout.flush()

        start = time.perf_counter()
        results = llm.generate(ids, params, on_step=show)
        elapsed = time.perf_counter() - start
        if single:
            sys.stdout.write("\n")
        else:
            for prompt, res in zip(args.prompt, results, strict=True):
                print(f"--- {prompt!r}\n{res.text}")
        n = sum(len(r.token_ids) for r in results)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    except TokenfleetError as e:
        print(f"tokenfleet generate: {e}", file=sys.stderr)
        return 1
    return 0
