"""Predicted versus issued: dry runs of plans at their real world size."""
from autoplan.verify.dry_common import VerifyResult
from autoplan.verify.dry_run import issued_collectives, verify

__all__ = ["VerifyResult", "issued_collectives", "verify"]
