"""Where a run's figures go: metrics.jsonl, TensorBoard and the reward plot, and the experiment
trackers a job enables.

- `metrics`: training metrics (metrics.jsonl, TensorBoard, the reward plot), fanned out to the trackers.
- `tracker`: what a tracker is handed (`Tracker`) and the held-out sample record.
- `runs`: the tracker runs a job enables, started on rank 0 with the run's config.
- `wandb_tracker`: Weights & Biases: offline under the run's folder, or online.
- `mlflow_tracker`: MLflow: a local SQLite store under the run's folder, or a tracking URI.
"""
