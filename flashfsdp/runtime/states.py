"""The two state machines of a unit: where its parameters are (ShardState) and where it is in the
step (TrainingState). The runtime and the overlap simulator both move units through them."""

from __future__ import annotations

import enum


class ShardState(enum.Enum):
    """Whether a unit's parameters are sharded, being gathered, or unsharded."""

    SHARDED = "sharded"
    SECONDARY = "sharded over the post-forward group"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


class TrainingState(enum.Enum):
    """Where a unit is in the current step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
