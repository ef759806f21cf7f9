"""The manager's domain modules built one by one, without the ManagerState facade: instances as plain
records (no registry), the admission rules, the request table, and the scheduler and delivery over them."""

from __future__ import annotations

from collections.abc import Callable

from rlmesh.common.v1 import common_pb2
from services.manager.domain.admission import Admission, Prompt
from services.manager.domain.delivery import Delivery
from services.manager.domain.dispatch_policy import PolicyName, dispatch_policy
from services.manager.domain.journaled import ChangeTracker
from services.manager.domain.records import Batch, Instance
from services.manager.domain.request_table import RequestTable
from services.manager.domain.scheduling import Scheduler


def instance(instance_id: str, weight_version: int = 0, max_batch_size: int = 64, port: int = 1000) -> Instance:
    """An instance as a registration at time 0 leaves it (lease of 10 s, no version to wait for)."""
    return Instance(instance_id, f"127.0.0.1:{port}", weight_version, max_batch_size, lease_expires=10.0, min_version=0)


class DomainParts:
    """Instances by id, the batches, and each module of the domain that a test drives directly."""

    def __init__(
        self,
        versions: dict[str, int],
        max_staleness: int = 0,
        policy: PolicyName = "balanced",
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        tracker = ChangeTracker()
        self.instances = {
            instance_id: instance(instance_id, version, port=1000 + index)
            for index, (instance_id, version) in enumerate(versions.items())
        }
        self.batches: dict[str, Batch] = {}
        self.clock = clock
        self.admission = Admission(tracker, max_staleness)
        self.request_table = RequestTable(tracker, self.instances, self.batches, clock)
        self.scheduler = Scheduler(
            self.instances, self.batches, self.request_table, self.admission, dispatch_policy(policy)
        )
        self.delivery = Delivery(self.batches, self.request_table, {}, clock)

    def submit(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[Prompt],
        sampling: common_pb2.SamplingParams,
        exact_version: bool = False,
        background: bool = False,
    ) -> Batch:
        """The batch admitted and its requests queued in the request table."""
        batch = self.admission.admit(
            batch_id, policy_version, prompts, sampling, exact_version, background, self.batches, self.clock()
        )
        self.batches[batch_id] = batch
        self.request_table.add(batch)
        return batch
