"""Decode throughput of multi-turn episodes whose tool takes a second, against the same episodes
with an instant tool (docs/design.md §15): a slot waiting on its tool leaves the batch to the
others, so continuous batching goes on. Each side keeps ``--episodes`` episodes in flight on
one sampler of ``--slots`` slots for ``--seconds`` (a finished episode is replaced at once) and
counts the model tokens sampled; the ratio is printed with the load.
``.venv/bin/python benchmarks/tool_wait.py [--tool-s 1.0 --slots 32 --episodes 256]``"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402,F401  (the repository on sys.path, JAX on the CPU)
import _timing  # noqa: E402

log = logging.getLogger("benchmarks.tool_wait")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool-s", type=float, default=1.0, help="seconds each tool call takes")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--episodes", type=int, default=256, help="episodes kept in flight")
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per side")
    p.add_argument("--warmup-s", type=float, default=15.0, help="untimed compile seconds")
    p.add_argument("--turn-tokens", type=int, default=48, help="a turn's token budget")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def ending_turns(policy: Any, lean: float = 0.05) -> Any:
    """``policy`` with every hidden state leaning along one axis that only its eos (the chat
    tokenizer's <|im_end|>) reads: a random model's sampled turns end after tens of tokens
    instead of running to their budget, as a chat model's do."""
    params = policy.params
    eos = policy.tokenizer.eos_token_id
    emb = params["embed_tokens"]["embedding"]
    emb[...] = emb[...].at[:, 0].set(lean)
    head = params["lm_head"]["kernel"]
    head[...] = head[...].at[0, :].set(0.0).at[0, eos].set(1.0)
    return policy.with_params(params)


class SlowTool:
    """An environment whose every step takes ``tool_s`` and answers briefly; it never ends an
    episode (``max_turns`` does)."""

    tools = [{"type": "function", "function": {"name": "wait", "description": "waits",
                                               "parameters": {"type": "object"}}}]  # fmt: skip

    def __init__(self, tool_s: float = 1.0) -> None:
        self.tool_s = tool_s

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: str) -> Any:
        from rlax_tasks.environments import StepResult

        time.sleep(self.tool_s)
        return StepResult(({"role": "tool", "content": f"ok {len(turn)}"},), False, 0.0, {})


def run_side(
    policy: Any, tool_s: float, args: argparse.Namespace, seconds: float | None = None
) -> dict[str, float]:
    """Model tokens per second with ``args.episodes`` episodes in flight for ``seconds``
    (``args.seconds``), after as long again for the population to reach steady state."""
    from rlax_tasks.environments import EnvironmentSpec, environment_names, register
    from rlax_tasks.rollout import Sampler, SamplingParams
    from rlax_tasks.rollout.episodes import EpisodeDriver

    if "benchmark-slow-tool" not in environment_names():
        register("benchmark-slow-tool", SlowTool)
    spec = EnvironmentSpec("benchmark-slow-tool", max_turns=4, tool_timeout_s=tool_s + 10,
                           max_observation_tokens=32, settings={"tool_s": tool_s})  # fmt: skip
    sampler = Sampler(policy, max_slots=args.slots, max_len=512, decode_chunk=8)
    driver = EpisodeDriver(sampler)
    params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0)
    started = 0

    def start() -> None:
        nonlocal started
        p = SamplingParams(**{**vars(params), "seed": started})
        driver.start(("e", started), spec, {"prompt": f"{started % 97}+{started % 89}=?"}, p)
        started += 1

    def run_for(seconds: float) -> tuple[int, float]:
        t0, generated = time.perf_counter(), sampler.stats.generated_tokens
        while time.perf_counter() - t0 < seconds:
            while len(driver.episodes) < args.episodes:
                start()
            for c in sampler.step() if sampler.has_unfinished else []:
                driver.on_turn(c)
            driver.poll()
            if not sampler.has_unfinished:
                time.sleep(0.001)  # every slot waits on its tool
        return sampler.stats.generated_tokens - generated, time.perf_counter() - t0

    seconds = args.seconds if seconds is None else seconds
    run_for(seconds)  # the episodes in flight reach their steady mix of turns
    tokens, seconds = run_for(seconds)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "episodes_started": started,
        "evicted": sampler.stats.evicted,
        "extended_tokens": sampler.stats.extended_tokens,
        "prefilled_tokens": sampler.stats.prefilled_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    _timing.setup_logging()
    args = parse_args(argv)
    load_before = _timing.machine_load(log, "before")
    from rlax_tasks.models import ModelConfig, Policy
    from rlax_tasks.models.tokenizer import chat_char_tokenizer

    tok = chat_char_tokenizer()
    config = ModelConfig(
        model_type="qwen2", vocab_size=len(tok), hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    policy = ending_turns(Policy.init(config, seed=0, tokenizer=tok))
    # both sides' programs compile first (one shared cache): neither pays for them when timed
    for tool_s in (0.0, args.tool_s):
        run_side(policy, tool_s, args, seconds=args.warmup_s)
    results = {}
    for name, tool_s in (("instant tool", 0.0), (f"{args.tool_s:g} s tool", args.tool_s)):
        results[name] = run_side(policy, tool_s, args)
        log.info("%s: %.0f model tokens/s (%s)", name, results[name]["tokens_per_s"],
                 {k: round(v, 1) for k, v in results[name].items()})  # fmt: skip
    load_after = _timing.machine_load(log, "after")
    instant, slow = results.values()
    ratio = slow["tokens_per_s"] / instant["tokens_per_s"]
    mark = _timing.contended_mark(load_before, load_after)
    print(f"decode tokens/s with a {args.tool_s:g} s tool / with an instant one: {ratio:.2f} "
          f"({slow['tokens_per_s']:.0f} / {instant['tokens_per_s']:.0f}; {args.slots} slots, "
          f"{args.episodes} episodes in flight){mark}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratio": ratio,
                       "machine_load": [load_before, load_after]}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
