"""An EditReward-style judge of image edits: a VLM behind an OpenAI-compatible chat endpoint (vLLM, SGLang) sees
the source image, the edited image and the instruction, and rates the edit.

EditReward (TIGER-Lab) and the edit reward PromptRL trains with score a (source, edited, instruction) triple on
how well the edit follows the instruction and how good the result looks. This is that task for any chat VLM: one
``POST {url}/chat/completions`` per presentation of a sample, the two images as base64 data URLs, each after a
text part naming it (``Image 1 (the original image):``), then the instruction; the reply is read as a score on
``score_range`` (:func:`~unirl_pl.rewards.judge_text.parse_score`).

Everything a request goes through is :class:`~unirl_pl.rewards.vlm_judge.VLMJudge`'s: the per-attempt deadline
(``timeout_s``, the whole reply included) within a retry budget, retries of timeouts, dropped connections, 5xx
and 429, no redirects followed (the bearer token of ``api_key_env`` only ever goes to ``url``), the failure
policy (a sample whose reply is unreadable or whose request failed is NaN for ``model.nonfinite_rewards``; more
than ``max_unreadable`` of a call's requests failing raises, quoting a reply).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

from torch import Tensor

from unirl_pl.rewards.http import encode_images, encode_sources
from unirl_pl.rewards.judge_text import parse_score
from unirl_pl.rewards.sources import Source, require_sources
from unirl_pl.rewards.vlm_judge import VLMJudge, _fmt, _shown_swapped

Order = Literal["both", "coin", "source_first", "edited_first"]

EDIT_INSTRUCTION = (
    "You are judging an image edit. {layout} The edit instruction was: {prompt}\n"
    "Rate the edit from {low} to {high}, where {high} is best: how well the edited image does what the "
    "instruction asks, how well it keeps what the instruction does not mention as it was in the original image, "
    "and how natural it looks, free of artifacts. Reply with the number only."
)
# Where each image is, said in the instruction ({layout}) and in the text part before each image.
LAYOUTS = {
    "source_first": "Image 1 is the original image and Image 2 is the edited image.",
    "edited_first": "Image 1 is the edited image and Image 2 is the original image.",
}
ROLES = {"source": "the original image", "edited": "the edited image"}


class EditJudge(VLMJudge):
    """Reward from a VLM judge of edits: the score it gives each (source image, edited image, instruction).

    Position bias: a judge may prefer whichever image it sees first. Each image is always labelled (a text part
    ``Image k (the original image):`` or ``Image k (the edited image):`` before it, and the ``{layout}`` sentence
    of the instruction), and ``order`` says where the edited image goes:

    - ``both`` (default): every sample is asked twice, original first and edited first, and its reward is the
      mean of the two scores (twice the requests; a preference for a position then adds the same to every
      sample and cancels out of the group advantages exactly). A sample with either reply unreadable is NaN.
    - ``coin``: asked once, in an order drawn from the two images themselves (the same for the same pair, in
      any batch position), so a position preference is noise spread over the samples, not a bias toward some.
    - ``source_first`` / ``edited_first``: asked once in that fixed, labelled layout.

    Each sample needs its source image (the ``sources`` keyword): a call without them is an error.

    Args:
        url: The server's base URL (``http://127.0.0.1:8000/v1``) or the full ``.../chat/completions`` URL.
        model: The served model's name (``--served-model-name`` of vLLM / SGLang).
        prompt: Which instruction the judge sees: ``original`` (the user's) or ``refined`` (the refiner's rewrite,
            which a refiner can game by rewriting toward edits the judge likes).
        instruction: Replaces the default instruction; ``{prompt}`` (the instruction), ``{low}``, ``{high}`` and
            ``{layout}`` (which image is which) are filled in.
        score_range: ``(low, high)`` of the score; replies outside it are unreadable. Default ``(1, 10)``.
        order: ``both``, ``coin``, ``source_first`` or ``edited_first`` (above).
        max_unreadable: Largest fraction of a call's requests that may fail or come back unreadable: above it the
            call raises, naming the judge and quoting a reply; below it those samples get NaN.
        max_concurrency: Requests in flight at once (and the decode micro-batch its requests overlap).
        timeout_s: Seconds one attempt of a request may take, connect, request and whole reply included.
        max_retries: Further attempts after a timeout, a dropped connection, a 5xx or a 429.
        backoff_s: Wait before the first retry; doubles for each one after (a ``Retry-After`` replaces it).
        max_tokens: The reply's token limit; a reply cut at it is warned about.
        temperature: Sampling temperature of the judge (0: its most likely answer).
        system: An optional system message.
        image_format: ``png`` or ``jpeg`` for the data URLs.
        api_key_env: Name of an environment variable holding a bearer token, sent to ``url`` only.
        extra_body: Extra fields merged into every request (``{"top_k": 1}``, ``chat_template_kwargs``).
    """

    name = "edit_judge"

    def __init__(
        self,
        url: str,
        model: str,
        prompt: Literal["original", "refined"] = "original",
        instruction: str | None = None,
        score_range: tuple[float, float] = (1.0, 10.0),
        order: Order = "both",
        max_unreadable: float = 0.5,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 1.0,
        max_tokens: int = 512,
        temperature: float = 0.0,
        system: str | None = None,
        image_format: str = "png",
        api_key_env: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if order not in ("both", "coin", "source_first", "edited_first"):
            raise ValueError(
                f"reward {self.name!r}: order must be both, coin, source_first or edited_first, got {order!r}"
            )
        if instruction is not None and "{prompt}" not in instruction:
            raise ValueError(f"reward {self.name!r}: instruction must hold {{prompt}}, where the edit instruction goes")
        super().__init__(
            url=url,
            model=model,
            template="score",
            prompt=prompt,
            instruction=instruction or EDIT_INSTRUCTION,
            score_range=score_range,
            max_unreadable=max_unreadable,
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_tokens=max_tokens,
            temperature=temperature,
            system=system,
            image_format=image_format,
            api_key_env=api_key_env,
            extra_body=extra_body,
        )
        self.order = order

    def _request(self, images: list[str], text: str, roles: tuple[str, ...] = ()) -> dict[str, Any]:  # type: ignore[override]
        """The chat request: each image after a text part naming it (``roles``), then the instruction."""
        content: list[dict[str, Any]] = []
        for k, b64 in enumerate(images):
            if roles:
                content.append({"type": "text", "text": f"Image {k + 1} ({ROLES[roles[k]]}):"})
            content.append({"type": "image_url", "image_url": {"url": f"data:image/{self._mime};base64,{b64}"}})
        content.append({"type": "text", "text": text})
        return self._body(content)

    def layouts(self, source: str, edited: str) -> list[str]:
        """The layouts a sample is shown in (``source_first`` / ``edited_first``), from its two encoded images."""
        if self.order == "both":
            return ["source_first", "edited_first"]
        if self.order == "coin":
            return ["edited_first" if _shown_swapped(source, edited) else "source_first"]
        return [self.order]

    def __call__(  # type: ignore[override]
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        sources: list[Source] | None = None,
    ) -> list[float]:
        n = images.shape[0]
        if len(prompts) != n or len(refined_prompts) != n:
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts and {len(refined_prompts)} refined for {n}")
        if images.ndim != 4:
            raise ValueError(f"reward {self.name!r} scores images (N, 3, H, W), got shape {tuple(images.shape)}")
        checked: list[Source] = list(require_sources(sources, n, f"reward {self.name!r}"))
        originals = encode_sources(checked, self.image_format)
        edited = encode_images(images, self.image_format)
        texts = list(prompts if self.prompt == "original" else refined_prompts)
        jobs: list[Any] = []
        owner: list[int] = []
        for i, (text, source, result) in enumerate(zip(texts, originals, edited, strict=True)):
            for layout in self.layouts(source, result):  # type: ignore[arg-type]
                shown = [source, result] if layout == "source_first" else [result, source]
                roles = ("source", "edited") if layout == "source_first" else ("edited", "source")
                words = {"prompt": text, "low": _fmt(self.low), "high": _fmt(self.high), "layout": LAYOUTS[layout]}
                jobs.append((shown, self.instruction.format(**words), roles))
                owner.append(i)
        scores: list[list[float | None]] = [[] for _ in range(n)]
        parsed = self._read(self._run(jobs), lambda s: parse_score(s, self.low, self.high))
        for i, value in zip(owner, parsed, strict=True):
            scores[i].append(value)
        # One unreadable presentation leaves the mean unknown: the sample is NaN, not the other order's score.
        out = [math.nan if any(v is None for v in vs) else sum(vs) / len(vs) for vs in scores]  # type: ignore[misc]
        bad = sum(1 for s in out if not math.isfinite(s))
        if bad:
            self.failed += bad
            warnings.warn(
                f"reward {self.name!r}: {bad} of {n} samples got no score (unparseable reply or failed request); "
                "model.nonfinite_rewards decides what happens to them",
                stacklevel=2,
            )
        return out
