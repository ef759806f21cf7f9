"""How `rlmesh up` starts the services: forked by the fork server once it has imported their
modules, or by exec (the job turned it off, or it cannot fork: it then says why); and, before
any service, the check of the job's tasks against the model's tokenizer, run the same way."""

from __future__ import annotations

import asyncio
import sys

from rlmesh.launch.forkserver import ForkServer, ForkServerError
from rlmesh.launch.plan import LaunchPlan
from rlmesh.launch.processes import Child, ServiceSpec, service_environment, spawn
from rlmesh.launch.services import forked_modules
from rlmesh.tasks.check import refusal

CHECK_MODULE = "rlmesh.tasks.check"
CHECK_IMPORTS = ("rlmesh.tasks.build", "rlmesh.models.tokenizer", "transformers.models.auto.tokenization_auto")
"""What the check imports, for the fork server to import once (the trainer imports the same)."""


class JobRefused(Exception):
    """The job's tasks failed the start-up check; the message says why."""


class ServiceStarter:
    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self._mesh_id = str(plan.output_dir)
        modules = forked_modules(plan) if plan.mesh.fork_server else []
        # Started before anything else, so its imports overlap the namespaces' set-up.
        self.forks = ForkServer([*modules, *CHECK_IMPORTS], service_environment({}, self._mesh_id),
                                plan.log_dir / "forkserver.log") if modules else None

    async def prepare(self) -> None:
        """Waits for the fork server, then checks the job's tasks; raises JobRefused."""
        if self.forks is not None:
            try:
                await asyncio.to_thread(self.forks.wait_ready)
            except ForkServerError as exc:
                print(f"rlmesh up: {exc}; the services start by exec", file=sys.stderr)
                self.close()
        await self._check_tasks()

    async def _check_tasks(self) -> None:
        plan = self._plan
        search_path = [str(plan.job_dir)] if plan.job_dir is not None else []
        if self.forks is None:
            message = await asyncio.to_thread(refusal, plan.job.tasks, plan.job.algorithm.seed, plan.model_dir, search_path)
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
        return spawn(spec, self._plan.log_dir, self._mesh_id, self.forks)

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()
            self.forks = None
