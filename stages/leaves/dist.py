"""`Dist`: the ranks a stage runs on (this process's rank, the world size, the device, the DeepSpeed
config) and the few collectives the stages use. A leaf module, so the training helpers that take a
`Dist` (the engine, the non-finite guard, checkpoints) need not import `stages.orchestration.launch`, which
starts the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    deepspeed_config: dict | None = None
    device: str = "cpu"
    workdir: Path | None = None  # the stage's local folder (checkpoints), the same on every rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def zero_stage(self) -> int | str:
        """The ZeRO stage these ranks train under, or "none" (plain PyTorch)."""
        return (self.deepspeed_config or {}).get("zero_optimization", {}).get("stage", "none")

    @property
    def offloads_optimizer(self) -> bool:
        """Whether the DeepSpeed config keeps the optimiser's state on the host (ZeRO-Offload)."""
        zero = (self.deepspeed_config or {}).get("zero_optimization", {})
        return zero.get("offload_optimizer", {}).get("device", "none") == "cpu"

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        import torch  # deferred: the flow builds a Dist for an in-process stage without loading torch
        import torch.distributed as torch_dist

        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(tensor)
        return tensor.tolist()

    def gather_rows(self, count: int, columns: dict[str, list[float]]) -> dict[str, list[float]]:
        """Whole columns of `count` rows, in row order, from each rank's strided share
        (`rows[rank::world_size]`): every rank fills its positions of zeroed columns, ranks sum."""
        flat = []
        for values in columns.values():
            full = [0.0] * count
            for position, value in zip(range(self.rank, count, self.world_size), values):
                full[position] = float(value)
            flat += full
        summed = self.all_reduce_sum(flat)
        return {name: summed[k * count : (k + 1) * count] for k, name in enumerate(columns)}

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as torch_dist  # deferred: as in all_reduce_sum

            torch_dist.barrier()
