"""Offline lm-evaluation-harness tasks for exported models (installed as growtrain.evals): pass
this folder to `lm_eval --include_path`. See evals/README.md."""
