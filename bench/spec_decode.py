"""Speculative decoding: decode tokens/s with and without speculation, acceptance rate, speedup.

Workloads (chat-templated, greedy, fixed output length):
  (a) repetitive — editing code and answering with quotes: the answer copies long spans of the prompt,
      where n-gram lookup shines;
  (b) open chat — little to copy.
Per proposer and k: decode tok/s (output tokens after the first, over the time after the first token),
acceptance rate (accepted / proposed tokens), mean accepted length (tokens per verified step) and the
speedup over plain decoding measured in the same run. Requests run one at a time by default (the latency
regime speculation targets); `--batch` runs them together.

    python bench/spec_decode.py [--max-tokens 96] [--configs none ngram:2 ngram:4 self:4:8] [--batch 1]

A config is `method[:k[:extra]]`; extra is ngram_min (ngram), draft_layers (self) or the draft model path.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.outputs import RequestDelta
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.loader import load_model

CODE = """def parse_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
"""

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    '"We expect the lanes to cut commuting times by a third," said the transport director, Maria Lopez. '
    "Shop owners were divided: some feared losing parking spaces, others hoped for more customers on foot. "
    '"Nobody walks past my shop when cars are parked in front of it," said baker Tom Reed. '
    "The council will vote on the final plan next month."
)

REPETITIVE = [
    f"Rename the variable `config` to `settings` in this function and return the whole function:\n\n{CODE}",
    f"Add a docstring to this function and repeat the full code:\n\n{CODE}",
    f"Summarise the article, quoting the two people exactly.\n\n{ARTICLE}",
]
OPEN_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for learning a new language? Explain each briefly.",
    "Describe a walk through a forest in autumn.",
]


@dataclass(frozen=True, slots=True)
class Result:
    workload: str
    config: str
    decode_tps: float
    acceptance: float | None
    mean_len: float | None
    tokens: list[list[int]]


def parse_config(text: str) -> tuple[str, SpeculativeConfig]:
    parts = text.split(":")
    method = parts[0]
    if method == "none":
        return text, SpeculativeConfig()
    k = int(parts[1]) if len(parts) > 1 else 3
    extra: dict[str, object] = {}
    if len(parts) > 2:
        if method == "self":
            extra["draft_layers"] = int(parts[2])
        elif method == "ngram":
            extra["ngram_min"] = int(parts[2])
        else:
            extra["draft_model"] = parts[2]
    return text, SpeculativeConfig(method=method, num_speculative_tokens=k, **extra)  # type: ignore[arg-type]


def run(loaded, spec: SpeculativeConfig, prompts: list[list[int]], max_tokens: int, batch: int):
    llm = LLM(config=RuntimeConfig(speculative=spec), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[0][:32], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    decode_time, decode_tokens, outputs = 0.0, 0, []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        first: list[float] = []

        def on_step(outs: list[RequestDelta], first: list[float] = first) -> None:
            if not first and outs:
                first.append(time.perf_counter())

        results = [r.outputs[0] for r in llm.generate(group, params, use_tqdm=False, on_step=on_step)]
        decode_time += time.perf_counter() - first[0]
        decode_tokens += sum(len(r.token_ids) - 1 for r in results)
        outputs += [r.token_ids for r in results]
    stats = llm.engine.stats()
    return (
        decode_tokens / decode_time,
        stats.spec_decode_acceptance_rate,
        stats.spec_decode_mean_accepted_length,
        outputs,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--configs", nargs="+", default=["none", "ngram:2", "ngram:4", "ngram:4:3", "self:3:26"])
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "chat"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args()

    model_config = ModelConfig(**({"model": args.model} if args.model else {}), device=args.device)
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    loaded = load_model(model_config, device)
    workloads = {"repetitive": REPETITIVE, "chat": OPEN_CHAT}
    configs = [parse_config(c) for c in args.configs]
    if configs[0][0] != "none":
        configs.insert(0, parse_config("none"))

    print(f"model={loaded.name} device={device} max_tokens={args.max_tokens} batch={args.batch}")
    print(
        f"{'workload':<11} {'config':<14} {'decode tok/s':>12} {'speedup':>8} {'accept':>7} {'mean len':>8}  same"
    )
    for workload in args.workloads:
        chats = [[{"role": "user", "content": p}] for p in workloads[workload]]
        prompts = [
            loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(c), add_special_tokens=False)
            for c in chats
        ]
        baseline: Result | None = None
        for name, spec in configs:
            tps, acc, mean_len, tokens = run(loaded, spec, prompts, args.max_tokens, args.batch)
            result = Result(workload, name, tps, acc, mean_len, tokens)
            if baseline is None:
                baseline = result
            speedup = result.decode_tps / baseline.decode_tps
            # Greedy speculation must not change a single token.
            same = "yes" if result.tokens == baseline.tokens else "NO"
            acc_s = f"{acc:.2f}" if acc is not None else "-"
            len_s = f"{mean_len:.2f}" if mean_len is not None else "-"
            print(f"{workload:<11} {name:<14} {tps:>12.1f} {speedup:>7.2f}x {acc_s:>7} {len_s:>8}  {same}")


if __name__ == "__main__":
    main()
