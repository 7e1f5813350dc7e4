"""hfplan: plan and run RLHF training the HybridFlow way."""

__version__ = "0.1.0"
