"""Verifiable tasks that generate or read their prompts and score responses.

- `base`: the task interface: prompt sources with a resumable cursor, rendering, scoring.
- `build`: a job's tasks built from their config, and the weighted mixture that draws each step's prompts.
- `check`: the start-up check of a job's tasks against the model's tokenizer, before any service starts.
- `config`: a task's typed configuration: prompts, rendering, reward, sampling, held-out evaluation.
- `datasets`: prompts from JSONL, Parquet or a local HF `datasets` folder, shuffled per epoch.
- `increment`: the default task: add 1 to every digit of a digit string.
- `word_problems`: the second built-in task: arithmetic word problems with integer answers.
"""
