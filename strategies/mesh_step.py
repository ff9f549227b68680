"""`MeshStep`: the parallel parts of one optimizer step of `strategies.mesh.MeshStrategy`.

This rank's micro-batches (cp sharding or hybrid placement), the loss context (loss parallel), the
forward/backward of every micro-batch (gradient sync once per step; SAT and Mixout around it; the
pipeline schedule under pp), the global gradient norm and clipping, and the token-count reductions.
Subclass `MeshStrategy` and override one of these to change a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from strategies.cp_placement import micro_batches_of
from strategies.grad_norm import clip_grads_, global_grad_norm


class MeshStep:
    """Step methods mixed into `MeshStrategy` (before Lightning's strategy in its bases).

    Uses the strategy's ``dims``, ``submesh``, ``group``, ``root_device``, ``lightning_module``, and
    its plugins ``context_parallel``, ``tensor_parallel``, ``pipeline``, ``sat``, ``mixout``,
    ``local_sgd`` and ``compute_timer``.
    """

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of its dp rows, before the step counts tokens: with cp > 1 its slice of
        the sequence dimension (`strategies.context.shard_batch`); else the rows unchanged.
        ``[B, 2, T]`` preference pairs are never split: every cp rank evaluates them whole
        (`eval_loss_sum`), so the sums and counts over dp x cp are ``cp`` times alike."""
        if self.dims.cp > 1 and batch["input_ids"].dim() == 2:
            cp_mesh = self.submesh("cp")
            return self.context_parallel.shard_batch(batch, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank())
        return batch

    def micro_batches(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of its dp rows (`shard_batch`, then runs of ``micro_batch_size``
        rows); with cp > 1 the context-parallel plugin's (hybrid placement trains some rows whole:
        `strategies.cp_placement`)."""
        if self.dims.cp > 1:
            cp_mesh = self.submesh("cp")
            return self.context_parallel.micro_batches(
                batch, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank(), micro_batch_size=micro_batch_size
            )
        return micro_batches_of(batch, micro_batch_size)

    def whole_rows(self) -> AbstractContextManager[None]:
        """Forwards inside attend over whole rows on this rank: with cp > 1 the one-process
        attention core (preference pairs, which hybrid placement trains whole: `strategies.cp_placement`)."""
        return self.context_parallel.whole_rows() if self.dims.cp > 1 else nullcontext()

    @contextmanager
    def loss_context(self) -> Iterator[None]:
        """Context for the loss and its backward: tensor parallelism's loss parallel when tp > 1."""
        if self.dims.tp > 1:
            with self.tensor_parallel.loss_context():
                yield
        else:
            yield

    def eval_loss_sum(
        self, model: nn.Module, batch: dict[str, torch.Tensor], loss_sum: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        """Summed token loss of one (sharded) evaluation batch on this rank, without gradients.

        With pp > 1 a forward through the stages; every pp rank returns the batch's loss.
        Preference pairs (``[B, 2, T]``) attend whole (`whole_rows`)."""
        if self.dims.pp > 1:
            with self.loss_context():
                return self.pipeline.eval_loss_sum(batch, loss_sum)
        with self.loss_context(), self.whole_rows() if batch["input_ids"].dim() == 3 else nullcontext():
            return loss_sum(model, batch)

    def forward_backward(
        self,
        model: nn.Module,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step.

        Args:
            micro_batches: this rank's micro-batches, each a dict of [b, s] tensors.
            loss_fn: returns the micro-batch loss, already divided by the step's global
                supervised-token count (so the micro-batch losses of all ranks add up to the mean).
            backward: the Task's ``manual_backward``.

        Returns:
            0-dim tensor: the sum of this rank's micro-batch losses (detached). With pp > 1 the
            pipeline schedule runs them (``backward`` unused) and every pp rank returns the sum.
        """
        with ExitStack() as stack:
            # SAT picks the step's MLP channels; Mixout mixes the weights and, on exit, restores
            # them and rescales their gradients, before the gradient norm.
            for plugin in (self.sat, self.mixout):
                if plugin is not None:
                    stack.enter_context(plugin.step(self.lightning_module.global_step))
            return self._forward_backward(model, micro_batches, loss_fn, backward)

    def _forward_backward(
        self,
        model: nn.Module,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        if self.dims.pp > 1:
            with self.loss_context():
                return self.pipeline.forward_backward(micro_batches, loss_fn)
        total = torch.zeros((), device=self.root_device)
        last = len(micro_batches) - 1
        self.compute_timer.start_step()
        for i, micro_batch in enumerate(micro_batches):
            if isinstance(model, FSDPModule):
                # Reduce gradients once per step, after the last micro-batch, not once per micro-batch.
                model.set_requires_gradient_sync(i == last)
            # loss parallel needs its context in forward and backward; whole rows attend on one cp rank
            with self.loss_context(), self.context_parallel.training(micro_batch) as rows:
                with self.compute_timer.measure(self.root_device):  # up to the gradient sync
                    loss = loss_fn(model, rows)
                    if i < last:
                        backward(loss)
                if i == last:
                    backward(loss)
            total += loss.detach()
        return total

    def grad_norm(self, parameters: Sequence[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all shards, replicas and stages; equal on every rank."""
        stage_groups = [self.group("pp")] if self.dims.pp > 1 else []
        return global_grad_norm(parameters, norm_type=norm_type, stage_groups=stage_groups)

    def clip_grads(self, parameters: Sequence[nn.Parameter], *, max_norm: float, total_norm: torch.Tensor) -> None:
        clip_grads_(parameters, max_norm=max_norm, total_norm=total_norm)

    @property
    def token_axis(self) -> str:
        """The mesh view whose ranks share one gradient and so count a step's supervised tokens
        together: dp_cp, or one island's dp_shard (x cp) under local SGD (each island's gradient is
        the mean over its own tokens; the replicas are averaged by the plugin)."""
        if self.local_sgd is None:
            return "dp_cp"
        return "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"

    def all_reduce_sum(self, tensor: torch.Tensor, axis: str = "dp_cp") -> torch.Tensor:
        """In-place SUM over one mesh axis (a no-op on a single rank); returns ``tensor``."""
        if self.submesh(axis).size() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group(axis))
        return tensor
