"""The training data recipe beyond crop and flip: which policy, erasing, mixing and repeats."""
from dataclasses import dataclass

from src.data.auto_augment import create_policy
from src.data.batch_mixing import check_mixing
from src.errors import UserInputError


@dataclass(frozen=True)
class Augmentation:
    """The training data recipe beyond crop and flip (config keys of the same names)."""
    auto_augment: str = "none"     # none | imagenet | cifar10 | svhn | ra | ta_wide | augmix
    ra_num_ops: int = 2
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0      # probability
    mixup_alpha: float = 0.0       # 0: off
    cutmix_alpha: float = 0.0      # 0: off
    ra_reps: int = 1               # repeated augmentation: copies of each sample per epoch

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def needs_batch_stage(self) -> bool:
        """Erasing and mixing act on the normalized batch."""
        return self.random_erase > 0 or self.mixes

    def check(self) -> None:
        """One-line errors naming the key for values out of range."""
        create_policy(self.auto_augment, num_ops=self.ra_num_ops, magnitude=self.ra_magnitude,
                      severity=self.augmix_severity)
        if not 0.0 <= self.random_erase <= 1.0:
            raise UserInputError(f"random_erase is a probability in [0, 1], got {self.random_erase}")
        check_mixing(self.mixup_alpha, self.cutmix_alpha)
        if self.ra_reps < 1:
            raise UserInputError(f"ra_reps must be >= 1 (1 turns repeated augmentation off), got {self.ra_reps}")


PLAIN = Augmentation()
