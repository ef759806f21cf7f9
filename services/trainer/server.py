"""The TrainerService servicer: reports the loop's progress."""

from __future__ import annotations

from rlmesh.rpc.prometheus import Families
from rlmesh.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.loop import TrainingStatus

STEP_METRICS = {
    "step_seconds": "Duration of the last training step (rollout wait, training and publishing).",
    "rollout_wait_seconds": "Time the last step waited for rollouts.",
    "reward": "Mean reward of the last step's samples.",
    "exact_match": "Share of the last step's samples that solved their prompt.",
    "kl": "KL to the reference policy in the last step.",
    "loss": "Policy loss of the last step.",
    "grad_norm": "Gradient norm of the last step.",
    "staleness_mean": "Mean staleness, in versions, of the last step's tokens.",
    "staleness_max": "Largest staleness, in versions, of the last step's tokens.",
    "behaviour_kl": "KL between the sampling policy and the proximal one in the last step.",
    "publish_seconds": "Time the last step took to publish its version.",
    "generated_tokens_per_second": "Tokens the last step's samples held, per second of the step.",
}
"""Figures of the last step exported as gauges (rlmesh_trainer_<name>), when the step reported them."""


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

    async def collect_metrics(self, families: Families) -> None:
        """What Prometheus scrapes: progress and the last step's figures."""
        status = await self.GetTrainingStatus(trainer_pb2.GetTrainingStatusRequest(), None)
        families.gauge("step", "Training steps completed.", status.step)
        families.gauge("total_steps", "Steps the job trains.", status.total_steps)
        families.gauge("weight_version", "Weight version of the policy.", status.weight_version)
        families.gauge(
            "phase",
            "Phase of the run (the trainer.v1.Phase number, named by the label).",
            status.phase,
            phase=trainer_pb2.Phase.Name(status.phase),
        )
        for name, documentation in STEP_METRICS.items():
            if name in status.metrics:
                families.gauge(name, documentation, status.metrics[name])
