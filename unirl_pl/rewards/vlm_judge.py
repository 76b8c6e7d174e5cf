"""A vision-language model as the judge, over the OpenAI-compatible chat API that vLLM and SGLang serve.

Each sample (or pair of samples) becomes one ``POST {url}/chat/completions`` request with the image(s)
as base64 data URLs and a task template; the reply's text is parsed into a number. Three templates:

- ``score``: "rate from 1 to 10" (UnifiedReward-style pointwise score); the reward is the number.
- ``yes_no``: one yes/no question per constraint (GenEval/TIFA-style); the reward is the fraction of yes.
- ``pairwise``: the images of one prompt compared two at a time (Pref-GRPO); the reward is the win rate.

Failure policy: a reply that cannot be read, or a request that still fails after its retries (timeouts,
dropped connections, 5xx, 429), gives that sample a NaN, which ``model.nonfinite_rewards`` handles
(``error`` stops naming the sample, ``drop`` leaves it out of its group, ``skip`` skips the step). A call
where more than ``max_unreadable`` of the requests got no answer raises, naming the judge and quoting a
reply, and so does a request the server rejects (another 4xx: a wrong model name, a bad API key): a judge
that is down, misconfigured or answering nonsense must not silently turn a run into NaNs. What the judge is
asked and how its replies are read is :mod:`unirl_pl.rewards.judge_text`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.http import IMAGE_FORMATS, encode_images
from unirl_pl.rewards.judge_text import (
    DEFAULT_QUESTION,
    PAIRWISE_INSTRUCTION,
    PRESETS,
    QUESTION_INSTRUCTION,
    SCORE_INSTRUCTION,
    ChatReply,
    Template,
    chat_reply,
    parse_choice,
    parse_score,
    parse_yes_no,
)
from unirl_pl.rewards.transport import RewardServerError, TransportFailed, post


def load_questions(questions: str | dict[str, list[str]] | None) -> dict[str, list[str]]:
    """Prompt -> yes/no questions, from a dict or a JSON file of that shape (None: no table)."""
    if questions is None:
        return {}
    if isinstance(questions, str):
        try:
            questions = json.loads(Path(questions).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"reward 'vlm_judge': cannot read questions from {questions!r}: {err}") from None
    if not isinstance(questions, dict) or not all(
        isinstance(q, list) and q and all(isinstance(s, str) for s in q) for q in questions.values()
    ):
        raise ValueError("reward 'vlm_judge': questions must map each prompt to a non-empty list of strings")
    return dict(questions)


class _Transport(Exception):
    """A request that failed in transport after its retries (the sample gets NaN)."""


class VLMJudge(Reward):
    """Reward from a VLM judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        url: The server's base URL (``http://127.0.0.1:8000/v1``) or the full ``.../chat/completions`` URL.
        model: The served model's name (``--served-model-name`` of vLLM / SGLang).
        template: ``score`` (a rating on ``score_range``), ``yes_no`` (fraction of yes over the prompt's
            questions) or ``pairwise`` (win rate against the other images of the same prompt in the call).
            Default ``score``, or the preset's.
        prompt: Which text the judge sees: ``original`` (the user's prompt) or ``refined``. ``pairwise``
            needs ``original``: the images it compares are those of one prompt.
        instruction: Replaces the template's instruction; ``{prompt}`` (and ``{low}``/``{high}`` for
            ``score``, ``{question}`` for ``yes_no``) are filled in.
        score_range: ``(low, high)`` of the ``score`` template; replies outside it are unreadable. Default
            ``(1, 10)``, or the preset's.
        questions: For ``yes_no``: prompt -> questions (a dict or a JSON file); a prompt not in it gets
            ``Does the image show {prompt}?``.
        both_orders: For ``pairwise``: ask each pair in both orders (twice the requests), which cancels the
            judge's position bias exactly. Otherwise each pair is shown once, in an order drawn from the two
            images themselves, so it does not depend on where the samples sit in the batch.
        preset: ``unifiedreward`` (the ``score`` template with UnifiedReward's three 1-5 dimensions, the
            reward their mean) or ``unifiedreward_think`` (``pairwise``, reasoning in ``<think>``, the verdict
            in ``<answer>``). It fills ``template``, ``instruction``, ``score_range`` and ``max_tokens``
            where they are not given.
        max_unreadable: Largest fraction of a call's requests that may fail or come back unreadable: above
            it the call raises, naming the judge and quoting a reply (a judge answering nonsense must stop
            the run, not train it on nothing). Below it those samples get NaN for ``model.nonfinite_rewards``.
        max_concurrency: Requests in flight at once.
        timeout_s: Seconds one attempt of a request may take, connect, request and whole reply included
            (a server that drips its reply is cut off); retries fit in ``transport.retry_budget``.
        max_retries: Further attempts after a timeout, a dropped connection, a 5xx or a 429.
        backoff_s: Wait before the first retry; doubles for each one after (a 429/503's ``Retry-After``
            replaces it; one reaching past the retry budget fails that request at once).
        max_tokens: The reply's token limit. Default 512 (room for a short reasoning before the score), or
            the preset's; a reply cut at the limit (``finish_reason: length``) is warned about.
        temperature: Sampling temperature of the judge (0: its most likely answer).
        system: An optional system message.
        image_format: ``png`` or ``jpeg`` for the data URLs.
        api_key_env: Name of an environment variable holding a bearer token (keeps keys out of recipes).
        extra_body: Extra fields merged into every request (``{"top_k": 1}``, ``chat_template_kwargs``).
    """

    name = "vlm_judge"

    def __init__(
        self,
        url: str,
        model: str,
        template: Template | None = None,
        prompt: Literal["original", "refined"] = "original",
        instruction: str | None = None,
        score_range: tuple[float, float] | None = None,
        questions: str | dict[str, list[str]] | None = None,
        both_orders: bool = False,
        preset: Literal["unifiedreward", "unifiedreward_think"] | None = None,
        max_unreadable: float = 0.5,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 1.0,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        system: str | None = None,
        image_format: str = "png",
        api_key_env: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"reward {self.name!r}: preset must be one of {sorted(PRESETS)}, got {preset!r}")
        chosen = PRESETS.get(preset or "", {})
        if template is not None and chosen and template != chosen["template"]:
            raise ValueError(
                f"reward {self.name!r}: preset {preset!r} is the {chosen['template']!r} template, not {template!r}"
            )
        template = template or chosen.get("template", "score")
        instruction = instruction or chosen.get("instruction")
        score_range = score_range or chosen.get("score_range", (1.0, 10.0))
        max_tokens = max_tokens or chosen.get("max_tokens", 512)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward {self.name!r}: url must start with http:// or https://, got {url!r}")
        if template not in ("score", "yes_no", "pairwise"):
            raise ValueError(f"reward {self.name!r}: template must be score, yes_no or pairwise, got {template!r}")
        if prompt not in ("original", "refined"):
            raise ValueError(f"reward {self.name!r}: prompt must be 'original' or 'refined', got {prompt!r}")
        if template == "pairwise" and prompt == "refined":
            # Every refinement is its own text, so each group would hold one image and every win rate be 0.5.
            raise ValueError(
                f"reward {self.name!r}: the pairwise template compares the images of one prompt; with prompt: refined "
                "every refinement is a group of one and no sample gets a signal. Use prompt: original"
            )
        low, high = score_range
        if not low < high:
            raise ValueError(
                f"reward {self.name!r}: score_range must be (low, high) with low < high, got {score_range}"
            )
        if max_concurrency < 1 or timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_tokens < 1:
            raise ValueError(
                f"reward {self.name!r}: need max_concurrency >= 1, timeout_s > 0, max_retries >= 0, backoff_s >= 0, "
                f"max_tokens >= 1; got {max_concurrency}, {timeout_s}, {max_retries}, {backoff_s}, {max_tokens}"
            )
        if not 0.0 <= max_unreadable <= 1.0:
            raise ValueError(f"reward {self.name!r}: max_unreadable must be in [0, 1], got {max_unreadable}")
        if image_format.lower() not in IMAGE_FORMATS:
            raise ValueError(f"reward {self.name!r}: image_format must be one of {sorted(IMAGE_FORMATS)}")
        self.endpoint = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.prompt = model, template, prompt
        defaults = {"score": SCORE_INSTRUCTION, "yes_no": QUESTION_INSTRUCTION, "pairwise": PAIRWISE_INSTRUCTION}
        self.instruction = instruction or defaults[template]
        self.low, self.high = float(low), float(high)
        self.questions = load_questions(questions)
        self.both_orders, self.max_unreadable = both_orders, max_unreadable
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.max_tokens, self.temperature, self.system = max_tokens, temperature, system
        self.image_format = image_format.lower()
        self._mime = "png" if self.image_format == "png" else "jpeg"
        self.api_key_env, self.extra_body = api_key_env, dict(extra_body or {})
        # Waits on a server, so worth overlapping with the next micro-batch's decode; not the pairwise
        # template, which compares the images of a group and needs the whole batch.
        self.remote, self.overlap_chunk = template != "pairwise", max_concurrency
        self.failed = 0  # samples scored NaN (unparseable or failed request) over this object's life

    # ------------------------------------------------------------------ transport
    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(
                    f"reward {self.name!r}: api_key_env {self.api_key_env!r} is not set in the environment"
                )
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, images: list[str], text: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": f"data:image/{self._mime};base64,{b64}"}} for b64 in images
        ]
        content.append({"type": "text", "text": text})
        return self._body(content)

    def _body(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request of one user message of ``content`` parts (images and texts)."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": content}
        ]
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens}
        return body | {"temperature": self.temperature} | self.extra_body

    def _chat(self, body: dict[str, Any], headers: dict[str, str]) -> ChatReply:
        """The reply (its text None for a 200 whose body is not a chat completion); raises ``_Transport`` after
        the retries, :class:`RewardServerError` for a request the server rejects (a 3xx, a 4xx other than
        408/429). ``timeout_s`` bounds each attempt, body included; redirects are never followed, so the
        bearer token only ever goes to ``url``."""
        payload = json.dumps(body).encode("utf-8")
        try:
            raw = post(
                self.endpoint,
                payload,
                headers,
                deadline_s=self.timeout_s,
                max_retries=self.max_retries,
                backoff_s=self.backoff_s,
                label="VLM judge",
            )
        except TransportFailed as err:
            raise _Transport(str(err)) from None
        return chat_reply(raw)

    def _run(self, jobs: list[tuple[list[str], str]]) -> list[ChatReply | _Transport]:
        """Each job's reply (or the ``_Transport`` error it failed with), at most ``max_concurrency`` in flight."""
        headers = self._headers()

        def one(job: tuple[list[str], str]) -> ChatReply | _Transport:
            try:
                return self._chat(self._request(*job), headers)
            except _Transport as err:
                return err

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, len(jobs)))) as pool:
            results = list(pool.map(one, jobs))
        if results and all(isinstance(r, _Transport) for r in results):
            raise RewardServerError(
                f"VLM judge {self.endpoint}: all {len(results)} requests failed after {self.max_retries + 1} "
                f"attempts each; last: {results[-1]}"
            )
        return results

    def _read(self, results: list[ChatReply | _Transport], parse: Callable[[str], Any]) -> list[Any]:
        """Each result parsed (None where it failed or is unreadable). Raises when more than ``max_unreadable``
        of them are None, quoting an unreadable reply; warns when replies were cut at ``max_tokens``."""
        values = [None if isinstance(r, _Transport) or r.text is None else parse(r.text) for r in results]
        cut = sum(1 for r in results if isinstance(r, ChatReply) and r.finish_reason == "length")
        if cut:
            warnings.warn(
                f"reward {self.name!r}: {cut} of {len(results)} replies were cut at max_tokens={self.max_tokens} "
                "(finish_reason 'length'); raise max_tokens if the judge reasons before its verdict",
                stacklevel=3,
            )
        missing = [r for r, v in zip(results, values, strict=True) if v is None]
        if results and len(missing) / len(results) > self.max_unreadable:
            failed = sum(1 for r in missing if isinstance(r, _Transport))
            quoted = next((r.text for r in missing if isinstance(r, ChatReply) and r.text is not None), None)
            shown = f"; a reply: {quoted[:300]!r}" if quoted is not None else f"; last error: {missing[-1]}"
            raise RewardServerError(
                f"VLM judge {self.endpoint} ({self.template}): {len(missing)} of {len(results)} requests gave no "
                f"{'verdict' if self.template == 'pairwise' else 'score'} ({failed} failed, {len(missing) - failed} "
                f"unreadable), above max_unreadable={self.max_unreadable}{shown}"
            )
        return values

    # ------------------------------------------------------------------ templates
    def _score(self, texts: list[str], images: list[str]) -> list[float]:
        jobs = [
            ([img], self.instruction.format(prompt=t, low=_fmt(self.low), high=_fmt(self.high)))
            for t, img in zip(texts, images, strict=True)
        ]
        parsed = self._read(self._run(jobs), lambda s: parse_score(s, self.low, self.high))
        return [math.nan if v is None else v for v in parsed]

    def _yes_no(self, texts: list[str], images: list[str]) -> list[float]:
        jobs, owner = [], []
        for i, (t, img) in enumerate(zip(texts, images, strict=True)):
            for q in self.questions.get(t, [DEFAULT_QUESTION]):
                jobs.append(([img], self.instruction.format(question=q.format(prompt=t), prompt=t)))
                owner.append(i)
        answers: dict[int, list[float | None]] = defaultdict(list)
        for i, value in zip(owner, self._read(self._run(jobs), parse_yes_no), strict=True):
            answers[i].append(value)
        # One unanswered question leaves the fraction unknown: the sample is NaN, not a guess.
        return [
            math.nan if any(a is None for a in answers[i]) else sum(answers[i]) / len(answers[i])  # type: ignore[arg-type]
            for i in range(len(texts))
        ]

    def _pairwise(self, texts: list[str], images: list[str]) -> list[float]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(texts):
            groups[t].append(i)
        pairs = [(a, b) for members in groups.values() for x, a in enumerate(members) for b in members[x + 1 :]]
        if self.both_orders:
            pairs += [(b, a) for a, b in pairs]
        else:
            # Samples sit in a group in rollout order (the unrefined ones first), so a fixed order would turn a
            # judge's taste for the first image into a reward against the refiner.
            pairs = [(b, a) if _shown_swapped(images[a], images[b]) else (a, b) for a, b in pairs]
        jobs = [([images[a], images[b]], self.instruction.format(prompt=texts[a])) for a, b in pairs]
        wins, played = [0.0] * len(texts), [0] * len(texts)
        for (a, b), choice in zip(pairs, self._read(self._run(jobs), parse_choice), strict=True):
            if choice is None:
                continue  # this comparison counts for neither sample
            played[a] += 1
            played[b] += 1
            wins[a if choice == 0 else b] += 1.0
        # A prompt alone in the call has nobody to beat: 0.5, the win rate of a coin.
        return [
            0.5 if len(groups[texts[i]]) == 1 else (wins[i] / played[i] if played[i] else math.nan)
            for i in range(len(texts))
        ]

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        n = images.shape[0]
        if len(prompts) != n or len(refined_prompts) != n:
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts and {len(refined_prompts)} refined for {n}")
        if images.ndim != 4:
            raise ValueError(f"reward {self.name!r} scores images (N, 3, H, W), got shape {tuple(images.shape)}")
        texts = list(prompts if self.prompt == "original" else refined_prompts)
        encoded = encode_images(images, self.image_format)
        run = {"score": self._score, "yes_no": self._yes_no, "pairwise": self._pairwise}[self.template]
        scores = run(texts, encoded)
        bad = sum(1 for s in scores if not math.isfinite(s))
        if bad:
            self.failed += bad
            warnings.warn(
                f"reward {self.name!r}: {bad} of {n} samples got no score (unparseable reply or failed request); "
                "model.nonfinite_rewards decides what happens to them",
                stacklevel=2,
            )
        return scores


def _shown_swapped(first: str, second: str) -> bool:
    """Whether a pair is shown second image first: a coin drawn from the two images' encodings, the same for
    the same pair whatever its place in the batch, and independent of which sample came first."""
    low, high = sorted((first, second))
    digest = hashlib.blake2b(f"{low}|{high}".encode("ascii"), digest_size=8).digest()
    return (digest[0] & 1) == (first == low)


def _fmt(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)
