"""Mixed precision: the amp level per device and the loss-scale manager, checked before any work."""
from typing import Optional

from mindspore import amp, nn
from mindspore.train import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager

from src.errors import UserInputError

AMP_LEVELS = ("O0", "O1", "O2", "O3")
LOSS_SCALE_TYPES = ("none", "fixed", "dynamic")
# Ascend and GPU train ResNet in float16 with float32 BatchNorm (O2), as the model zoo does.
DEFAULT_AMP = {"CPU": "O0", "GPU": "O2", "Ascend": "O2"}


def resolve_amp_level(amp_level: str, device_target: str) -> str:
    """'auto' picks the device's default; anything else must be O0..O3."""
    if amp_level == "auto":
        return DEFAULT_AMP.get(device_target, "O0")
    if amp_level not in AMP_LEVELS:
        raise UserInputError(f"unknown amp_level '{amp_level}'; choose auto or one of {', '.join(AMP_LEVELS)}")
    return amp_level


def create_loss_scale_manager(loss_scale_type: str, loss_scale: float) -> Optional[LossScaleManager]:
    """None, a fixed scale, or a dynamic scale starting at `loss_scale` (halved on an overflow). The
    train step skips a step with non-finite gradients under each of them."""
    if loss_scale_type not in LOSS_SCALE_TYPES:
        raise UserInputError(f"unknown loss_scale_type '{loss_scale_type}'; choose one of "
                             f"{', '.join(LOSS_SCALE_TYPES)}")
    if loss_scale_type == "none":
        return None
    if loss_scale <= 0:
        raise UserInputError(f"loss_scale must be positive, got {loss_scale}")
    if loss_scale_type == "dynamic":
        # The train step finds overflow with a finiteness check of the gradients, which works on
        # every device (CPU has no hardware overflow status).
        return DynamicLossScaleManager(init_loss_scale=loss_scale, scale_factor=2, scale_window=2000)
    return FixedLossScaleManager(loss_scale, drop_overflow_update=False)


def mixed_precision_network(net: nn.Cell, amp_level: str) -> nn.Cell:
    """`net` converted in place for `amp_level` (O2 keeps BatchNorm in float32); returns the cell
    to call, which may wrap `net` (O0 returns `net` itself)."""
    if amp_level == "O0":
        return net
    return amp.auto_mixed_precision(net, amp_level)
