"""Model components: the trainable experts (prompt-refiner LM, flow transformer) and the frozen text
encoder and VAE. Each builds a tiny deterministic model by default or loads a local checkpoint."""

from unirl_pl.experts.dit import FlowTransformerExpert
from unirl_pl.experts.llm import CausalLMExpert, TinyCausalLMExpert
from unirl_pl.experts.text_encoder import TextEncoderExpert
from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer
from unirl_pl.experts.vae import VAEExpert
from unirl_pl.experts.vlm import VLMRefinerExpert

__all__ = [
    "DEFAULT_WORDS",
    "CausalLMExpert",
    "FlowTransformerExpert",
    "TextEncoderExpert",
    "TinyCausalLMExpert",
    "VAEExpert",
    "VLMRefinerExpert",
    "build_word_tokenizer",
]
