"""A vision-language model as the judge, over the OpenAI-compatible chat API that vLLM and SGLang serve.

Each sample (or pair of samples) becomes one ``POST {url}/chat/completions`` request with the image(s)
as base64 data URLs and a task template; the reply's text is parsed into a number. Three templates:

- ``score``: "rate from 1 to 10" (UnifiedReward-style pointwise score); the reward is the number.
- ``yes_no``: one yes/no question per constraint (GenEval/TIFA-style); the reward is the fraction of yes.
- ``pairwise``: the images of one prompt compared two at a time (Pref-GRPO); the reward is the win rate.

Failure policy: a reply that cannot be parsed, or a request that still fails after its retries
(timeouts, dropped connections, 5xx, 429), gives that sample a NaN, which ``model.nonfinite_rewards``
handles (``error`` stops naming the sample, ``drop`` leaves it out of its group, ``skip`` skips the
step). Only when *every* request of a call failed in transport, or the server rejects the request
itself (another 4xx: a wrong model name, a bad API key), is it an error: a judge that is down or
misconfigured must not silently turn a run into NaNs. Only the standard library speaks HTTP.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from unirl_pl.rewards.http import IMAGE_FORMATS, RewardServerError, encode_images

Template = Literal["score", "yes_no", "pairwise"]

SCORE_INSTRUCTION = (
    "You are judging an image generated from a text description. Rate how well the image matches the "
    "description and how good it looks, on a scale from {low} to {high}, where {high} is best. "
    "Reply with the number only.\nDescription: {prompt}"
)
QUESTION_INSTRUCTION = "Answer the question about the image with yes or no only.\nQuestion: {question}"
DEFAULT_QUESTION = "Does the image show {prompt}?"
PAIRWISE_INSTRUCTION = (
    "Two images were generated from the same text description. Which one matches the description better "
    "and looks better? Reply with 1 for the first image or 2 for the second, and nothing else.\n"
    "Description: {prompt}"
)

_NUMBER = r"[-+]?\d+(?:\.\d+)?"


def parse_score(text: str, low: float, high: float) -> float | None:
    """The judge's score in ``[low, high]`` from its reply, or None when there is no unambiguous one.

    In order: the last ``score: X`` (``Final Score: 7``), then ``X/10`` or ``X out of 10``, then a reply
    whose only number is X. A number outside the range, or several different bare numbers, is None.
    """
    lowered = text.lower()
    labeled = re.findall(rf"score\s*(?:is|of|[:=])?\s*\**\s*({_NUMBER})", lowered)
    ratio = re.findall(rf"({_NUMBER})\s*(?:/|out of)\s*{_NUMBER}", lowered)
    bare = set(re.findall(_NUMBER, lowered))
    if labeled:
        value = float(labeled[-1])
    elif ratio:
        value = float(ratio[0])
    elif len({float(b) for b in bare}) == 1:
        value = float(next(iter(bare)))
    else:
        return None
    return value if low <= value <= high and math.isfinite(value) else None


def parse_yes_no(text: str) -> float | None:
    """1.0 for a yes, 0.0 for a no, None when the reply says both, neither, or something else first."""
    words = re.findall(r"[a-z]+", text.lower())
    for word in words:
        if word in ("yes", "no"):
            other = "no" if word == "yes" else "yes"
            # "Yes. ... no" is still a yes (the answer comes first); "yes or no?" echoed back is not an answer.
            if f"{word} or {other}" in " ".join(words):
                return None
            return 1.0 if word == "yes" else 0.0
    return None


def parse_choice(text: str) -> int | None:
    """0 when the judge prefers the first image, 1 for the second, None when it is not clear which."""
    lowered = text.lower().strip()
    first = re.search(r"\b(1|first)\b", lowered)
    second = re.search(r"\b(2|second)\b", lowered)
    if first and second:
        return 0 if first.start() < second.start() else 1  # "1, because image 2 ..." answers first
    if first:
        return 0
    if second:
        return 1
    return None


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


class VLMJudge:
    """Reward from a VLM judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        url: The server's base URL (``http://127.0.0.1:8000/v1``) or the full ``.../chat/completions`` URL.
        model: The served model's name (``--served-model-name`` of vLLM / SGLang).
        template: ``score`` (1-10 rating), ``yes_no`` (fraction of yes over the prompt's questions) or
            ``pairwise`` (win rate against the other images of the same prompt in the call).
        prompt: Which text the judge sees: ``original`` (the user's prompt) or ``refined``.
        instruction: Replaces the template's instruction; ``{prompt}`` (and ``{low}``/``{high}`` for
            ``score``, ``{question}`` for ``yes_no``) are filled in.
        score_range: ``(low, high)`` of the ``score`` template; replies outside it are unparseable.
        questions: For ``yes_no``: prompt -> questions (a dict or a JSON file); a prompt not in it gets
            ``Does the image show {prompt}?``.
        both_orders: For ``pairwise``: ask each pair in both orders, cancelling the judge's position bias
            (twice the requests).
        max_concurrency: Requests in flight at once.
        timeout_s: Seconds to wait for each request (connect and reply).
        max_retries: Further attempts after a timeout, a dropped connection, a 5xx or a 429.
        backoff_s: Wait before the first retry; doubles for each one after.
        max_tokens: The reply's token limit (the templates ask for one word or number).
        temperature: Sampling temperature of the judge (0: its most likely answer).
        system: An optional system message.
        image_format: ``png`` or ``jpeg`` for the data URLs.
        api_key_env: Name of an environment variable holding a bearer token (keeps keys out of recipes).
        extra_body: Extra fields merged into every request (``{"top_k": 1}``, ``chat_template_kwargs``).
    """

    def __init__(
        self,
        url: str,
        model: str,
        template: Template = "score",
        prompt: Literal["original", "refined"] = "original",
        instruction: str | None = None,
        score_range: tuple[float, float] = (1.0, 10.0),
        questions: str | dict[str, list[str]] | None = None,
        both_orders: bool = False,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 1.0,
        max_tokens: int = 16,
        temperature: float = 0.0,
        system: str | None = None,
        image_format: str = "png",
        api_key_env: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward 'vlm_judge': url must start with http:// or https://, got {url!r}")
        if template not in ("score", "yes_no", "pairwise"):
            raise ValueError(f"reward 'vlm_judge': template must be score, yes_no or pairwise, got {template!r}")
        if prompt not in ("original", "refined"):
            raise ValueError(f"reward 'vlm_judge': prompt must be 'original' or 'refined', got {prompt!r}")
        low, high = score_range
        if not low < high:
            raise ValueError(f"reward 'vlm_judge': score_range must be (low, high) with low < high, got {score_range}")
        if max_concurrency < 1 or timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                "reward 'vlm_judge': need max_concurrency >= 1, timeout_s > 0, max_retries >= 0, backoff_s >= 0; "
                f"got {max_concurrency}, {timeout_s}, {max_retries}, {backoff_s}"
            )
        if image_format.lower() not in IMAGE_FORMATS:
            raise ValueError(f"reward 'vlm_judge': image_format must be one of {sorted(IMAGE_FORMATS)}")
        self.endpoint = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.prompt = model, template, prompt
        defaults = {"score": SCORE_INSTRUCTION, "yes_no": QUESTION_INSTRUCTION, "pairwise": PAIRWISE_INSTRUCTION}
        self.instruction = instruction or defaults[template]
        self.low, self.high = float(low), float(high)
        self.questions = load_questions(questions)
        self.both_orders = both_orders
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
        host = urllib.parse.urlsplit(url).hostname or ""
        self._bypass_proxy = host in ("localhost", "::1") or host.startswith("127.")

    # ------------------------------------------------------------------ transport
    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"reward 'vlm_judge': api_key_env {self.api_key_env!r} is not set in the environment")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, images: list[str], text: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": f"data:image/{self._mime};base64,{b64}"}} for b64 in images
        ]
        content.append({"type": "text", "text": text})
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": content}
        ]
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens}
        return body | {"temperature": self.temperature} | self.extra_body

    def _chat(self, body: dict[str, Any], headers: dict[str, str]) -> str | None:
        """The reply's text; None for a 200 whose body is not a chat completion; raises ``_Transport`` after
        the retries, :class:`RewardServerError` for a request the server rejects (4xx other than 408/429)."""
        opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if self._bypass_proxy else []))
        payload = json.dumps(body).encode("utf-8")
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.endpoint, data=payload, headers=headers, method="POST")
            try:
                with opener.open(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
                break
            except urllib.error.HTTPError as err:
                if err.code < 500 and err.code not in (408, 429):
                    detail = err.read(300).decode("utf-8", "replace").strip()
                    raise RewardServerError(
                        f"VLM judge {self.endpoint} rejected the request: HTTP {err.code} {err.reason}"
                        + (f": {detail}" if detail else "")
                    ) from None
                last = err
            except (OSError, http.client.HTTPException) as err:  # timeouts, refused or dropped connections
                last = err
        else:
            raise _Transport(f"{type(last).__name__}: {last}")
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        if isinstance(content, list):  # some servers return content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else None

    def _run(self, jobs: list[tuple[list[str], str]]) -> list[str | None | _Transport]:
        """Each job's reply text (None: unparseable body; a ``_Transport``: failed), with at most
        ``max_concurrency`` requests in flight."""
        headers = self._headers()

        def one(job: tuple[list[str], str]) -> str | None | _Transport:
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

    # ------------------------------------------------------------------ templates
    def _score(self, texts: list[str], images: list[str]) -> list[float]:
        jobs = [
            ([img], self.instruction.format(prompt=t, low=_fmt(self.low), high=_fmt(self.high)))
            for t, img in zip(texts, images, strict=True)
        ]
        parsed = [_parsed(r, lambda s: parse_score(s, self.low, self.high)) for r in self._run(jobs)]
        return [math.nan if v is None else v for v in parsed]

    def _yes_no(self, texts: list[str], images: list[str]) -> list[float]:
        jobs, owner = [], []
        for i, (t, img) in enumerate(zip(texts, images, strict=True)):
            for q in self.questions.get(t, [DEFAULT_QUESTION]):
                jobs.append(([img], self.instruction.format(question=q.format(prompt=t), prompt=t)))
                owner.append(i)
        answers: dict[int, list[float | None]] = defaultdict(list)
        for i, r in zip(owner, self._run(jobs), strict=True):
            answers[i].append(_parsed(r, parse_yes_no))
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
        jobs = [([images[a], images[b]], self.instruction.format(prompt=texts[a])) for a, b in pairs]
        wins, played = [0.0] * len(texts), [0] * len(texts)
        for (a, b), r in zip(pairs, self._run(jobs), strict=True):
            choice = _parsed(r, parse_choice)
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
            raise ValueError(f"reward 'vlm_judge': {len(prompts)} prompts and {len(refined_prompts)} refined for {n}")
        if images.ndim != 4:
            raise ValueError(f"reward 'vlm_judge' scores images (N, 3, H, W), got shape {tuple(images.shape)}")
        texts = list(prompts if self.prompt == "original" else refined_prompts)
        encoded = encode_images(images, self.image_format)
        run = {"score": self._score, "yes_no": self._yes_no, "pairwise": self._pairwise}[self.template]
        scores = run(texts, encoded)
        bad = sum(1 for s in scores if not math.isfinite(s))
        if bad:
            self.failed += bad
            warnings.warn(
                f"reward 'vlm_judge': {bad} of {n} samples got no score (unparseable reply or failed request); "
                "model.nonfinite_rewards decides what happens to them",
                stacklevel=2,
            )
        return scores


def _fmt(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)


def _parsed(result: str | None | _Transport, parse: Callable[[str], Any]) -> Any:
    """The parsed reply, or None for a failed request or an unparseable one."""
    return None if result is None or isinstance(result, _Transport) else parse(result)
