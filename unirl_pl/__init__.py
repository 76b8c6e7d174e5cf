"""unirl_pl: joint RL of a prompt-refiner LM and a flow-matching generator on PyTorch Lightning."""

import logging

__version__ = "0.1.0"


class _NoTorchvisionFallbackNotice(logging.Filter):
    """Drop transformers' notice that an image processor falls back to its PIL version without torchvision.

    Importing diffusers' pipelines names two such processors on every start; the project uses none of
    them, so the notices only hide the lines that matter. Other warnings of that logger pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("requires torchvision" in message and "falling back to" in message)


# On transformers' logger object itself (logging.getLogger returns the same one), before it is imported.
logging.getLogger("transformers.utils.import_utils").addFilter(_NoTorchvisionFallbackNotice())
