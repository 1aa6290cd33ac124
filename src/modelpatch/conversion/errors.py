"""Exceptions raised by the checkpoint conversion layer."""

from __future__ import annotations

from ..errors import ModelpatchError


class ConversionError(ModelpatchError, ValueError):
    """A conversion rule cannot be applied to a checkpoint or a model.

    Raised before any parameter of the model is touched, so a model is never returned half-loaded.
    The message names the rule, the checkpoint/parameter key and, where relevant, the shapes at fault.
    """


class NothingToConvertError(ConversionError):
    """No conversion rule matches any key of a checkpoint (:func:`~modelpatch.convert_checkpoint`): the output would
    be a copy, so nothing is written. The checkpoint is already in the layout the rules produce, or the rules are for
    another layout (or direction).

    Attributes:
        source: the checkpoint folder or file.
        rules: the rules that were tried.
    """

    def __init__(self, message: str, source: str = "", rules=()):
        self.source = source
        self.rules = list(rules)
        super().__init__(message)


class ConversionShapeError(ConversionError):
    """A converted tensor does not have the shape of the parameter it is destined for.

    Attributes:
        key: the model parameter name.
        converted_shape: shape produced by the rule's operations.
        expected_shape: shape of the model parameter.
    """

    def __init__(self, key: str, converted_shape, expected_shape, rule: str):
        self.key = key
        self.converted_shape = tuple(converted_shape)
        self.expected_shape = tuple(expected_shape)
        self.rule = rule
        super().__init__(
            f"Converted tensor for '{key}' has shape {self.converted_shape} but the model parameter has shape "
            f"{self.expected_shape} (rule: {rule}). Nothing was loaded."
        )


class StateDictLayoutError(ConversionError, RuntimeError):
    """A state dict or checkpoint cannot be loaded exactly into a model that carries conversion rules: the same rows
    named in both layouts (``qkv_proj`` beside ``q_proj``), a tensor whose shape fits no layout, or, with
    ``strict=True``, keys in neither layout or keys missing.

    Raised by ``model.load_state_dict`` (and the loaders built on it) before any parameter is written: the model is
    left as it was. A ``RuntimeError`` too, as ``torch`` raises for a strict load.

    Attributes:
        keys: the keys at fault, as given (and the model keys they name).
    """

    def __init__(self, message: str, keys=()):
        self.keys = tuple(keys)
        super().__init__(message)


class OptimizerStateError(ConversionError):
    """An optimizer state dict cannot be moved between a patched model's layout and the original one
    (:mod:`modelpatch.conversion.optimizer`). Raised before the optimizer is touched.

    Attributes:
        parameter: the parameter at fault (``None`` when the state dict as a whole is at fault).
        layout: the layout ``parameter`` is named in: ``"model"`` (the model's own parameters) or ``"original"``
            (the unpatched model's, as in a checkpoint written without modelpatch).
    """

    def __init__(self, message: str, parameter: str | None = None, layout: str | None = None):
        self.parameter = parameter
        self.layout = layout
        super().__init__(message)
