"""fp16 loss scaling: static, or dynamic with hysteresis (Megatron semantics).

The decision to skip a step needs the overflow flag on the host, so fp16 pays one device sync
per step (as every fp16 trainer does); bf16 and fp32 never create a scaler.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron3d.config import PrecisionConfig


@dataclass
class LossScaler:
    """Multiply the loss by ``scale``; halve it after ``hysteresis`` overflows, double it
    after ``window`` clean steps. A static scaler (``dynamic=False``) never changes."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    _clean_steps: int = 0
    _overflows_left: int = 2

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> LossScaler:
        if cfg.loss_scale is not None:
            return cls(scale=cfg.loss_scale, dynamic=False)
        return cls(scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale,
                   window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
                   _overflows_left=cfg.hysteresis)

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self._clean_steps = 0
            self._overflows_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._overflows_left = state["overflows_left"]
