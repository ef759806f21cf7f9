"""The training algorithm's parts, each registered by name (`registry.py`): policy losses
(`losses.py`), advantage estimators (`advantages.py`) and reward shapers (`shaping.py`). A new
part is one function and one registration; importing this package registers every part."""

from services.trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from services.trainer.algorithms.losses import POLICY_LOSSES
from services.trainer.algorithms.registry import Registry, UnknownName
from services.trainer.algorithms.shaping import REWARD_SHAPERS

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "REWARD_SHAPERS", "AdvantageEstimator", "Registry", "UnknownName"]
