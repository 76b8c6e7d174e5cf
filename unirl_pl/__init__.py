"""unirl_pl: joint RL of a prompt-refiner LM and a flow-matching generator on PyTorch Lightning."""

__version__ = "0.1.0"
