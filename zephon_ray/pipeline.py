"""Build the Zephon pipeline that a recipe describes, for one Zephon rank.

Every producer, every in-process source and every local-mode trainer rank builds its pipeline here, so a lane's
microbatch sequence is the same function of the recipe everywhere. Only the rank identity
(:class:`ZephonRank`) varies, and by Zephon's design it changes which lanes a pipeline owns, never what a lane
contains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from zephon_ray.recipe import Recipe
from zephon_ray.tokenizers import build_tokenizer

# Zephon logs one line per lane per flush when wrap-packing drops a trailing partial bin. That is expected and
# deterministic for every recipe here; keep it out of users' terminals.
logging.getLogger("zephon").setLevel(logging.ERROR)


@dataclass(frozen=True)
class ZephonRank:
    """Who this pipeline is inside one collective checkpoint group.

    ``groups`` data-parallel groups split the recipe's lanes contiguously; this pipeline is group ``group``.
    With ``groups > 1`` Zephon's ``checkpoint()`` is collective and needs ``run_id`` and exactly one of
    ``aggregate_store`` and ``aggregate_dir``.
    """

    groups: int = 1
    group: int = 0
    run_id: str | None = None
    aggregate_store: str | None = None
    aggregate_dir: str | None = None
    aggregate_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.groups < 1 or not 0 <= self.group < self.groups:
            raise ValueError(f"ZephonRank: group {self.group} is not in [0, {self.groups})")
        if self.groups > 1:
            if not self.run_id:
                raise ValueError("ZephonRank: a distributed Zephon rank (groups > 1) needs a run_id")
            if (self.aggregate_store is None) == (self.aggregate_dir is None):
                raise ValueError(
                    "ZephonRank: a distributed Zephon rank needs exactly one of aggregate_store and aggregate_dir"
                )

    def owned_lanes(self, lanes: int) -> tuple[int, ...]:
        """Zephon's contiguous mapping: group g owns lanes [g*L/G, (g+1)*L/G)."""
        if lanes % self.groups:
            raise ValueError(f"{self.groups} Zephon ranks do not divide {lanes} lanes")
        per = lanes // self.groups
        return tuple(range(self.group * per, (self.group + 1) * per))


def build_pipeline(recipe: Recipe, rank: ZephonRank = ZephonRank()) -> Any:
    from zephon import Pipeline
    from zephon.io import Dataset
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    rank.owned_lanes(recipe.lanes)  # validates divisibility before Zephon only warns about it
    datasets = [Dataset.from_path(s.name, str(s.path), fmt=s.format) for s in recipe.sources]
    work = StaticMixtureWorkSource(
        datasets,
        MixtureSpec({s.name: s.weight for s in recipe.sources}),
        chunk_size=recipe.chunk_size,
        seed=recipe.seed,
        shuffle_shards=recipe.shuffle.shards,
        shuffle_within_shard=recipe.shuffle.within_shard,
        exhausted_policy="repeat" if recipe.repeat else None,
        reshuffle_on_repeat=recipe.shuffle.reshuffle_on_repeat,
    )
    tokenizer = build_tokenizer(recipe.tokenizer)
    pipeline = Pipeline(work)
    if recipe.pretokenized is None:
        pipeline = pipeline.decode_text().tokenize(
            tokenizer=tokenizer, field=recipe.text_field, return_tensors="np", add_attention_mask=False)
        tokens_field = "auto"
    else:
        # Token-id copies written by zephon_ray.jobs.pretokenize hold exactly what decode_text + tokenize emit.
        from zephon_ray.jobs.pretokenize import TOKEN_FIELD

        tokens_field = TOKEN_FIELD
    pipeline = (
        pipeline
        .pack_flat(
            max_length=recipe.row_length,
            algorithm=recipe.packing,
            num_bins=recipe.packing_bins,
            tokens_field=tokens_field,
            pad_token_id=tokenizer.pad_token_id,
            emit_positions=True,
        )
        .batch(recipe.rows_per_microbatch, drop_last=True)
    )
    options: dict[str, Any] = {
        "runner": "threads",
        "deterministic": True,
        # Graceful shutdown joins every worker thread (about 0.5 s); random access closes the iterator often.
        "shutdown_mode": "hard",
        "canonical_replicas": recipe.lanes,
        "mapping_strategy": "contiguous",
        "world_size": rank.groups,
        "global_rank": rank.group,
        "dp_degree": rank.groups,
        "dp_group_id": rank.group,
    }
    if recipe.flush_every_k_chunks is not None:
        options["flush_every_k_chunks"] = recipe.flush_every_k_chunks
    if rank.groups > 1:
        options["run_id"] = rank.run_id
        options["aggregate_timeout_s"] = rank.aggregate_timeout_s
        if rank.aggregate_store is not None:
            options["aggregate_store"] = rank.aggregate_store
        else:
            options["aggregate_dir"] = rank.aggregate_dir
    return pipeline.options(**options)
