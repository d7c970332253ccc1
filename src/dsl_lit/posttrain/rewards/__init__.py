"""Rule-based rewards (DeepSeek-R1): checked answers, the think/answer format, language consistency,
the reasoning restating its question (a readability filter for rejection sampling), and their
weighted combination. Each reward is ``fn(completion: str, sample: Mapping) -> float``."""

from dsl_lit.posttrain.rewards.accuracy import CHECKERS, accuracy_reward, extract_answer, extract_boxed
from dsl_lit.posttrain.rewards.combine import REWARD_FUNCTIONS, RewardFunction, WeightedRewards, build_rewards
from dsl_lit.posttrain.rewards.format import format_reward
from dsl_lit.posttrain.rewards.language import language_consistency_reward, target_language_share
from dsl_lit.posttrain.rewards.restatement import restatement_reward

__all__ = [
    "CHECKERS",
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "WeightedRewards",
    "accuracy_reward",
    "build_rewards",
    "extract_answer",
    "extract_boxed",
    "format_reward",
    "language_consistency_reward",
    "restatement_reward",
    "target_language_share",
]
