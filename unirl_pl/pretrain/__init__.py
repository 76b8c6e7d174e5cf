"""Supervised pretraining of the ShapesWorld experts with the project's own code.

``FlowMatchingPretrain`` trains the full pixel-space DiT by rectified flow on rendered scenes with
canonical captions (features from a frozen tiny CLIP text encoder); ``RefinerSFT`` fine-tunes the tiny
causal LM on (train-split paraphrase -> canonical caption) pairs. Both are LightningModules run by
``python -m unirl_pl fit --config recipes/shapes/pretrain_*.yaml`` and export ``save_pretrained``
folders at fit end, which the RL experts load by ``pretrained_path``.
"""

from unirl_pl.pretrain.data import ParaphraseDataModule, SceneDataModule
from unirl_pl.pretrain.flow import FlowMatchingPretrain
from unirl_pl.pretrain.refiner import RefinerSFT
from unirl_pl.pretrain.vocab import SHAPES_TOKENIZER_WORDS, build_shapes_tokenizer

__all__ = [
    "SHAPES_TOKENIZER_WORDS",
    "FlowMatchingPretrain",
    "ParaphraseDataModule",
    "RefinerSFT",
    "SceneDataModule",
    "build_shapes_tokenizer",
]
