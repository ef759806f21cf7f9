"""The training algorithm's parts, each registered by name; a new part is one function and one
registration. Importing this package registers every part.

- `advantages`: advantage estimators: `grpo`, `rloo`, `reinforce_pp` from outcomes, `gae` with a critic.
- `group_advantages`: a micro-batch's advantages from its groups' rewards, per trajectory and per turn.
- `losses`: policy losses, and `policy_loss`, which adds the KL penalty and aggregates them.
- `registry`: the named registry the parts are registered in, and the error for an unknown name.
- `shaping`: reward shapers, each adding a named reward component.
"""

from services.trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from services.trainer.algorithms.losses import POLICY_LOSSES
from services.trainer.algorithms.registry import Registry, UnknownName
from services.trainer.algorithms.shaping import REWARD_SHAPERS

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "REWARD_SHAPERS", "AdvantageEstimator", "Registry", "UnknownName"]
