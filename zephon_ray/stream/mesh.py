"""The non-data-parallel peers of a rank: the TP/PP/CP ranks that share its ``dp_rank`` and so its slice.

TorchTitan hands the loader only ``dp_world_size`` and ``dp_rank`` (the "batch" mesh); with tensor, pipeline or
context parallelism, ``world_size / dp_world_size`` ranks share each dp_rank and must train on the same rows. In
local mode exactly one of them (the *leader*: the lowest global rank) runs the Zephon rank for that dp_rank, so the
collective Zephon checkpoint has exactly ``dp_world_size`` members; the leader sends every step's slice, and the
loader state, to its peers over a gloo group of the ranks sharing the dp_rank.

Guarantee: every rank of a dp group gets bit-identical slices and an identical loader state (the peers receive the
leader's arrays and state; nothing is recomputed), also across a resume at another dp.

Limits: building the groups is collective over the whole job (every rank builds its loader at the same point, as
TorchTitan's Trainer does); so is every step's broadcast and every ``state_dict``, which TorchTitan calls on every
rank. A peer waits for its leader at most the process group's timeout. The dp ranks are learnt from the ranks
themselves (an all-gather of ``dp_rank``), not from ``WORLD_SIZE`` or from a mesh layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_OK, _FAILED = 1, 0


class PeerError(RuntimeError):
    """The leader of this rank's dp group failed; the peers get this instead of a hang."""


@dataclass(frozen=True)
class DpPeers:
    """This rank's dp group: the global ranks sharing its dp_rank, the leader, and a gloo group of them."""

    dp_rank: int
    ranks: tuple[int, ...]
    leader: int
    me: int
    group: Any

    @property
    def is_leader(self) -> bool:
        return self.me == self.leader

    # ------------------------------------------------------------------ collectives within the dp group
    def share_slice(
        self,
        step: int,
        tokens: np.ndarray | None,
        positions: np.ndarray | None,
        shape: tuple[int, int],
        error: BaseException | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Leader: send ``tokens``/``positions`` (or ``error``); peer: receive them. Collective in the group."""
        import torch.distributed as dist

        header = torch.tensor([_OK if error is None else _FAILED, step], dtype=torch.int64)
        dist.broadcast(header, src=self.leader, group=self.group)
        if int(header[0]) != _OK:
            if self.is_leader and error is not None:
                raise error
            raise PeerError(
                f"rank {self.me}: the leader of dp group {self.dp_rank} (global rank {self.leader}) "
                f"failed at step {int(header[1])}; see its log"
            )
        if int(header[1]) != step:
            raise PeerError(
                f"rank {self.me}: the leader of dp group {self.dp_rank} sent step {int(header[1])}, "
                f"this rank expected step {step}"
            )
        rows = torch.empty((2, *shape), dtype=torch.int32)
        if self.is_leader:
            view = rows.numpy()
            view[0], view[1] = tokens, positions
        dist.broadcast(rows, src=self.leader, group=self.group)
        if self.is_leader:
            assert tokens is not None and positions is not None  # the leader sends its rows
            return tokens, positions
        return rows[0].numpy(), rows[1].numpy()

    def share_object(self, value: Any) -> Any:
        """Leader: send ``value`` (picklable, e.g. the JSON-safe loader state); peer: receive it."""
        import torch.distributed as dist

        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


def dp_peers(*, dp_rank: int, dp_world_size: int) -> DpPeers | None:
    """The dp group of this rank, or None when every rank is its own dp group (or torch.distributed is off).

    Collective over the default process group when ``world_size > dp_world_size``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world, me = dist.get_world_size(), dist.get_rank()
    if world == dp_world_size:
        return None
    if world % dp_world_size:
        raise ValueError(f"the data-parallel degree {dp_world_size} does not divide the {world} ranks of this job")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (int(dp_rank), int(dp_world_size)))
    degrees = {d for _, d in gathered}
    if degrees != {dp_world_size}:
        raise ValueError(f"ranks disagree on the data-parallel degree: {sorted(degrees)}")
    groups = [tuple(g for g, (r, _) in enumerate(gathered) if r == d) for d in range(dp_world_size)]
    sizes = {len(g) for g in groups}
    if sizes != {world // dp_world_size}:
        raise ValueError(f"dp groups of unequal size: {groups} (each dp_rank needs {world // dp_world_size} ranks)")
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo")
    ranks = groups[dp_rank]
    return DpPeers(dp_rank=dp_rank, ranks=ranks, leader=ranks[0], me=me, group=mine)
