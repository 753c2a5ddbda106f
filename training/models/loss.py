"""The loss `model.loss` names."""

from __future__ import annotations

from training.config import ConfigError, ModelConfig
from training.models.locate import locate


def build_loss(cfg: ModelConfig):
    """The loss object or function `model.loss` names."""
    import keras

    if ":" in cfg.loss:
        make = locate("model.loss", cfg.loss)
        try:
            return make()
        except Exception as error:
            raise ConfigError(
                f"model.loss={cfg.loss!r} raised {type(error).__name__}: {error}"
            ) from None
    try:
        return keras.losses.get(cfg.loss)
    except ValueError:
        raise ConfigError(
            f"model.loss={cfg.loss!r} is not a Keras loss identifier (e.g. mse, "
            "sparse_categorical_crossentropy) nor module:function"
        ) from None
