"""How `rlmesh up` starts the services: forked by the fork server once it has imported their
modules (its own, or one a warm fork server forks for it), or by exec (the job turned it off, or it
cannot fork: it then says why); and, before any service, the check of the job's tasks against the
model's tokenizer, run the same way."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from rlmesh.forking.forkserver import ForkServer, ForkServerError
from rlmesh.forking.helpers import WARM_FORK_SERVER_ENV
from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.processes import Child, ServiceSpec, service_environment, spawn
from rlmesh.launch.services import HELPER_MODULES, SERVICE_MODULES, forked_modules
from rlmesh.tasks.check import refusal

CHECK_MODULE = "rlmesh.tasks.check"
CHECK_IMPORTS = ("rlmesh.tasks.build", "rlmesh.models.tokenizer", "transformers.models.auto.tokenization_auto")
"""What the check imports, for the fork server to import once (the trainer imports the same)."""
BUILTIN_MODELING_MODULE = "transformers.models.qwen2.modeling_qwen2"
"""The built-in models' family, which a warm fork server imports ahead of any run."""


def warm_modules() -> list[str]:
    """What a warm fork server imports: every service's and helper's, the built-in family's and the check's."""
    return [
        *(f"{module}.__main__" for module in SERVICE_MODULES),
        *HELPER_MODULES,
        "transformers.initialization",
        BUILTIN_MODELING_MODULE,
        *CHECK_IMPORTS,
    ]


class JobRefused(Exception):
    """The job's tasks failed the start-up check; the message says why."""


class ServiceStarter:
    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self._mesh_id = str(plan.output_dir)
        modules = forked_modules(plan) if plan.mesh.fork_server else []
        self._modules = [*modules, *CHECK_IMPORTS] if modules else []
        self._attached = False
        self.forks: ForkServer | None = None
        # Started before anything else, so its imports overlap the namespaces' set-up.
        if self._modules and plan.warm_fork_server is not None:
            try:
                self.forks = self._fork_server(plan.warm_fork_server)
                self._attached = True
            except ForkServerError as exc:
                print(f"rlmesh up: {exc}; starting its own fork server", file=sys.stderr)
        if self._modules and self.forks is None:
            self.forks = self._fork_server(None)

    def _fork_server(self, warm_socket: Path | None) -> ForkServer:
        return ForkServer(
            self._modules, service_environment({}, self._mesh_id), self._plan.log_dir / "forkserver.log", warm_socket
        )

    async def _fork_server_failure(self) -> ForkServerError | None:
        """Waits until the fork server can fork; why it cannot, if it cannot."""
        if self.forks is None:
            return None
        try:
            await asyncio.to_thread(self.forks.wait_ready)
        except ForkServerError as exc:
            return exc
        return None

    async def prepare(self) -> None:
        """Waits for the fork server, then checks the job's tasks; raises JobRefused."""
        failure = await self._fork_server_failure()
        if failure is not None and self._attached:
            print(
                f"rlmesh up: the warm fork server at {self._plan.warm_fork_server}: {failure}; starting its own "
                "fork server",
                file=sys.stderr,
            )
            self.close()
            self._attached = False
            self.forks = self._fork_server(None)
            failure = await self._fork_server_failure()
        if failure is not None:
            print(f"rlmesh up: {failure}; the services start by exec", file=sys.stderr)
            self.close()
        await self._check_tasks()

    async def _check_tasks(self) -> None:
        plan = self._plan
        search_path = [str(plan.job_dir)] if plan.job_dir is not None else []
        if self.forks is None:
            message = await asyncio.to_thread(
                refusal, plan.job.tasks, plan.job.algorithm.seed, plan.model_dir, search_path
            )
            if message is not None:
                raise JobRefused(message)
            return
        log_path = plan.log_dir / "job-check.log"
        args = ["--job", str(plan.output_dir / "job.json"), "--model-dir", str(plan.model_dir)]
        args += [item for path in search_path for item in ("--search-path", path)]
        checking = self.forks.spawn(CHECK_MODULE, args, service_environment({}, self._mesh_id), log_path)
        if await asyncio.to_thread(checking.wait) != 0:
            raise JobRefused(log_path.read_text().strip())

    def __call__(self, spec: ServiceSpec) -> Child:
        if self._plan.warm_fork_server is not None:
            # Their helpers (tensor-parallel ranks, the reference, the episode process) are forked from it too.
            spec = replace(
                spec, settings={**spec.settings, WARM_FORK_SERVER_ENV: str(self._plan.warm_fork_server.resolve())}
            )
        return spawn(spec, self._plan.log_dir, self._mesh_id, self.forks)

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()
            self.forks = None
