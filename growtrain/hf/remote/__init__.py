"""The remote code that `growtrain export-hf` copies next to the weights: a configuration and a
modeling file that transformers loads with `trust_remote_code=True`. They import torch and
transformers only (never growtrain), so an exported model runs where growtrain is not installed."""
