"""Spikes: a step whose loss or gradient norm leaves the range of its recent history.

A diverging run often stays finite for a few steps after its weights are ruined: with
``optim.lr=1e6`` on the nano model, the first update saturates the network, the next steps'
gradient norm collapses to 0 (the loss stays finite near ln(vocab)), and only the fourth step is
NaN. Judging each step against the recent admitted steps catches it at the second step, before
its update is applied (`trainer.nonfinite.NonFiniteGuard` then skips it, like a NaN).

The rule (`apply_spike_rule`), with ``f = train.spike_factor`` over the last
``train.spike_window`` admitted steps:

- loss > f x the largest recent loss: Megatron-LM's spiky-loss check (a loss above
  ``SPIKY_LOSS_FACTOR = 10`` times the largest of a trailing window is an error);
- gradient norm > f x the largest recent one: the same rule for the gradient norm, which OLMo-core's
  stability monitor tracks beside the loss (it flags a value above the window's mean + 6 std; a
  ratio to the window's extreme needs one step of history instead of a full window);
- gradient norm < the smallest recent one / f while the loss has not fallen below the smallest
  recent one / f: plait's; saturated weights give a vanishing gradient at an unchanged loss, as
  measured above (a converging objective's gradient falls with its loss: not a collapse).

Values far below the run's own scale are settled, not spiking: a ratio between small numbers is
noise. The largest loss and gradient norm admitted so far set the scale, and a value must also
exceed ``f x SETTLED x`` that scale to spike (``SETTLED = 0.1``: for a language model, whose loss
starts near ln(vocab), Megatron's rule is unchanged once the loss has fallen below a tenth of its
start). Measured on `bench/dpo.py`'s healthy 2000-step DPO run (loss from 0.69 to 1e-8, largest
gradient norm 28.5; the run logged with the rule off): a window-only rule flags 22 of its steps
(the first at step 531: loss 0.433 after ~0.04, gradient norm 14, a hard batch), a floor of 1e-3 x
the scale 22, 1e-2 x 16, 0.1 x none. Without a floor the default rule stopped that run at step 1522.

A healthy run moves its gradient norm smoothly: no step of the bundled recipes' golden runs comes
near a factor 10 (tests/learns keeps them bitwise). Everything stays on the device: no host read.
"""

from __future__ import annotations

import torch

# A value below this fraction of the run's largest admitted one is settled (module docstring).
SETTLED = 0.1


def apply_spike_rule(
    values: torch.Tensor,
    recent: torch.Tensor,
    num_recent: torch.Tensor,
    *,
    factor: float,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whether ``values`` spike against the recent admitted steps (module docstring).

    Args:
        values: [2] float32 (loss, gradient norm) of this step.
        recent: [window, 2] float32, the last admitted steps' (loss, gradient norm), oldest first;
            only the last ``num_recent`` rows are filled.
        num_recent: 0-dim int64 count of filled rows (0: no history, nothing spikes).
        factor: > 1; how far outside its recent range a value must be.
        scale: [2] the largest (loss, gradient norm) admitted so far; None: the recent largest.

    Returns:
        0-dim bool on ``values``' device.
    """
    window = recent.shape[0]
    filled = (torch.arange(window, device=recent.device) >= window - num_recent)[:, None]  # [window, 1]
    largest = torch.where(filled, recent, torch.full_like(recent, -torch.inf)).amax(0)  # [2]
    smallest = torch.where(filled, recent, torch.full_like(recent, torch.inf)).amin(0)  # [2]
    settled = SETTLED * (largest if scale is None else torch.maximum(scale, largest))  # [2]
    too_high = values > factor * torch.maximum(largest, settled)  # loss and gradient norm
    # The gradient norm collapsing while the loss stays: losses may fall far (fine-tuning), and a
    # converging objective's gradient falls with its loss.
    too_low = (values[1] < smallest[1] / factor) & (values[0] >= smallest[0] / factor) & (values[0] > settled[0])
    return (num_recent > 0) & (too_high.any() | too_low)


class SpikeRule:
    """Keeps the recent admitted steps on the device and judges each step against them.

    Args:
        factor: a step spikes when its loss or gradient norm is above ``factor`` x the recent
            largest, or its gradient norm below the recent smallest / ``factor``.
        window: how many admitted steps make the recent history.

    Raises:
        ValueError: ``factor <= 1`` or ``window < 1``.
    """

    def __init__(self, factor: float = 10.0, window: int = 20) -> None:
        if factor <= 1:
            raise ValueError(f"train.spike_factor={factor}: use a factor above 1, or 0 to turn the spike rule off")
        if window < 1:
            raise ValueError(f"train.spike_window={window}: use 1 or more")
        self.factor, self.window = float(factor), window
        self._recent: torch.Tensor | None = None  # [window, 2], created on the values' device
        self._num_recent: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None  # [2], the largest admitted so far

    def _history(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._recent is None or self._num_recent is None or self._scale is None:
            self._recent = torch.zeros(self.window, 2, device=device)
            self._num_recent = torch.zeros((), dtype=torch.int64, device=device)
            self._scale = torch.zeros(2, device=device)
        elif self._recent.device != device:
            self._recent, self._num_recent, self._scale = (
                self._recent.to(device),
                self._num_recent.to(device),
                self._scale.to(device),
            )
        return self._recent, self._num_recent, self._scale

    def spikes(self, values: torch.Tensor, judged: torch.Tensor) -> torch.Tensor:
        """0-dim bool: whether finite ``values`` [2] (loss, gradient norm) spike (`apply_spike_rule`);
        false where 0-dim bool ``judged`` is (a step without supervised tokens has an exact 0
        gradient: it says nothing about the weights)."""
        recent, num_recent, scale = self._history(values.device)
        return judged & apply_spike_rule(values, recent, num_recent, factor=self.factor, scale=scale)

    def observe(self, values: torch.Tensor, admitted: torch.Tensor) -> None:
        """Appends ``values`` [2] to the history where 0-dim bool ``admitted`` is true (on the device)."""
        recent, num_recent, scale = self._history(values.device)
        shifted = torch.cat([recent[1:], values.reshape(1, 2)])
        self._recent = torch.where(admitted, shifted, recent)
        self._num_recent = torch.where(admitted, (num_recent + 1).clamp(max=self.window), num_recent)
        self._scale = torch.where(admitted, torch.maximum(scale, values.reshape(2)), scale)

    def state_dict(self) -> dict[str, list]:
        if self._recent is None or self._num_recent is None or self._scale is None:
            return {"recent": [], "scale": [0.0, 0.0]}
        count = int(self._num_recent)
        return {"recent": self._recent[self.window - count :].tolist() if count else [], "scale": self._scale.tolist()}

    def load_state_dict(self, state: dict[str, list]) -> None:
        rows = state["recent"][-self.window :]
        self._recent = torch.zeros(self.window, 2)
        if rows:
            self._recent[self.window - len(rows) :] = torch.tensor(rows, dtype=torch.float32)
        self._num_recent = torch.tensor(len(rows), dtype=torch.int64)
        # A checkpoint written before the scale was kept: its window's largest.
        self._scale = torch.tensor(
            state.get("scale") or (torch.tensor(rows).amax(0).tolist() if rows else [0.0, 0.0]), dtype=torch.float32
        )
