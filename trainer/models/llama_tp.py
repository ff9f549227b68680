"""The tensor-parallel plan of `trainer.models.llama.Llama` (Megatron's column/row split, with
sequence and loss parallel): what `Llama.tp_plan` returns and `strategies.tensor` applies.

Sources: Shoeybi et al. 2019, "Megatron-LM" (column-wise q/k/v and gate/up, row-wise output and
down projections); Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (sequence parallelism of the norms and the residual stream).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from typing_extensions import override

from strategies.core.shape import ShardsOwnParams


def llama_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """Megatron tensor-parallel plan of a `Llama` ``model``: module-name pattern -> DTensor ``ParallelStyle``.

    q/k/v and gate/up (w1/w3) projections column-wise (each rank holds n_heads/tp query heads,
    n_kv_heads/tp kv heads and ffn_dim/tp features), output and down projections (wo/w2)
    row-wise, the token embedding row-wise (vocabulary rows) and the LM head column-wise.
    With ``sequence_parallel`` the norms and residual stream are sharded on T between blocks
    ([B, T/tp, D] per rank) and gathered at the input of attention and feed-forward. With
    ``loss_parallel`` the logits stay sharded by vocabulary ([B, T, V/tp] DTensor) for the
    cross-entropy under ``torch.distributed.tensor.parallel.loss_parallel``.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if loss_parallel else Replicate()
    plan: dict = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=logits, use_local_output=not loss_parallel),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    # The input of attention and feed-forward becomes one replicated DTensor shared by the
    # column-wise projections (use_local_output=False), so backward sums their partial input
    # gradients first: one all-reduce (or, with SP, one reduce-scatter) per sub-block, the
    # Megatron pattern, instead of one per projection. attention(x, cos, sin, mask): only x.
    prepare = PrepareSinkAttention if model.attention_sinks else PrepareModuleInput
    plan["layers.*.attention"] = prepare(
        input_layouts=(seq, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
    )
    plan["layers.*.feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    if sequence_parallel and model.norm_placement in ("pre", "sandwich"):
        plan.update({"layers.*.attention_norm": SequenceParallel(), "layers.*.ffn_norm": SequenceParallel()})
    if sequence_parallel and model.norm_placement in ("post", "sandwich"):
        # A post-norm takes the row-wise wo/w2 output (sharded on T) and gives a local tensor,
        # as the residual stream between blocks is: the residual add mixes no DTensor in.
        for name in ("post_attention_norm", "post_ffn_norm"):
            plan[f"layers.*.{name}"] = SequenceParallel(use_local_output=True)
    if model.qk_norm:
        # [B, T, heads/tp, E] per rank (a projection-wide norm: [B, T, heads/tp x E], sharded on
        # the features it normalises: ProjectionRMSNorm's mean of squares is then one all-reduce
        # over tp). The norm weight a replicated DTensor, so its gradient, a partial sum over
        # this rank's heads, is summed over tp.
        plan.update(
            {
                f"layers.*.attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                for n in ("q_norm", "k_norm")
            }
        )
    # Pipeline stages drop some of these modules: plan only those present.
    present = {"tok_embeddings": model.tok_embeddings, "output": model.output, "norm": model.norm}
    return {k: v for k, v in plan.items() if present.get(k, True) is not None}


class PrepareSinkAttention(ShardsOwnParams, PrepareModuleInput):
    """`PrepareModuleInput` of an attention with sinks that also shards its ``sinks`` ``[H]`` over
    tp (``Shard(0)``): each rank keeps the sinks of the query heads its column-wise ``wq`` holds."""

    param_tp_dims: ClassVar[dict[str, int]] = {"sinks": 0}

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.sinks
        module.sinks = nn.Parameter(distribute_tensor(sinks.data, device_mesh, [Shard(0)]), sinks.requires_grad)
        return super()._apply(module, device_mesh)
