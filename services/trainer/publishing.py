"""Publishing weight versions from the trainer: the ranks hand their shards to the weights service,
then the manager learns the version; one publish at a time, the upload overlapping the next step,
and a version the weights service lost (it restarted) handed over again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import structlog

from services.trainer.mesh import MeshClient
from services.trainer.ranks.commands import CollectiveFailure, Publish, PublishResult, RankGroup

log = structlog.get_logger()

WEIGHTS_CHECK_SECONDS = 2.0
"""While waiting for rollouts, how often the weights service is asked whether it still holds the
latest version (a restarted one holds none, and no instance could then catch up)."""


ANNOUNCE_ATTEMPTS = 3
"""Announcements of a version that the weights service lost before it was announced, each after
handing the version over again."""


class VersionPublisher:
    def __init__(
        self, group: RankGroup, mesh: MeshClient, file_figures: Callable[[int, dict[str, float]], None]
    ) -> None:
        self.group = group
        self.mesh = mesh
        self._file_figures = file_figures
        self.published_version = -1
        self.stepped_since_publish = False
        """The optimizer stepped after the last publish: the policy is no longer that version."""
        self.publishing: asyncio.Task[PublishResult] | None = None
        """The last version's delivery and announcement, while it may still run in the background."""
        self._lock = asyncio.Lock()
        """One publish at a time: the training loop's and the weights watcher's."""

    async def publish(self, version: int, wait: bool = True, step: int | None = None) -> PublishResult | None:
        """Every rank packs its shards of the version (the policy as it is now), then hands them to
        the weights service, and the manager learns the version. With `wait` False this returns once
        the shards are packed and the rest goes on in the background (`publishing`); its figures
        are filed under `step`. While the weights service is unreachable (restarting) the same bytes
        are uploaded again, with backoff, for up to publish_timeout_seconds (`RankGroup`)."""
        async with self._lock:
            return await self._publish_now(version, wait, step)

    async def republish(self, version: int) -> None:
        """Hands `version` over again, unless the policy moved on from it in the meantime or a newer
        version is still on its way (or failed: the training loop learns of that at its next publish)."""
        async with self._lock:
            publishing = self.publishing
            if publishing is not None and (
                not publishing.done() or publishing.cancelled() or publishing.exception() is not None
            ):
                return
            if not self.stepped_since_publish and version == self.published_version:
                await self._publish_now(version, wait=True, step=None)

    async def published(self) -> PublishResult | None:
        """Waits for the last version's delivery and announcement; raises if it failed."""
        publishing, self.publishing = self.publishing, None
        return await publishing if publishing is not None else None

    def cancel(self) -> None:
        if self.publishing is not None:
            self.publishing.cancel()

    async def watch_weights(self, done: asyncio.Event) -> None:
        """Hands the latest version over again if the weights service lost it (it was restarted)
        while the policy is still that version; otherwise no instance could reach the version
        the staleness gate asks for, and the step's rollouts would never come."""
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), WEIGHTS_CHECK_SECONDS)
                return
            except TimeoutError:
                pass
            if self.stepped_since_publish or self.published_version < 0:
                continue
            try:
                stored = await self.mesh.stored_version()
            except grpc.aio.AioRpcError:
                continue
            if stored < self.published_version:
                log.warning(
                    "the weights service lost the latest version (restarted?); handing it over again",
                    weight_version=self.published_version,
                    stored_version=stored,
                )
                try:
                    await self.republish(self.published_version)
                except (CollectiveFailure, grpc.aio.AioRpcError) as exc:
                    log.warning(
                        "could not hand the latest version over again",
                        weight_version=self.published_version,
                        error=str(exc),
                    )

    async def _publish_now(self, version: int, wait: bool, step: int | None) -> PublishResult | None:
        await self.published()
        self.stepped_since_publish = False
        delivery = await self.group.lead(Publish(version, wait=False))
        self.publishing = asyncio.create_task(self._announce(version, delivery, None if wait else step))
        return await self.published() if wait else None

    async def _announce(
        self, version: int, delivery: asyncio.Task[PublishResult], file_under: int | None
    ) -> PublishResult:
        published = await delivery
        announcing = time.perf_counter()
        for attempt in range(1, ANNOUNCE_ATTEMPTS + 1):
            try:
                await self.mesh.announce(version)
                break
            except grpc.aio.AioRpcError as exc:
                # The manager publishes only a version the weights service holds: one that lost it
                # between the upload and now (it restarted) is handed the policy again first.
                if (
                    exc.code() != grpc.StatusCode.FAILED_PRECONDITION
                    or attempt == ANNOUNCE_ATTEMPTS
                    or await self.mesh.stored_version() >= version
                ):
                    raise
                log.warning(
                    "the weights service lost the version before it was announced (restarted?); handing it over again",
                    weight_version=version,
                    error=exc.details(),
                )
                published = await (await self.group.lead(Publish(version, wait=False)))
        self.published_version = version
        published = replace(published, seconds=published.seconds + time.perf_counter() - announcing)
        if file_under is not None:
            self._file_figures(file_under, publish_figures(published))
        return published


def publish_figures(published: PublishResult) -> dict[str, float]:
    """A version's publish figures, as filed in the metrics of the step that made it."""
    return {
        "publish_seconds": published.seconds,
        "publish_upload_seconds": published.upload_seconds,
        "publish_pack_seconds": published.pack_seconds,
        "publish_rank_bytes": float(max(published.rank_bytes)),
    }
