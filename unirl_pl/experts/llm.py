"""The prompt-refiner expert: a ``transformers`` causal LM with a ``peft`` LoRA adapter."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, ClassVar

import torch
from peft import PeftModel, get_peft_model
from peft.utils import load_peft_weights
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from unirl_pl.experts._common import check_divisible, check_positive, seeded_cpu_init
from unirl_pl.experts.base import LoRAExpert
from unirl_pl.experts.chat import ChatFormat, format_requests, is_end_of_turn, parse_reply
from unirl_pl.experts.tokenizer import build_word_tokenizer, load_tokenizer, special_token_ids
from unirl_pl.lora import load_lora_weights
from unirl_pl.manifest import verify_assets

DEFAULT_LLM_LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


class CausalLMExpert(LoRAExpert):
    """Prompt-refiner expert: a causal LM loaded from a checkpoint, whose only trainable weights are a LoRA adapter.

    The constructor only records and validates its arguments; ``build()`` (called from the
    LightningModule's ``configure_model``) loads the tokenizer and model from ``pretrained_path``, so a
    recipe can be parsed and checked without allocating weights. The reference policy for the KL term is
    this same model with the adapter disabled (``adapter_disabled()``), so no second copy of the weights is
    kept. :class:`TinyCausalLMExpert` is the same expert over a tiny model built from its own arguments (the
    test bed); this class takes only what applies to a checkpoint.

    Args:
        pretrained_path: Local folder or hub id of a causal LM (and its tokenizer).
        lora_rank: LoRA rank ``r`` (>= 1).
        lora_alpha: LoRA scaling numerator; the adapter output is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: Module names that get LoRA; default ``q_proj k_proj v_proj o_proj``.
        dtype: Dtype of the base weights: ``float32``, ``bfloat16`` or ``float16`` (LoRA weights stay
            float32, peft's default for low-precision bases).
        init_seed: Seed of the LoRA init.
        chat: How an instruct LM is asked and its reply read back (chat template, instruction, reply
            parsing with a fallback to the user prompt); None feeds the bare prompt to a base LM and takes
            its continuation as the refinement.
        finetune: ``lora`` trains the adapter on frozen base weights (the reference is the adapter
            bypassed); ``full`` trains every weight in float32 (the reference is a frozen copy of the
            initial weights; the LoRA arguments are then unused), as PromptRL trains its refiner.
    """

    lora_task_type = "CAUSAL_LM"
    # The transformers Auto class that loads this kind's checkpoints (``plan`` builds fake models through it too).
    auto_model_class: ClassVar[Any] = AutoModelForCausalLM

    def __init__(
        self,
        pretrained_path: str,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        init_seed: int = 0,
        chat: ChatFormat | None = None,
        finetune: str = "lora",
    ) -> None:
        super().__init__(pretrained_path, dtype, init_seed)
        self._init_refiner(lora_rank, lora_alpha, lora_target_modules, chat, finetune)

    def _init_refiner(
        self,
        lora_rank: int,
        lora_alpha: float,
        lora_target_modules: list[str] | None,
        chat: ChatFormat | None,
        finetune: str = "lora",
    ) -> None:
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, DEFAULT_LLM_LORA_TARGETS, finetune=finetune)
        self.chat = chat
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.model: PeftModel | None = None
        self._cache_arg_name = "past_key_values"

    def build(self) -> None:
        """Create the tokenizer and the trainable model; a second call is a no-op.

        With LoRA the base weights are frozen and only the LoRA matrices require grad; peft initializes
        LoRA ``B`` to zero, so at build time the policy equals the adapter-disabled reference while
        gradients still reach ``B`` through the random ``A``. With full fine-tuning every weight trains and
        the reference is a frozen copy made at build time, so the two are equal then as well.
        """
        if self.is_built:
            return
        tokenizer = self._build_tokenizer()
        with seeded_cpu_init(self.init_seed):
            base = self._base_model(tokenizer)
            model = self._adapt(base)
        params = inspect.signature(base.forward).parameters
        self._cache_arg_name = "cache" if "cache" in params else "past_key_values"
        self.tokenizer = tokenizer
        self.model = model

    def _base_tokenizer(self) -> PreTrainedTokenizerBase:
        assert self.pretrained_path is not None  # set by __init__; only the tiny subclass has none
        # Before the tokenizer loads: a deleted shipped file is then named by the manifest, not a loader error.
        verify_assets(self.pretrained_path, component=type(self).__name__)
        return load_tokenizer(self.pretrained_path)

    def _base_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        # ``dtype=`` (not ``.to``) keeps any modules the architecture pins to float32.
        return self.auto_model_class.from_pretrained(self.pretrained_path, dtype=self.dtype)

    def _build_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = self._base_tokenizer()
        # Batched generation appends new tokens on the right, so prompts must be left-padded.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _attach_lora(self, model: PreTrainedModel) -> PeftModel:
        """Freeze ``model`` and wrap it in a ``PeftModel`` with the adapter (LoRA weights in float32)."""
        model.requires_grad_(False)
        with warnings.catch_warnings():
            # peft still calls a transformers helper that transformers 5 deprecated; not actionable here.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(model, self.lora_config())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: object | None = None,
        use_cache: bool = False,
    ) -> CausalLMOutputWithPast:
        """Run the (adapted) LM and return the ``transformers`` output with ``logits`` of shape
        (B, T, vocab) and, when ``use_cache``, the KV cache for incremental decoding. The cache is
        ``output.cache`` on transformers >= 5 (``output.past_key_values`` still works there but is
        deprecated) and is passed back in through ``past_key_values``."""
        return self._call_model(input_ids, attention_mask, position_ids, past_key_values, use_cache)

    def _call_model(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_key_values: object | None,
        use_cache: bool,
        **inputs: Any,
    ) -> CausalLMOutputWithPast:
        """The built model's call with these inputs (``inputs``: any more the architecture takes, such as a
        VLM's ``pixel_values``), the cache passed under the name the architecture declares."""
        model = self._require_built()
        # transformers 5 renamed the cache argument to ``cache``; passing the old name logs a
        # deprecation on every call, so pick the name the loaded architecture declares.
        cache_kwarg = {self._cache_arg_name: past_key_values} if past_key_values is not None else {}
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **inputs,
            **cache_kwarg,
        )

    @property
    def pad_token_id(self) -> int:
        """Id used to left-pad prompts."""
        return int(self._require_tokenizer().pad_token_id)

    @property
    def eos_token_id(self) -> int:
        """The tokenizer's end-of-sequence id (one of ``stop_token_ids``)."""
        return int(self._require_tokenizer().eos_token_id)

    @property
    def stop_token_ids(self) -> list[int]:
        """Every id that ends a generated refinement: the tokenizer's EOS and all of the checkpoint's
        ``generation_config.eos_token_id`` (an instruct model such as Qwen2.5-Instruct lists both
        ``<|im_end|>`` and ``<|endoftext|>``, and its tokenizer's EOS may be only one of them)."""
        ids = [self.eos_token_id]
        config = getattr(self._require_built(), "generation_config", None)
        listed = getattr(config, "eos_token_id", None)
        ids += [listed] if isinstance(listed, int) else list(listed or [])
        return sorted({int(i) for i in ids})

    def reply_texts(self, tokens: torch.Tensor, live: torch.Tensor) -> list[str]:
        """The text of each generated row up to (not including) its first end token, special tokens dropped.

        End tokens are the stop ids and, for an instruct LM, every added token that marks the end of a turn
        (:func:`~unirl_pl.experts.chat.is_end_of_turn`: ``<|im_end|>`` in a checkpoint whose stop ids
        lack it, say): the cut is made on token ids, before decoding strips the special tokens.
        """
        tokenizer = self._require_tokenizer()
        ends = set(self.stop_token_ids)
        if self.chat is not None and self.chat.use_chat_template:
            ends |= {int(i) for token, i in tokenizer.get_added_vocab().items() if is_end_of_turn(token)}
        end_ids = torch.tensor(sorted(ends), device=tokens.device)
        texts = []
        for row, mask in zip(tokens, live, strict=True):
            kept = row[mask]
            cut = torch.isin(kept, end_ids).nonzero()
            kept = kept[: int(cut[0])] if len(cut) else kept
            texts.append(tokenizer.decode(kept, skip_special_tokens=True))
        return texts

    def tokenize_requests(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Left-padded ``input_ids`` and ``attention_mask`` of what the refiner reads for each prompt.

        With a chat format that is the rendered template (instruction and prompt in one user turn, ending
        in the assistant's generation prompt); the template already holds its special tokens, so none
        are added again. Everything here is context: only the generated tokens are recorded and scored.
        """
        tokenizer = self._require_tokenizer()
        if self.chat is None or not self.chat.use_chat_template:
            return tokenizer(prompts, return_tensors="pt", padding=True)
        texts = format_requests(tokenizer, prompts, self.chat)
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def parse_replies(self, replies: list[str], prompts: list[str]) -> tuple[list[str], list[bool]]:
        """The refined prompts read from decoded replies, and which fell back to the user prompt (empty
        when there is no chat format: ``llm/fallback_frac`` is then not logged).

        A base LM's continuation is the refinement as is (stripped); an instruct LM's reply goes through
        :func:`~unirl_pl.experts.chat.parse_reply` (thinking removed, labels and quotes stripped, length
        capped, the user prompt when nothing usable is left).
        """
        if self.chat is None or not self.chat.use_chat_template:
            return [r.strip() for r in replies], []  # no parsing, so nothing can fall back
        parsed = [parse_reply(r, p, self.chat) for r, p in zip(replies, prompts, strict=True)]
        return [text for text, _ in parsed], [fell for _, fell in parsed]

    def save_adapter(self, path: str) -> None:
        """Save only the LoRA adapter (peft format, loadable with ``PeftModel.from_pretrained``)."""
        self._require_lora("save_adapter")
        self._require_built().save_pretrained(path)

    def save_model(self, path: str) -> None:
        """Save the whole fine-tuned model and its tokenizer as a ``transformers`` folder, loadable by the
        model's Auto class (``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a VLM) with no
        base checkpoint: what ``export`` writes for ``finetune: full``."""
        self._require_built().save_pretrained(path)
        self._require_tokenizer().save_pretrained(path)

    def load_adapter(self, path: str) -> None:
        """Load LoRA weights saved by ``save_adapter`` into this expert's adapter, in place, raising
        ``ValueError`` when they do not match it."""
        self._require_lora("load_adapter")
        model = self._require_built()
        load_lora_weights(model, load_peft_weights(path, device=str(next(model.parameters()).device)), path)


class TinyCausalLMExpert(CausalLMExpert):
    """The prompt-refiner expert over a tiny Qwen2 model built from these arguments (the test bed and the
    ShapesWorld refiner's pretraining), with the offline word tokenizer; weights come from ``init_seed``
    without touching the global RNG. Everything else is :class:`CausalLMExpert`'s.

    Args:
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_attention_heads: Query heads; must divide ``hidden_size``.
        num_key_value_heads: Key/value heads (GQA); must divide ``num_attention_heads``.
        intermediate_size: Width of the MLP.
        lora_rank: LoRA rank ``r`` (>= 1).
        lora_alpha: LoRA scaling numerator; the adapter output is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: Module names that get LoRA; default ``q_proj k_proj v_proj o_proj``.
        dtype: Dtype of the weights: ``float32``, ``bfloat16`` or ``float16`` (LoRA weights stay float32).
        init_seed: Seed of the model's weights and of the LoRA init.
        initializer_range: Std of the random init. Larger than HF's 0.02 by default because with tied
            embeddings a 0.02 init bounds every logit near 0: the policy is stuck near uniform and no LoRA
            update can make one token likely, unlike a real LM.
        chat: As :class:`CausalLMExpert`'s (None: the bare prompt, the continuation is the refinement).
        finetune: As :class:`CausalLMExpert`'s: ``lora`` or ``full``.
    """

    def __init__(
        self,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        intermediate_size: int = 128,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        init_seed: int = 0,
        initializer_range: float = 0.2,
        chat: ChatFormat | None = None,
        finetune: str = "lora",
    ) -> None:
        LoRAExpert.__init__(self, None, dtype, init_seed)  # no checkpoint: build() makes the weights
        check_positive(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=intermediate_size,
            initializer_range=initializer_range,
        )
        self._init_refiner(lora_rank, lora_alpha, lora_target_modules, chat, finetune)
        check_divisible(hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        check_divisible(num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads)
        self.hidden_size, self.num_layers, self.intermediate_size = hidden_size, num_layers, intermediate_size
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.initializer_range = initializer_range

    def _base_tokenizer(self) -> PreTrainedTokenizerBase:
        return build_word_tokenizer(padding_side="left")

    def _base_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            initializer_range=self.initializer_range,
            **special_token_ids(tokenizer),
        )
        return Qwen2ForCausalLM(config).to(self.dtype)
