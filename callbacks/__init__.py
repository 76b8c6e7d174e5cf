"""Plugin checks: user-written callbacks that a recipe loads by ``class_path``.

Example: ``class_path: callbacks.reward_range.RewardRangeCheck``.
"""
