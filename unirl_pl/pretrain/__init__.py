"""Supervised pretraining of the ShapesWorld experts with the project's own code.

``FlowMatchingPretrain`` trains the full pixel-space DiT by rectified flow on rendered scenes with
canonical captions (features from a frozen tiny CLIP text encoder); ``RefinerSFT`` fine-tunes the tiny
causal LM on (train-split paraphrase -> canonical caption) pairs. ``EditFlowPretrain`` (on
``EditDataModule``) and ``RefinerSFT`` with ``vocabulary: edits`` (on ``InstructionDataModule``) do the same
for ShapesWorld-Edit. All are LightningModules run by
``python -m unirl_pl fit --config recipes/shapes/pretrain_*.yaml`` and export ``save_pretrained``
folders at fit end, which the RL experts load by ``pretrained_path``.
"""

from unirl_pl.pretrain.data import EditDataModule, InstructionDataModule, ParaphraseDataModule, SceneDataModule
from unirl_pl.pretrain.edit_flow import EditFlowPretrain
from unirl_pl.pretrain.flow import FlowMatchingPretrain
from unirl_pl.pretrain.refiner import RefinerSFT
from unirl_pl.pretrain.vocab import SHAPES_EDIT_TOKENIZER_WORDS, SHAPES_TOKENIZER_WORDS, build_shapes_tokenizer

__all__ = [
    "SHAPES_EDIT_TOKENIZER_WORDS",
    "SHAPES_TOKENIZER_WORDS",
    "EditDataModule",
    "EditFlowPretrain",
    "FlowMatchingPretrain",
    "InstructionDataModule",
    "ParaphraseDataModule",
    "RefinerSFT",
    "SceneDataModule",
    "build_shapes_tokenizer",
]
