"""PromptRL's format reward (``promptrl_format``) and the ``replies`` keyword that brings it the refiner's replies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unirl_pl.rewards import REGISTRY, PromptRLFormat, RewardTerm, WeightedSum, resolve_reward
from unirl_pl.rewards.replies import accepts_replies, check_replies

IMAGES = torch.zeros(1, 3, 4, 4)


# Expected values from PromptRL's ``format_reward`` (G-U-N/UniRL @53c28c9, unirl/train_geneval.py): 1.0 when
# ``re.search(r"<answer>.*?</answer>", reply, re.DOTALL)`` finds a match, else 0.0.
@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<answer>a red ball</answer>", 1.0),
        ("thinking first.\n<answer>\na red\nball\n</answer>", 1.0),  # across lines
        ("<answer></answer>", 1.0),  # an empty answer is still the format
        ("<answer>a</answer> and <answer>b", 1.0),
        ("a red ball", 0.0),
        ("<answer>a red ball", 0.0),  # unclosed
        ("a red ball</answer>", 0.0),
        ("</answer>a red ball<answer>", 0.0),  # closed before opened
        ("<ANSWER>a red ball</ANSWER>", 0.0),  # case-sensitive
        ("<answer >a red ball</answer>", 0.0),
    ],
)
def test_format_reward_as_promptrl(reply: str, expected: float) -> None:
    assert PromptRLFormat()(["p"], ["refined"], IMAGES, replies=[reply]) == [expected]


def test_unrefined_samples_and_missing_replies() -> None:
    reward = PromptRLFormat()
    replies = [None, "<answer>x</answer>", "x"]
    assert reward(["p"] * 3, ["a", "b", "c"], IMAGES, replies=replies) == [1.0, 1.0, 0.0]
    assert PromptRLFormat(unrefined=0.0)(["p"] * 3, ["a", "b", "c"], IMAGES, replies=replies) == [0.0, 1.0, 0.0]
    # No replies at all (validation, predict): the refined prompts are read in their place.
    assert reward(["p", "p"], ["<answer>x</answer>", "x"], IMAGES) == [1.0, 0.0]


def test_format_reward_arguments_and_registry() -> None:
    assert REGISTRY["promptrl_format"] is PromptRLFormat
    reward = resolve_reward("promptrl_format", {"tag": "prompt"})
    assert isinstance(reward, PromptRLFormat)
    assert reward(["p"] * 2, ["a", "b"], IMAGES, replies=["<prompt>x</prompt>", "<answer>x</answer>"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="tag"):
        PromptRLFormat(tag="<answer>")
    with pytest.raises(ValueError, match="unrefined"):
        PromptRLFormat(unrefined=float("nan"))


class _Probe:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Any, replies: Any = None) -> list[float]:
        self.calls.append(replies)
        return [float(len(r or "")) for r in replies or [None] * len(prompts)]


def _plain(prompts: list[str], refined_prompts: list[str], images: Any) -> list[float]:
    return [1.0] * len(prompts)


def _catch_all(prompts: list[str], refined_prompts: list[str], images: Any, **kwargs: Any) -> list[float]:
    assert "replies" not in kwargs, "a **kwargs catch-all did not ask for replies"
    return [1.0] * len(prompts)


def test_weighted_sum_hands_replies_only_to_terms_that_declare_them() -> None:
    assert accepts_replies(PromptRLFormat()) and accepts_replies(_Probe())
    assert not accepts_replies(_plain) and not accepts_replies(_catch_all)
    probe = _Probe()
    terms = {"probe": probe, "plain": _plain, "catch_all": _catch_all, "promptrl_format": PromptRLFormat()}
    reward = WeightedSum([RewardTerm(reward=fn, name=name) for name, fn in terms.items()])  # type: ignore[arg-type]
    images = torch.zeros(3, 3, 4, 4)
    replies = ["<answer>ab</answer>", None, "abc"]
    total, parts = reward(["p"] * 3, ["r"] * 3, images, replies=replies)
    assert probe.calls == [replies]
    assert parts["probe"].tolist() == [19.0, 0.0, 3.0]
    assert parts["promptrl_format"].tolist() == [1.0, 1.0, 0.0]
    assert total.tolist() == [22.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="2 replies for 3 samples"):
        reward(["p"] * 3, ["r"] * 3, images, replies=replies[:2])


def test_video_frames_get_their_videos_reply() -> None:
    probe = _Probe()
    reward = WeightedSum([RewardTerm(reward=probe, name="probe")])  # type: ignore[arg-type]
    videos = torch.zeros(2, 3, 3, 4, 4)  # 2 videos of 3 frames, scored frame by frame
    reward(["p", "q"], ["r", "s"], videos, replies=["ab", None])
    assert probe.calls == [["ab", "ab", "ab", None, None, None]]


def test_check_replies() -> None:
    assert check_replies(["a", None], 2) == ["a", None]
    with pytest.raises(ValueError, match="2 items for 3"):
        check_replies(["a", None], 3)
    with pytest.raises(ValueError, match="replies\\[1\\]"):
        check_replies(["a", 3], 2)
