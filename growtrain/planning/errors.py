"""The planner's one error type, at the bottom so that every planning module can raise it."""


class PlanError(Exception):
    """A planning request that cannot be answered (unknown preset, missing vocabulary size)."""
