"""Typed utility calls: each allowed method's result type."""

from __future__ import annotations

from pagellm.protocol.messages import UtilityMethod
from pagellm.protocol.stats import EngineStats

RESULT_TYPES: dict[UtilityMethod, type] = {
    UtilityMethod.GET_STATS: EngineStats,
    UtilityMethod.RESET_PREFIX_CACHE: bool,
}
NUM_ARGS: dict[UtilityMethod, int] = {
    UtilityMethod.GET_STATS: 0,
    UtilityMethod.RESET_PREFIX_CACHE: 0,
}
