"""Environments a multi-turn task runs its episodes in: a Python class, a service in any language,
a verifiers environment; agent commands need none.

- `base`: the environment interface (`reset`, `step`) and the checks of what it returns.
- `calculator`: the `calculator` built-in environment: word problems with a calculator tool.
- `factory`: makes an episode's environment from a task's config (user class, built-in or remote).
- `feedback`: the `feedback` built-in environment: a hidden code, marks per digit, a second attempt.
- `remote`: a client of an environment served behind `EnvironmentService`, in any language.
- `verifiers_adapter`: runs `verifiers` environments unchanged, their model calls on the gateway.
"""
