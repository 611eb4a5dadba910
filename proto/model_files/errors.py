"""The one error for a model that cannot be loaded, raised by the pod's loader and by the
router's tokenizer loader alike."""


class ModelLoadError(ValueError):
    """A model directory, preset or config that cannot be loaded (missing file,
    unsupported architecture, tensor of the wrong shape...)."""
