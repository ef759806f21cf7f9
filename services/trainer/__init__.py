"""The trainer service: the training loop on rank 0, the policy sharded over the ranks, episodes,
checkpoints and metrics.

- `__main__`: `python -m services.trainer --config trainer.toml`.
- `algorithms`: the algorithm's parts by name: policy losses, advantage estimators, reward shapers.
- `config`: the trainer's config: the job's `[algorithm]` and `[trainer]` settings plus addresses and tasks.
- `episodes`: multi-turn episodes, each a session at the manager, in rank 0 or a process of its own.
- `loop`: the training loop (`TrainingLoop`): submit, score, train, step, publish, for every algorithm.
- `main`: runs the trainer on every rank; rank 0 serves TrainerService and drives the loop.
- `mesh`: rank 0's client of the manager and the weights service, with deadlines and restarts ridden out.
- `outage`: calls made again, with backoff, while the manager or a relay shard is unreachable.
- `pipeline`: the rollout pipeline as plain data (submitted, accepted, training order), saved in checkpoints.
- `publishing`: publishes each weight version: shards to the weights service, then the manager told.
- `ranks`: what the ranks run with torch: FSDP policy and critic, commands, checkpoints, weight hand-off.
- `relayed`: fetches delivered samples' tokens from the relay shard holding them.
- `scoring`: scores a batch's finished groups: task rewards, reward shapers, reference log-probabilities.
- `server`: the TrainerService servicer: reports the loop's progress.
- `step_totals`: a training step's figures as its micro-batches come in, and the metrics filed for it.
- `tracking`: where a run's figures go: metrics.jsonl, TensorBoard, the reward plot, W&B and MLflow.
- `trajectories`: a multi-turn session's trajectory as training samples, and the episode's figures.
- `validation`: held-out validation of a policy version on spare rollout capacity, in the background.
"""
