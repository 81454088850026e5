"""The ILP solver the planner's searches use: HiGHS through highspy when installed (quiet), CBC
(bundled with PuLP) otherwise."""
from __future__ import annotations

import os
import sys

import pulp

_HIGHS_WARM = False


def _silence_highs_banner() -> None:
    """highspy prints a banner from C++ the first time a solver is built in a process; build
    that first one with stdout pointed at /dev/null so library users see a quiet planner."""
    global _HIGHS_WARM
    if _HIGHS_WARM:
        return
    import highspy   # optional: ilp_solver falls back to CBC without it

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _HIGHS_WARM = True


def ilp_solver():
    """HiGHS through highspy when installed, CBC (bundled with PuLP) otherwise."""
    try:
        import highspy  # noqa: F401

        _silence_highs_banner()

        solver = pulp.HiGHS(msg=False)
        if solver.available():
            return solver, "HiGHS"
    except (ImportError, AttributeError, pulp.PulpSolverError):
        pass
    return pulp.PULP_CBC_CMD(msg=False), "CBC"
