"""Model families, the built-in tiny models and the code that loads weights into a model.

- `builtin`: the built-in models' folders, created on first use by one process at a time.
- `chat_tiny`: a tiny Qwen2 chat model for the word-problem tasks, warmed up to answer and call tools.
- `engine_fit`: whether a rollout engine can serve a model, read from its config.json before start.
- `families`: the model families rlmesh runs and the start-up check that refuses any other.
- `loading`: loading HF-format causal LMs from a folder and writing named tensors into a model.
- `qwen2_tiny`: the default policy: a tiny Qwen2 with the byte tokenizer, warmed up on the default task.
- `random_init`: random-init model folders of each supported family, so tests never download a model.
- `tokenizer`: a character tokenizer (byte-level BPE without merges) over the task's alphabet.
- `tp_layout`: tensor-parallel layouts of the supported families and the FSDP-shard-to-rank resharding plan.
"""
