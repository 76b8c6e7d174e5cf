"""Plugin checks: user-written callbacks loaded from a recipe by ``class_path`` (e.g. ``callbacks.reward_range.RewardRangeCheck``)."""
