"""FSDP2 sharding of the trained experts and the loss weights that keep multi-rank gradients equal to one process's.

Lightning's ``ModelParallelStrategy`` hands ``configure_model`` a device mesh; :func:`shard_experts`
applies ``fully_shard`` to every transformer block of each trained expert (LoRA already attached
by ``build()``), then to the expert's root for the leftover parameters. Frozen components (text
encoder, VAE) stay replicated: they are small next to the experts and never need gradients.

DDP and FSDP2 average gradients over ranks, which equals the single-process gradient only when each
rank's loss is a mean over equally many items. The DiT loss is (true: every rank renders the same
number of samples); the LM's token-level loss is not (refinements differ in length), so
:func:`token_loss_weight` rescales each rank's LM loss by ``world * local_tokens / global_tokens``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Names of block lists, by kind: a kind found in a model gives all of its lists (FLUX's double and single stream).
BLOCK_LISTS: tuple[tuple[str, ...], ...] = (
    ("transformer_blocks", "single_transformer_blocks"),
    ("layers",),
    ("blocks",),
)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a peft-wrapped causal LM (``layers``) or a diffusers DiT (``transformer_blocks``, and
    FLUX's ``single_transformer_blocks`` beside them; ``blocks`` in Wan). Each is an FSDP2 unit of its own: a list
    left out would sit in the root unit, gathered whole for every forward (FLUX.1-dev's 38 single blocks: 5.4B
    parameters) and its gradients reduced all at once."""
    for names in BLOCK_LISTS:
        found = [
            block
            for module in model.modules()
            for name in names
            if isinstance(blocks := getattr(module, name, None), torch.nn.ModuleList)
            for block in blocks
        ]
        if found:
            return list(dict.fromkeys(found))
    raise ValueError(f"found no transformer blocks in {type(model).__name__}")


def shard_experts(experts: dict[str, Any], trained: list[str], mesh: Any, reshard_after_forward: bool) -> None:
    """``fully_shard`` each trained expert's blocks and root over ``mesh`` (the data-parallel sub-mesh); an
    expert with several models (Wan2.2's two transformers, listed by its ``transformers``) has each sharded,
    and a fully fine-tuned expert's frozen reference copy is sharded like the policy it copies."""
    from torch.distributed.fsdp import fully_shard

    for name in trained:
        expert = experts[name]
        models = list(getattr(expert, "transformers", None) or [expert.model])
        reference = expert._modules.get("reference_model")
        options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mixed_precision(expert)}
        for model in [*models, *([reference] if reference is not None else [])]:
            for block in transformer_blocks(model):
                fully_shard(block, **options)
            fully_shard(model, **options)


def mixed_precision(expert: Any) -> Any:
    """FSDP2's precision for ``expert``: a full fine-tune whose ``dtype`` is below float32 computes in that dtype
    from its float32 master weights and reduces gradients in float32 (what DeepSpeed's ``bf16`` does); every
    other expert computes in its parameters' own dtype (LoRA: the base's dtype, the adapter's float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = getattr(expert, "dtype", torch.float32)
    if getattr(expert, "finetune", "lora") == "full" and dtype != torch.float32:
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def token_loss_weight(mask: Tensor, strategy: Any) -> float:
    """``world * local_tokens / global_tokens``: the factor that makes rank-averaged token means a global mean."""
    world = strategy.world_size if strategy is not None else 1
    if world == 1:
        return 1.0
    local = mask.sum().to(torch.float64)
    total = strategy.reduce(local.clone(), reduce_op="sum")
    return float(world * local / total.clamp_min(1))


def agree_max(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over all ranks (``value`` itself without a process group).

    Loops whose trip count depends on data (the refiner's decode stops when its sequences end, a batch of
    requests runs as many steps as its longest schedule) must run the same number of iterations on every
    rank: under FSDP2 each iteration's forward all-gathers the sharded weights, and ranks that disagree
    on the count deadlock or abort in the collective.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
