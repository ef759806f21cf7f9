"""The TrainerService servicer: reports the loop's progress."""

from __future__ import annotations

from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.trainer import TrainingStatus


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, status: TrainingStatus) -> None:
        self.status = status

    async def GetTrainingStatus(self, request, context):
        status = self.status
        return trainer_pb2.GetTrainingStatusResponse(
            phase=status.phase,
            step=status.step,
            total_steps=status.total_steps,
            weight_version=status.version,
            metrics=status.metrics,
            output_dir=status.output_dir,
            error=status.error,
        )
