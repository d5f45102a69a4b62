"""The three suites: which models are built, what is timed side by side, and the rows that come out.

Each suite is a generator of `Row`s and of strings (what it is about to do, for the progress bar), and
`count_rows` says ahead how many rows it gives. Every group of rows (one `group` name) was timed side
by side in one process: the floor, PEFT and fastlora on the same inputs, interleaved over rounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .cases import (
    BLOCKS,
    Geometry,
    adapt,
    block_inputs,
    block_step,
    build_llama,
    compare_blocks,
    copy_lora,
    decoder_layer,
    free_memory,
    fused_note,
    model_step,
)
from .harness import Clock, Row, Step, graph_stats, peak_memory_mib, time_side_by_side

SUITES = ("blocks", "e2e", "sweep")
SWEEP_BLOCKS = ("mlp", "qkv")
# The sweep's layout is the anchors' (anchors_sweep.json): bf16 base, PEFT's default fp32 adapters
# (`sweep_adapter`: unless the run's adapters leave fp32 out).
SWEEP_BASE, SWEEP_ADAPTER = "bf16", "fp32"
BLOCK_MODEL_VOCAB = 128  # block models never run their embeddings: keep them small

Event = Row | str
Key = tuple[str, str]  # (provider, adapter)


@dataclass(frozen=True)
class Settings:
    geo: Geometry
    device: torch.device
    bases: tuple[str, ...]
    adapters: tuple[str, ...]
    warmup: int  # blocks and sweeps, per provider
    repeats: int  # timed iterations per provider per round
    rounds: int
    e2e_warmup: int
    e2e_repeats: int

    def provider_keys(self) -> list[Key]:
        return [("floor", "none")] + [(p, a) for a in self.adapters for p in ("peft", "fastlora")]


def count_rows(suite: str, s: Settings) -> int:
    if suite == "blocks":
        return len(s.bases) * len(BLOCKS) * len(s.provider_keys())
    if suite == "e2e":
        return len(s.bases) * len(s.provider_keys())
    return 3 * len(SWEEP_BLOCKS) * (len(s.geo.sweep_tokens) + len(s.geo.sweep_ranks))


def run_suite(suite: str, s: Settings) -> Iterator[Event]:
    return {"blocks": blocks_suite, "e2e": e2e_suite, "sweep": sweep_suite}[suite](s)


def measure(
    steps: dict[Key, Step], s: Settings, *, warmup: int, repeats: int, per_key: dict[Key, dict], **common
) -> Iterator[Row]:
    """Times the steps side by side, then takes each one's peak memory and graph size; one row each."""
    clock = Clock(s.device)
    named = {f"{provider}/{adapter}": step for (provider, adapter), step in steps.items()}
    timings = time_side_by_side(named, clock, warmup=warmup, repeats=repeats, rounds=s.rounds)
    for (provider, adapter), step in steps.items():
        peak = peak_memory_mib(step, s.device)
        nodes, custom = graph_stats(step)
        yield Row.timed(
            timings[f"{provider}/{adapter}"],
            provider=provider,
            adapter=adapter,
            peak_mib=peak,
            graph_nodes=nodes,
            custom_fn_nodes=custom,
            **common,
            **per_key.get((provider, adapter), {}),
        )


def _adapted(s: Settings, key: Key, *, base: str, rank: int, layers: int = 1, vocab: int = BLOCK_MODEL_VOCAB):
    provider, adapter = key
    model = build_llama(s.geo, layers=layers, vocab=vocab, base=base, device=s.device)
    alpha = s.geo.alpha * rank // s.geo.rank  # same alpha / r as the main runs
    return adapt(model, provider, adapter, rank, alpha)


def _block_extras(models: dict[Key, object], block: str, x, grad_outs, rank: int) -> dict[Key, dict]:
    """Rank, fastlora's route note, and (fastlora rows) the errors against PEFT on the same inputs."""
    extras: dict[Key, dict] = {}
    for (provider, adapter), model in models.items():
        extras[(provider, adapter)] = {"rank": 0 if provider == "floor" else rank, "note": fused_note(model)}
        if provider == "fastlora":  # correctness beside speed: the same function as PEFT's?
            errors = compare_blocks(models[("peft", adapter)], model, block, x, grad_outs)
            extras[(provider, adapter)].update(errors)
    return extras


def blocks_suite(s: Settings) -> Iterator[Event]:
    """o_proj, q/k/v, MLP of one Llama layer at batch x seq tokens, each base with each adapter dtype."""
    geo = s.geo
    for base in s.bases:
        yield f"blocks {base}: building models"
        models = {key: _adapted(s, key, base=base, rank=geo.rank) for key in s.provider_keys()}
        for adapter in s.adapters:
            copy_lora(models[("peft", adapter)], models[("fastlora", adapter)])
        for block in BLOCKS:
            yield f"blocks {base} {block}"
            x, grad_outs = block_inputs(geo, block, geo.batch, geo.seq, s.device)
            per_key = _block_extras(models, block, x, grad_outs, geo.rank)
            steps = {
                key: block_step(decoder_layer(model), block, x, grad_outs) for key, model in models.items()
            }
            yield from measure(
                steps, s, warmup=s.warmup, repeats=s.repeats, per_key=per_key,
                suite="blocks", group=f"blocks/{base}/{block}", case=block, base=base, tokens=geo.tokens,
            )  # fmt: skip
            del x, grad_outs, steps
        del models
        free_memory()


def e2e_suite(s: Settings) -> Iterator[Event]:
    """One training step (forward, loss, backward, AdamW, zero_grad) of the whole multi-layer model."""
    geo = s.geo
    generator = torch.Generator(device=s.device).manual_seed(3)
    input_ids = torch.randint(0, geo.vocab, (geo.batch, geo.seq), generator=generator, device=s.device)
    for base in s.bases:
        models, steps, per_key = {}, {}, {}
        for key in s.provider_keys():
            yield f"e2e {base}: building {key[0]} ({key[1]} adapters)"
            models[key] = _adapted(s, key, base=base, rank=geo.rank, layers=geo.layers, vocab=geo.vocab)
            steps[key] = model_step(models[key], input_ids, key[0])
            per_key[key] = {"rank": 0 if key[0] == "floor" else geo.rank, "note": fused_note(models[key])}
        yield f"e2e {base}: timing"
        yield from measure(
            steps, s, warmup=s.e2e_warmup, repeats=s.e2e_repeats, per_key=per_key,
            suite="e2e", group=f"e2e/{base}", case="model", base=base, tokens=geo.tokens,
        )  # fmt: skip
        del models, steps
        free_memory()


def sweep_adapter(adapters: tuple[str, ...]) -> str:
    """The sweep's one adapter dtype: fp32 (the anchors') where the run has it, else the run's first,
    so `--adapters bf16` sweeps bf16 adapters rather than fp32 ones it was not asked for."""
    return SWEEP_ADAPTER if SWEEP_ADAPTER in adapters else adapters[0]


def sweep_suite(s: Settings) -> Iterator[Event]:
    """MLP and QKV at batch 1: tokens from hundreds to 32k at the main rank, then rank at one size."""
    geo = s.geo
    adapter = sweep_adapter(s.adapters)
    floor_key = ("floor", "none")
    floor = _adapted(s, floor_key, base=SWEEP_BASE, rank=geo.rank)
    for rank in [geo.rank] + [r for r in geo.sweep_ranks if r != geo.rank]:  # the token sweep first
        yield f"sweep: building rank {rank}"
        keys = [("peft", adapter), ("fastlora", adapter)]
        models = {floor_key: floor, **{key: _adapted(s, key, base=SWEEP_BASE, rank=rank) for key in keys}}
        copy_lora(models[keys[0]], models[keys[1]])
        per_key = {
            key: {"rank": 0 if key == floor_key else rank, "note": fused_note(m)} for key, m in models.items()
        }
        points = [("sweep-tokens", tokens) for tokens in geo.sweep_tokens if rank == geo.rank]
        points += [("sweep-rank", geo.sweep_rank_tokens)] if rank in geo.sweep_ranks else []
        for suite, tokens in points:
            for block in SWEEP_BLOCKS:
                yield f"{suite} {block} r{rank} {tokens} tokens"
                x, grad_outs = block_inputs(geo, block, 1, tokens, s.device)
                steps = {key: block_step(decoder_layer(m), block, x, grad_outs) for key, m in models.items()}
                group = f"{suite}/{block}/" + (f"t{tokens}" if suite == "sweep-tokens" else f"r{rank}")
                yield from measure(
                    steps, s, warmup=s.warmup, repeats=s.repeats, per_key=per_key,
                    suite=suite, group=group, case=block, base=SWEEP_BASE, tokens=tokens,
                )  # fmt: skip
                del x, grad_outs, steps
                free_memory()  # 32k tokens leave GiBs in the cache; the next size starts clean
        del models
        free_memory()
