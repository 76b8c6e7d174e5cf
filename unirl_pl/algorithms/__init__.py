"""Algorithms as parts: how each trained expert learns from its loop's records (see :mod:`.base`).

Generator (``model.generator_algorithm``): :class:`FlowGRPO` (the default; ``guard`` for GRPO-Guard),
:class:`FlowGRPOFast`, :class:`MixGRPO`, :class:`FlowCPS`, :class:`DiffusionNFT`. Refiner
(``model.llm_algorithm``): :class:`TokenGRPO` (the default), :class:`DAPO`, :class:`GSPO`. Each recipe overlay
``recipes/algorithms/<name>.yaml`` selects one.
"""

from unirl_pl.algorithms.base import Algorithm, GeneratorAlgorithm, LossInputs, RefinerAlgorithm
from unirl_pl.algorithms.cps import FlowCPS
from unirl_pl.algorithms.diffusion_nft import DiffusionNFT
from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.algorithms.flow_grpo_fast import FlowGRPOFast
from unirl_pl.algorithms.gspo import GSPO
from unirl_pl.algorithms.mix_grpo import MixGRPO
from unirl_pl.algorithms.token_grpo import DAPO, TokenGRPO

__all__ = [
    "DAPO",
    "GSPO",
    "Algorithm",
    "DiffusionNFT",
    "FlowCPS",
    "FlowGRPO",
    "FlowGRPOFast",
    "GeneratorAlgorithm",
    "LossInputs",
    "MixGRPO",
    "RefinerAlgorithm",
    "TokenGRPO",
]
