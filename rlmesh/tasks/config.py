"""Typed configuration of a task in a job: its prompts (built-in generator or a dataset file with a
field mapping), how they are rendered, the reward, sampling settings and held-out evaluation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rlmesh.config import StrictModel

BUILTIN_REWARDS = ("increment", "math")
CREDENTIAL_SOURCES = ("env:", "file:")
AGENTS_PER_CORE = 2
"""An agent command's episodes at once per CPU core, by default: each is a process, whose start is
CPU work (a Python harness with the `openai` client takes about a CPU second) while the rest of its
episode mostly waits on the model's turns."""
ENVIRONMENT_EPISODES_PER_CORE = 256
"""An environment's episodes at once per CPU core, by default: each is a coroutine of the episode
driver waiting on the model's turns, its sync calls bounded by `threads`."""


def check_credential(reference: str | None, where: str) -> None:
    """A credential reference names where its bearer token is: `env:NAME` or `file:PATH`."""
    if reference is not None and (not reference.startswith(CREDENTIAL_SOURCES) or not reference.split(":", 1)[1]):
        raise ValueError(
            f"{where} {reference!r} must be env:NAME (an environment variable) or file:PATH (a file holding the token)"
        )


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, which a container's cpuset limits)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class DatasetConfig(StrictModel):
    path: str
    """A JSONL file, a Parquet file, or a local HF `datasets` folder (saved with `save_to_disk`).
    Relative paths are relative to the job file."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """`auto` goes by the suffix (.jsonl / .parquet) or a folder (hf)."""
    split: str = "train"
    """For an HF folder holding several splits (a DatasetDict): the training split."""
    fields: dict[str, str] = Field(default_factory=lambda: {"prompt": "prompt"})
    """The task's names for dataset columns: {name: column}. `prompt` names the column holding the
    prompt text or its chat messages (a list of {role, content}); every other entry becomes
    metadata under its name (for example `answer = "solution"`). Columns not named here are
    passed to the reward under their own names. Every named column must exist in every row."""
    shuffle: bool = True
    """Shuffle the rows, with a new order every epoch (seeded: a resumed run sees the same order)."""
    epochs: int | None = Field(default=None, ge=1)
    """Passes over the data; None repeats for as many steps as the job runs."""


class EvalConfig(StrictModel):
    path: str | None = None
    """A separate held-out file (same format and fields as the dataset)."""
    split: str | None = None
    """A held-out split of the dataset's HF folder (for example `test`)."""
    holdout: int = Field(default=0, ge=0)
    """Rows taken out of the training data for evaluation (seeded), when there is no file or split."""
    prompts: int = Field(default=64, ge=1)
    """Held-out prompts evaluated (at most this many)."""
    samples: int = Field(default=4, ge=1)
    """Sampled responses per held-out prompt for the sampled-reward estimate (plus one greedy)."""


class PromptConfig(StrictModel):
    template: str | None = None
    """A Python format string over the prompt and metadata fields (`"Q: {prompt}\\nA:"`); None uses
    the prompt field as it is."""
    chat: bool = False
    """Render with the tokenizer's chat template (`apply_chat_template`, generation prompt added);
    the model folder's tokenizer must have one."""
    system: str | None = None
    """A system message put before the user's message (chat only)."""


class RewardConfig(StrictModel):
    builtin: Literal["increment", "math"] | None = None
    """A reward shipped with rlmesh: `increment` (share of correct characters against `answer`) or
    `math` (the answer checked by math-verify against `answer`, or against what follows the last
    `####` of a GSM8K-style `answer`)."""
    function: str | None = None
    """A Python callable: `module:function` (the job file's folder is on the import path) or
    `path/to/file.py:function`. Sync or async; it receives the arguments it names among `prompt`,
    `completion`, `metadata`, `completion_token_ids` and the metadata fields (e.g. `answer`), and
    returns a number or {"reward", "components", "token_rewards"}."""
    batched: bool = False
    """The function takes lists (one entry per sample) and returns a list."""
    remote: str | None = None
    """host:port of a verifier serving rlmesh.reward.v1.RewardService (any language)."""
    remote_credential: str | None = None
    """The bearer token the remote verifier is called with (`authorization: Bearer <token>`):
    `env:NAME` (an environment variable of the trainer) or `file:PATH` (a file holding it, relative
    to the job file). None: its calls carry no credential. It never gets a mesh role's secret."""
    timeout_seconds: float = Field(default=30.0, gt=0)
    """Deadline of scoring one sample (a per-sample function) or one batch (a batched function, a
    remote verifier: every attempt included, each getting timeout_seconds / attempts); past it
    the samples fail."""
    attempts: int = Field(default=3, ge=1)
    """Tries of a remote call that fails with UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED."""
    failure_reward: float = 0.0
    """What a sample gets when its reward raised, hung past the deadline or was not a finite number."""
    max_error_rate: float = Field(default=0.1, ge=0, le=1)
    """The job stops when more than this share of the last `error_window` samples failed to score."""
    error_window: int = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        chosen = [k for k in ("builtin", "function", "remote") if getattr(self, k)]
        if len(chosen) > 1:
            raise ValueError(f"give one of builtin, function or remote, not {' and '.join(chosen)}")
        if self.function and ":" not in self.function:
            raise ValueError(f"function {self.function!r} must be written module:function or file.py:function")
        if self.batched and not self.function:
            raise ValueError("batched applies to a Python function only")
        if self.remote_credential and not self.remote:
            raise ValueError("remote_credential is the remote verifier's: give remote too")
        check_credential(self.remote_credential, "remote_credential")
        return self

    @property
    def given(self) -> bool:
        return bool(self.builtin or self.function or self.remote)


class SamplingConfig(StrictModel):
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    """Response token budget; None takes the task kind's default (12 for increment, 48 otherwise)."""


class EnvironmentConfig(StrictModel):
    """Makes a task multi-turn: each sample is an episode in an environment, held by the manager as a
    session, trained token for token on the model's turns."""

    python: str | None = None
    """Your environment class (or factory) in your own file: `file.py:Class` or `module:Class`. One
    instance per episode; `reset(row)` returns the first messages (or a user message's text) and
    `step(action)` returns (observation, reward, done). Sync or async: sync methods run in worker
    threads, so a slow one never blocks the trainer."""
    builtin: Literal["calculator", "feedback"] | None = None
    """An environment shipped with rlmesh: `calculator` (word problems with a calculator tool) or
    `feedback` (digit answers marked right or wrong per position, then a second attempt)."""
    tools: bool = True
    """Built-in environments: offer their tools. False runs the same episodes without them (the
    calculator's baseline: the model answers directly)."""
    remote: str | None = None
    """host:port of a service serving `rlmesh.environment.v1.EnvironmentService` in any language
    (protos/); it is called with `remote_credential`, never a mesh role's."""
    remote_credential: str | None = None
    """The bearer token the remote environment is called with (`authorization: Bearer <token>`):
    `env:NAME` (an environment variable of the trainer) or `file:PATH` (a file holding it, relative
    to the job file). None: its calls carry no credential."""
    verifiers: str | None = None
    """An environment written for verifiers (0.4, `verifiers.v1`): the id of its taskset, a module
    importable from the job's folder (or installed) that exports one `vf.Taskset`. It runs
    unchanged: the task's prompts are the taskset's rows (task kind `verifiers`), each episode runs
    verifiers' tool-calling chat program against its session on the manager's gateway, and the
    taskset's rewards score it. Needs verifiers 0.4.0, which `make setup` installs (requirements-dev.txt);
    elsewhere, rlmesh's `verifiers` extra."""
    verifiers_args: dict[str, Any] = Field(default_factory=dict)
    """The verifiers taskset's config fields (its TasksetConfig), e.g. `{ num_tasks = 64 }`."""
    command: str | None = None
    """A black-box agent: this command (split like a shell would, run in the job's folder) is run
    once per episode with OPENAI_BASE_URL set to its session on the manager's gateway and
    OPENAI_API_KEY to the session's key (plus RLMESH_SESSION_ID, RLMESH_ROW_FILE: a file holding the
    dataset row as JSON, and RLMESH_ROW: the same JSON, when it is under 64 KiB). Its process group
    is killed when it exits or at the episode's deadline. It reports its reward by POSTing
    {"reward": x} to $OPENAI_BASE_URL/rlmesh/reward, or as the JSON line {"reward": x} last on its
    stdout; or the task's reward scores the final transcript. Exit 0 ends the episode `done`, any
    other exit `environment_error`."""
    agent_rewards: bool | None = None
    """Whether the episode's agent may report rewards: a POST to $OPENAI_BASE_URL/rlmesh/reward
    (any code holding the session's key can make it, the agent's tools included) or an agent
    command's stdout line {"reward": x}. Refused, the gateway answers 403 and the stdout line is
    ignored. None: allowed only to an agent command of a task without a reward of its own. With
    `credit = "turn"` an agent's per-turn rewards drive the advantages directly."""
    on_break: Literal["split", "refuse"] = "split"
    """What the gateway does with a chat request whose history does not extend its session's (a
    break: the harness edited, removed or inserted a message, or rewrote the model's turn beyond
    what matching forgives; docs/agents.md). `split`: the trajectory gets a new part from the last
    model turn both agree on (each part trains as a sample of its own). `refuse`: HTTP 409 naming
    the first message that differs, so the agent can keep its trajectory whole."""
    credit: Literal["trajectory", "turn"] = "trajectory"
    """`trajectory`: every model token of an episode gets the episode's advantage (its reward: the
    sum of its turns'). `turn`: each turn's tokens get the advantage of that turn's reward among the
    group's same turns (per-turn rewards; an environment that rewards every step)."""
    max_turns: int = Field(default=4, ge=1)
    """Model turns per episode; an episode that reaches it ends `truncated_turns`."""
    max_total_tokens: int | None = Field(default=None, ge=2)
    """Tokens of a whole episode (prompt, observations and turns); None: the model's context length.
    An episode whose next turn would not fit ends `truncated_context`."""
    turn_deadline_seconds: float = Field(default=300.0, gt=0)
    """One model turn's generation, queueing included."""
    step_deadline_seconds: float = Field(default=60.0, gt=0)
    """One environment call (reset or step); past it the episode ends `deadline`."""
    episode_deadline_seconds: float = Field(default=1800.0, gt=0)
    """A whole episode; the manager reaps a session nobody closed at this deadline."""
    max_error_rate: float = Field(default=0.25, ge=0, le=1)
    """The job stops when more than this share of the last `error_window` episodes ended in an
    environment error or a deadline (each is masked out of its group, not scored)."""
    error_window: int = Field(default=64, ge=1)
    threads: int = Field(default=64, ge=1)
    """Worker threads running sync environment methods (episodes of all steps share them). A call
    past its deadline keeps its thread (Python cannot stop one): it is written off and replaced, up
    to `threads` written off at once, so hung steps never starve later episodes."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """Episodes of this task that run at once (training and held-out ones together); the others wait
    for a slot, and their deadlines (step, episode) start only when they do: an agent's first call
    is timed from its start. None: 2 per CPU core for an agent command (each is a process, whose
    start is CPU work: a Python harness with the `openai` client takes about a CPU second, and the
    rest of its episode mostly waits on the model), 256 per core for an environment (an episode is
    a coroutine waiting on the model's turns, its sync calls bounded by `threads`)."""

    @model_validator(mode="after")
    def _one_kind(self) -> EnvironmentConfig:
        chosen = [k for k in ("python", "builtin", "remote", "verifiers", "command") if getattr(self, k)]
        if len(chosen) != 1:
            given = f", not {' and '.join(chosen)}" if chosen else ""
            raise ValueError(f"give one of python, builtin, remote, verifiers or command{given}")
        if self.verifiers_args and not self.verifiers:
            raise ValueError("verifiers_args are a verifiers taskset's fields: give verifiers too")
        if self.python and ":" not in self.python:
            raise ValueError(f"python {self.python!r} must be written module:Class or file.py:Class")
        if self.remote_credential and not self.remote:
            raise ValueError("remote_credential is the remote environment's: give remote too")
        check_credential(self.remote_credential, "remote_credential")
        return self

    @property
    def concurrency(self) -> int:
        """How many of the task's episodes run at once (max_concurrent, or its default from the cores)."""
        if self.max_concurrent is not None:
            return self.max_concurrent
        return cpu_cores() * (AGENTS_PER_CORE if self.command else ENVIRONMENT_EPISODES_PER_CORE)


TASK_KINDS = ("increment", "word_problems", "dataset", "verifiers")


class TaskConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """Names the task in metrics (`task/<name>/reward`) and the ledger."""
    kind: Literal["increment", "word_problems", "dataset", "verifiers"] = "dataset"
    """`increment` (built-in: add 1 to every digit), `word_problems` (built-in: arithmetic word
    problems, checked by math-verify), `dataset` (a file of yours) or `verifiers` (the rows of the
    verifiers taskset named in environment.verifiers; eval.holdout of them held out)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of each step's prompts drawn from this task, relative to the other tasks' weights."""
    dataset: DatasetConfig | None = None
    eval: EvalConfig = EvalConfig()
    prompt: PromptConfig = PromptConfig()
    reward: RewardConfig = RewardConfig()
    sampling: SamplingConfig = SamplingConfig()
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes: each sample is an episode in this environment, its reward the sum of the
    environment's step rewards (or the task's reward over the final transcript, when one is given)."""
    seed: int = 0
    """Seeds the task's shuffle or generator (together with the job's seed)."""

    @model_validator(mode="after")
    def _consistent(self) -> TaskConfig:
        if self.kind == "dataset":
            if self.dataset is None:
                raise ValueError(f"task {self.name!r}: kind 'dataset' needs a [dataset] section with its path")
            if not self.reward.given and self.environment is None:
                raise ValueError(
                    f"task {self.name!r}: a dataset task needs a reward (builtin, function or remote) or an environment"
                )
            if "prompt" not in self.dataset.fields and self.prompt.template is None:
                raise ValueError(f"task {self.name!r}: dataset.fields needs a 'prompt' column, or give prompt.template")
        elif self.dataset is not None:
            raise ValueError(f"task {self.name!r}: kind {self.kind!r} generates its own prompts; remove [dataset]")
        uses_verifiers = self.environment is not None and self.environment.verifiers is not None
        if (self.kind == "verifiers") != uses_verifiers:
            raise ValueError(
                f"task {self.name!r}: kind 'verifiers' and environment.verifiers go together: the prompts are "
                "the verifiers taskset's rows"
            )
        if self.eval.path and self.eval.split:
            raise ValueError(f"task {self.name!r}: give eval.path or eval.split, not both")
        if self.environment is not None and self.environment.agent_rewards is None:
            # A task that scores its episodes (its reward, an environment's step rewards, a
            # verifiers taskset's) takes none from code its agents run.
            self.environment.agent_rewards = bool(self.environment.command) and not self.reward.given
        return self

    @property
    def max_tokens(self) -> int:
        if self.sampling.max_tokens is not None:
            return self.sampling.max_tokens
        return 12 if self.kind == "increment" else 48

    def resolve_paths(self, base: Path) -> TaskConfig:
        """Paths relative to `base` (the job file's folder) made absolute."""

        def absolute(path: str | None) -> str | None:
            return None if path is None else str((base / path).resolve()) if not Path(path).is_absolute() else path

        update = {}
        if self.dataset is not None:
            update["dataset"] = self.dataset.model_copy(update={"path": absolute(self.dataset.path)})
        if self.eval.path:
            update["eval"] = self.eval.model_copy(update={"path": absolute(self.eval.path)})
        if self.reward.function and ".py:" in self.reward.function:
            file, function = self.reward.function.rsplit(":", 1)
            update["reward"] = self.reward.model_copy(update={"function": f"{absolute(file)}:{function}"})
        if self.environment is not None and self.environment.python and ".py:" in self.environment.python:
            file, name = self.environment.python.rsplit(":", 1)
            update["environment"] = self.environment.model_copy(update={"python": f"{absolute(file)}:{name}"})
        for section in ("reward", "environment"):
            current = update.get(section, getattr(self, section))
            reference = getattr(current, "remote_credential", None)
            if reference and reference.startswith("file:"):
                update[section] = current.model_copy(update={"remote_credential": f"file:{absolute(reference[5:])}"})
        return self.model_copy(update=update)

    def missing_file(self) -> str:
        """The first data file this task names that is not there ("" when all are): checked
        before anything starts, where the full check waits for the services' imports."""
        named = [("dataset", self.dataset.path if self.dataset is not None else None), ("eval.path", self.eval.path)]
        for what, path in named:
            if path is not None and not Path(path).exists():
                return f"task {self.name!r}: {what} {path} does not exist"
        return ""
