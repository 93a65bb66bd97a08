"""The metric names and which losses they fit: a leaf the config schema validates `metrics:` with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass



CLASSIFICATION = ("cross_entropy", "binary_cross_entropy")


REGRESSION = ("mse", "mae")


CLASS_METRICS = ("accuracy", "top_k_accuracy", "precision", "recall", "f1", "confusion_matrix", "roc_auc", "log_loss")


REGRESSION_METRICS = ("mse", "mae", "r2")


NAMES = CLASS_METRICS + REGRESSION_METRICS


TOP_K_DEFAULT = 5  # Keras's TopKCategoricalAccuracy default


@dataclass(frozen=True)
class Metric:
    """One entry of the config's `metrics:` list."""

    name: str
    k: int = 0  # top_k_accuracy only

    @property
    def key(self) -> str:
        """The name its value is written under (`val_<key>`)."""
        return f"top_{self.k}_accuracy" if self.name == "top_k_accuracy" else self.name
