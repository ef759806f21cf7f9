"""Helpers that several test modules use, one module per kind of thing they return. Fixtures live in
the conftest files; test modules import from here, never from each other.

- `clients`: calls to a running service (a batch's groups, weight uploads, a session's OpenAI client, grpcurl)
- `credentials`: the suite's secrets per role, auth settings, loopback server configs, a roleless certificate
- `engines`: what an engine decodes when called directly
- `jobs`: `rlmesh up` command lines and job files
- `kubernetes_api`: a Kubernetes API server stand-in for a Deployment's scale subresource, with its requests kept
- `manager_parts`: the manager's domain modules built one by one, without the facade (instances as records)
- `manager_states`: a manager's state in memory with instances registered, and sessions opened on it
- `meshes`: in-process meshes (manager, weights service, rollout instances) and stopping them
- `model_families`: a version pushed from trainer ranks to an instance, checked against HF
- `paths`: the repository's root
- `processes`: services and trainer ranks as real processes, and what a test reads of a process
- `run_outputs`: what a run wrote (metrics.jsonl, mesh.json, W&B and MLflow runs), read back
- `samples`: prompts, sampling parameters and training samples on the tiny digit model
- `tensors`: weights as named tensors (scaled, perturbed, gathered whole)
- `tp_instances`: a rollout instance split over TP ranks and a weight update driven step by step
- `vllm_rollout`: the vLLM rollout process and the vLLM/torch instance pair
- `waiting`: polling or awaiting a condition, and a clock moved by hand
"""
