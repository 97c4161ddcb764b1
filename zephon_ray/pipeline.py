"""Build the Zephon pipeline that a recipe describes, for one lane group.

Usage: the steppers (:mod:`zephon_ray.lanes`) build through it; nothing else builds a Zephon pipeline.

Guarantee: every producer, every in-process source and every local-mode reader builds its pipeline here, so a lane's
microbatch sequence is the same function of the recipe everywhere. Only the lane group (:class:`LaneGroup`)
varies, and by Zephon's design it changes which lanes a pipeline owns, never what a lane contains. Limits: the
tokenizer is always one of :mod:`zephon_ray.tokenizers` (Zephon's hash fallback is unreachable), and L is fixed by
the recipe for the life of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from zephon_ray.log_filters import quiet_known_noise
from zephon_ray.recipe import Recipe
from zephon_ray.tokenizers import build_tokenizer
from zephon_ray.zephon_io import pipeline_io_options

if TYPE_CHECKING:
    from zephon.ops.config import PackingAlgorithm

# Zephon logs one line per lane per flush when wrap-packing drops a trailing partial bin: expected and deterministic
# for every recipe here. Only that exact line is filtered (log_filters.py says why); Zephon's other warnings still show.
quiet_known_noise()


@dataclass(frozen=True)
class LaneGroup:
    """Lane group ``index`` of ``count``: one Zephon participant, owning lanes [index*L/count, (index+1)*L/count).

    A producer, a materialise worker and a local-mode reader are each one lane group. With ``count > 1`` Zephon's
    ``checkpoint()`` is collective and needs ``run_id`` and exactly one of ``aggregate_store`` and
    ``aggregate_dir`` (Zephon calls a lane group a data-parallel group of its ``world_size``).
    """

    count: int = 1
    index: int = 0
    run_id: str | None = None
    aggregate_store: str | None = None
    aggregate_dir: str | None = None
    aggregate_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"LaneGroup: index {self.index} is not in [0, {self.count})")
        if self.count > 1:
            if not self.run_id:
                raise ValueError("LaneGroup: one of several lane groups (count > 1) needs a run_id")
            if (self.aggregate_store is None) == (self.aggregate_dir is None):
                raise ValueError(
                    "LaneGroup: one of several lane groups needs exactly one of aggregate_store and aggregate_dir"
                )

    def owned_lanes(self, lanes: int) -> tuple[int, ...]:
        """Zephon's contiguous mapping: lane group g of G owns lanes [g*L/G, (g+1)*L/G)."""
        if lanes % self.count:
            raise ValueError(f"{self.count} lane groups do not divide {lanes} lanes")
        per = lanes // self.count
        return tuple(range(self.index * per, (self.index + 1) * per))


def build_work_source(recipe: Recipe, segment: int = 0, start_state: dict[str, Any] | None = None) -> Any:
    """The Zephon work source of mixture segment ``segment`` (0: the sources' weights; i: ``recipe.phases[i-1]``),
    unbound. ``start_state``: the global chunk stream's state where the segment starts (None: a fresh stream). With
    no start state and all weights > 0 this is exactly the pre-phase work source; otherwise the stream's state is
    loaded with the segment's weights through the Zephon fence (zephon_io), which also admits weight 0."""
    from zephon.io import Dataset
    from zephon.work import MixtureSpec, StaticMixtureWorkSource

    from zephon_ray.zephon_io import load_work_source_state

    weights = recipe.segment_weights(segment)
    plain = start_state is None and all(w > 0 for w in weights)
    datasets = [Dataset.from_path(s.name, str(s.path), fmt=s.format) for s in recipe.sources]
    work = StaticMixtureWorkSource(
        datasets,
        # Zephon's MixtureSpec refuses weight 0: a placeholder, replaced by load_work_source_state below.
        MixtureSpec({s.name: (s.weight if plain else 1.0) for s in recipe.sources}),
        chunk_size=recipe.chunk_size,
        seed=recipe.seed,
        shuffle_shards=recipe.shuffle.shards,
        shuffle_within_shard=recipe.shuffle.within_shard,
        exhausted_policy="repeat" if recipe.repeat else None,
        reshuffle_on_repeat=recipe.shuffle.reshuffle_on_repeat,
    )
    if not plain:
        load_work_source_state(
            work, start_state if start_state is not None else work.state_dict(), dict(zip(recipe.source_names, weights))
        )
    return work


def build_pipeline(
    recipe: Recipe, group: LaneGroup = LaneGroup(), work: Any = None, *, before_packing: Any = None
) -> Any:
    """The recipe's pipeline for ``group``'s lanes, drawing from ``work`` (default: segment 0's work source).
    ``before_packing``: ``pipeline -> pipeline``, applied to the tokenised records just before ``pack_flat``
    (:mod:`zephon_ray.provenance` adds its per-token fields there; None on every batch-producing path)."""
    from zephon import Pipeline

    group.owned_lanes(recipe.lanes)  # validates divisibility before Zephon only warns about it
    if work is None:
        work = build_work_source(recipe)
    tokenizer = build_tokenizer(recipe.tokenizer)
    pipeline = Pipeline(work)
    if recipe.pretokenized is None:
        pipeline = pipeline.decode_text().tokenize(
            tokenizer=tokenizer, field=recipe.text_field, return_tensors="np", add_attention_mask=False
        )
        tokens_field = "auto"
    else:
        # Token-id copies written by zephon_ray.jobs.pretokenize hold exactly what decode_text + tokenize emit.
        from zephon_ray.pretokenized_manifest import TOKEN_FIELD

        tokens_field = TOKEN_FIELD
    if before_packing is not None:
        pipeline = before_packing(pipeline)
    pipeline = pipeline.pack_flat(
        max_length=recipe.row_length,
        algorithm=cast("PackingAlgorithm", recipe.packing),  # the recipe checks it is one
        num_bins=recipe.packing_bins,
        tokens_field=tokens_field,
        pad_token_id=tokenizer.pad_token_id,
        emit_positions=True,
    ).batch(recipe.rows_per_microbatch, drop_last=True)
    options: dict[str, Any] = {
        "runner": "threads",
        "deterministic": True,
        # Graceful shutdown joins every worker thread (about 0.5 s); random access closes the iterator often.
        "shutdown_mode": "hard",
        "canonical_replicas": recipe.lanes,
        "mapping_strategy": "contiguous",
        "world_size": group.count,
        "global_rank": group.index,
        "dp_degree": group.count,
        "dp_group_id": group.index,
    }
    if recipe.flush_every_k_chunks is not None:
        options["flush_every_k_chunks"] = recipe.flush_every_k_chunks
    options.update(pipeline_io_options(s.path for s in recipe.sources))  # Zephon's shard cache for s3:// sources
    if group.count > 1:
        options["run_id"] = group.run_id
        options["aggregate_timeout_s"] = group.aggregate_timeout_s
        if group.aggregate_store is not None:
            options["aggregate_store"] = group.aggregate_store
        else:
            options["aggregate_dir"] = group.aggregate_dir
    return pipeline.options(**options)
