from kk_jax.checkpoint.loader import CheckpointError, load_params  # noqa: F401
