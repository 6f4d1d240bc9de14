"""Structured outputs: decode tokens/s with and without a JSON schema on the same prompts, and grammar
compile time per schema.

Both runs decode exactly the same number of tokens per request: the free run ignores EOS, and the schema
(an object of 40 required string fields) cannot be complete before `--max-tokens`. Decode tok/s
counts the tokens after the first step that produced any, over the time since that step (prefill and
grammar compilation excluded), by wall clock and by the process's CPU time (the figure to trust on a shared
machine). Free and constrained runs alternate `--repeats` times and the best of each is kept. The goal is a
slowdown of at most 10%.

Compile time: each schema compiled once by a fresh compiler (the tokenizer info is built first and timed
separately), then once more from the cache.

    python bench/structured_output.py [--batch 1 8] [--max-tokens 64] [--repeats 3] [--threads 1] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.structured_output.compiler import GrammarCompiler
from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
from tokenfleet.runtime.engine.structured_output.state import GrammarState, grammar_bitmask
from tokenfleet.runtime.model.loader import load_model

PROMPTS = [
    "List fruits as JSON.",
    "Give me city names in a JSON object.",
    "Produce a JSON document of colours.",
    "Write a JSON list of animals.",
    "Answer in JSON: planets of the solar system.",
    "Return JSON with tool names.",
    "JSON please: ten programming languages.",
    "Make a JSON object listing rivers.",
]
# A form of 40 required string fields: it cannot be complete within --max-tokens. Its strings have no
# maxLength: xgrammar 0.2.8 expands a string's maxLength into a counted repetition its token-mask cache
# cannot cover, and the mask then costs ~10 ms per token per row on this CPU instead of < 0.1 ms (the
# mask-cost lines below measure it; minItems costs nothing).
DECODE_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i:02d}": {"type": "string"} for i in range(40)},
    "required": [f"field_{i:02d}" for i in range(40)],
    "additionalProperties": False,
}
COMPILE_SCHEMAS = {
    "person (3 fields)": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "user"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "40-field form": DECODE_SCHEMA,
    "string array": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}}},
        "required": ["items"],
    },
    "string array, minItems 200": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
        "required": ["items"],
    },
    "string array, maxLength 12": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
        "required": ["items"],
    },
    "nested order (4 levels)": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "customer": {
                "type": "object",
                "properties": {
                    "email": {"type": "string", "format": "email"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "street": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["street", "zip"],
                    },
                },
                "required": ["email", "address"],
            },
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            },
        },
        "required": ["id", "customer", "lines"],
    },
    "30 optional fields": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "number", "boolean", "null"]} for i in range(30)},
    },
}


def decode_rate(
    llm: LLM, prompts: list[list[int]], schema: GrammarSpec | None, max_tokens: int
) -> tuple[float, float]:
    """Decode tokens/s of one batch, by wall clock and by this process's CPU time (all threads): tokens
    after the first step that produced any, over the time since that step (prefill and grammar compilation
    excluded). CPU time is what to compare on a shared machine, where wall time depends on the neighbours."""
    steps: list[tuple[float, float, int]] = []

    def on_step(outputs) -> None:
        steps.append((time.perf_counter(), time.process_time(), sum(len(o.new_token_ids) for o in outputs)))

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_output=schema)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False, on_step=on_step)]
    assert all(len(o.token_ids) == max_tokens for o in outs), [len(o.token_ids) for o in outs]
    if schema is not None:  # the constraint held: every output is a prefix of the schema's JSON
        head = '{"field_00":"'
        bad = [o.text for o in outs if not (o.text.startswith(head) or head.startswith(o.text))]
        assert not bad, bad
    first = next(i for i, step in enumerate(steps) if step[2])
    tokens = sum(step[2] for step in steps[first + 1 :])
    return tokens / (steps[-1][0] - steps[first][0]), tokens / (steps[-1][1] - steps[first][1])


def mask_ms(compiler: GrammarCompiler, spec: GrammarSpec, token_ids: list[int]) -> float:
    """Milliseconds to compute one row's next-token mask, averaged along `token_ids`."""
    state = GrammarState(compiler.compile(spec), compiler.vocab_size)
    start = time.perf_counter()
    for k in range(len(token_ids)):
        grammar_bitmask([(state, token_ids[:k])], compiler.vocab_size)
    return 1000 * (time.perf_counter() - start) / len(token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: CPU time is compute, not OpenMP spin-waits)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = RuntimeConfig(model=ModelConfig(device=args.device))
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    loaded = load_model(config.model, device)
    llm = LLM(config=config, loaded=loaded)
    tok = loaded.tokenizer
    print(f"device {device}, model {config.model.model}, vocab {loaded.arch.vocab_size}")

    print("\n== grammar compile time per schema (fresh compiler, then cache hit) ==")
    compiler = GrammarCompiler(tok, loaded.arch.vocab_size)
    start = time.perf_counter()
    compiler.compile(GrammarSpec.regex("a"))
    print(f"tokenizer info + first (trivial) compile: {1000 * (time.perf_counter() - start):8.1f} ms")
    for name, schema in COMPILE_SCHEMAS.items():
        spec = GrammarSpec.json_schema(schema)
        start = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec)
        hit = time.perf_counter() - start
        print(
            f"{name:28s} compile {1000 * first:8.1f} ms   cached {1e6 * hit:6.1f} us   ({len(json.dumps(schema))} B)"
        )

    print("\n== next-token mask cost per row ==")
    sample = tok.encode('{"items":["apple","banana","cherry","dates"', add_special_tokens=False)
    for name in ("string array", "string array, minItems 200", "string array, maxLength 12"):
        spec = GrammarSpec.json_schema(COMPILE_SCHEMAS[name])
        print(f"{name:28s} {mask_ms(compiler, spec, sample):8.2f} ms per token")

    print(f"\n== decode tok/s, {args.max_tokens} tokens per request, greedy ==")
    spec = GrammarSpec.json_schema(DECODE_SCHEMA)
    for batch in args.batch:
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
        ]
        decode_rate(llm, prompts, spec, 4)  # warm-up (and the grammar compile)
        free, constrained = (0.0, 0.0), (0.0, 0.0)
        for _ in range(args.repeats):
            free = tuple(map(max, free, decode_rate(llm, prompts, None, args.max_tokens)))
            constrained = tuple(map(max, constrained, decode_rate(llm, prompts, spec, args.max_tokens)))
        for label, i in (("wall", 0), ("cpu", 1)):
            slowdown = 100 * (1 - constrained[i] / free[i])
            verdict = "ok" if slowdown <= 10 else "over the 10% goal"
            print(
                f"batch {batch:3d} {label:4s}: free {free[i]:8.1f} tok/s   json schema {constrained[i]:8.1f} tok/s"
                f"   slowdown {slowdown:5.1f}% ({verdict})"
            )


if __name__ == "__main__":
    main()
