"""Admission: which submissions are accepted (validated whole before anything is queued), and when
an accepted sample may enter generation (the staleness gate and the capacity rule)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import ClassVar

from rlmesh.common.v1 import common_pb2
from rlmesh.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from rlmesh.sampling import MAX_SEED, sampling_problem
from services.manager.domain.journaled import COUNTERS, ChangeTracker, Journaled
from services.manager.domain.records import Batch, Instance, SampleRequest

MAX_GROUP_SIZE = 1024
Prompt = tuple[str, list[int], int] | tuple[str, list[int], int, common_pb2.SamplingParams | None]
"""prompt id, token ids, samples (n), and optionally the prompt's own sampling."""


class Admission(Journaled):
    __slots__ = ("tracker", "max_staleness", "published_version")
    JOURNALED: ClassVar[frozenset[str]] = frozenset({"published_version"})
    KIND: ClassVar[str] = COUNTERS

    def __init__(self, tracker: ChangeTracker, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.published_version = 0
        self.tracker = tracker

    def publish(self, version: int) -> None:
        if version < self.published_version:
            raise FailedPrecondition(f"version {version} is older than the published {self.published_version}")
        self.published_version = version

    def admit(
        self,
        batch_id: str,
        policy_version: int,
        prompts: list[Prompt],
        sampling: common_pb2.SamplingParams,
        exact_version: bool,
        background: bool,
        known: Mapping[str, Batch],
        now: float,
        sessions: bool = False,
    ) -> Batch:
        """The batch of n samples per prompt, each prompt with its own sampling if it has one, else
        the batch's; everything is validated before anything is accepted. `sessions`: each sample is
        a multi-turn session, whose prompt may be empty (its first turn appends the tokens)."""
        if not batch_id:
            raise InvalidArgument("batch_id is required")
        if batch_id in known:
            raise AlreadyExists(f"batch {batch_id!r} was already submitted")
        if not prompts:
            raise InvalidArgument("prompts is empty")
        check_sampling(sampling, "sampling")
        if policy_version < 0:
            raise InvalidArgument("policy_version must be >= 0")
        seen: set[str] = set()
        for entry in prompts:
            prompt_id, token_ids, n = entry[:3]
            if not prompt_id or "/" in prompt_id or "@" in prompt_id:
                raise InvalidArgument(f"prompt_id {prompt_id!r} must be non-empty and contain no '/' or '@'")
            if prompt_id in seen:
                raise InvalidArgument(f"prompt_id {prompt_id!r} appears twice in batch {batch_id!r}")
            seen.add(prompt_id)
            if not token_ids and not sessions:
                raise InvalidArgument(f"prompt {prompt_id!r} has no tokens")
            if not 1 <= n <= MAX_GROUP_SIZE:
                raise InvalidArgument(f"prompt {prompt_id!r}: n must be in [1, {MAX_GROUP_SIZE}], got {n}")
            if len(entry) > 3 and entry[3] is not None:
                check_sampling(entry[3], f"prompt {prompt_id!r}: sampling")
        groups: dict[str, list[SampleRequest]] = {}
        for entry in prompts:
            prompt_id, token_ids, n = entry[:3]
            own = entry[3] if len(entry) > 3 and entry[3] is not None else sampling
            groups[prompt_id] = [
                SampleRequest(
                    f"{batch_id}/{prompt_id}/{i}",
                    batch_id,
                    prompt_id,
                    list(token_ids),
                    per_sample_sampling(own, prompt_id, i),
                    policy_version,
                    exact_version,
                    background,
                )
                for i in range(n)
            ]
        return Batch(
            batch_id,
            policy_version,
            groups,
            submitted_at=now,
            exact_version=exact_version,
            background=background,
            sessions=sessions,
        )

    def within_capacity(self, request: SampleRequest) -> bool:
        """The capacity rule (AReaL, SkyRL): a sample enters generation only while
        accepted + running <= (max_staleness + v + 1) * B, v the published version and B the
        samples of a step. A step's batch carries the version it will be trained at, so in
        versions the rule reads: policy_version <= v + max_staleness. Nothing generated is then
        ever older than policy_version - max_staleness when it is trained, and a group a trainer
        drops and refills for the same step stays within the rule: it cannot deadlock."""
        return request.policy_version <= self.published_version + self.max_staleness

    def may_run(self, instance: Instance, request: SampleRequest) -> bool:
        """A training sample: the instance is fresh enough (staleness gate) and the sample within
        the capacity rule. An exact-version sample is not training data, so neither applies: the
        instance must serve exactly its version."""
        if request.exact_version:
            return serves_exactly(instance, request.policy_version)
        return (
            instance.schedulable
            and self.within_capacity(request)
            and instance.weight_version >= request.policy_version - self.max_staleness
        )

    def version_gone(self, version: int, instances: Iterable[Instance]) -> bool:
        """No instance can serve `version` any more: the pool moved past it (a newer version is
        published, served, or an instance refused it as moved on; pushes carry only the latest, and a
        joining instance gets the latest before any work) and no schedulable instance still serves it."""
        instances = list(instances)
        moved_on = self.published_version > version or any(
            i.weight_version > version or i.refused_version >= version for i in instances
        )
        return moved_on and not any(serves_exactly(i, version) for i in instances)


def serves_exactly(instance: Instance, version: int) -> bool:
    return instance.schedulable and instance.weight_version == version and instance.refused_version < version


def check_sampling(sampling: common_pb2.SamplingParams, where: str) -> None:
    problem = sampling_problem(sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.seed)
    if problem:
        raise InvalidArgument(f"{where}.{problem}")


def per_sample_sampling(sampling: common_pb2.SamplingParams, prompt_id: str, index: int) -> common_pb2.SamplingParams:
    """A seeded prompt gives each of its samples its own seed, derived from the prompt's: samples
    of a group must differ, and a rerun must draw the same. The batch id plays no part: a prompt
    submitted again under another batch (a trainer resuming) draws what it drew the first time."""
    params = common_pb2.SamplingParams()
    params.CopyFrom(sampling)
    if sampling.seed:
        digest = hashlib.blake2b(f"{sampling.seed}:{prompt_id}/{index}".encode(), digest_size=8).digest()
        params.seed = (int.from_bytes(digest, "little") % MAX_SEED) or 1
    return params
