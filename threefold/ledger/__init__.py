"""The savings ledger (issue 15): per-request entries and their totals by technique (plain Python)."""

from threefold.ledger.entry import CostBasis, LedgerEntry, make_entry
from threefold.ledger.ledger import Ledger, check_cost_per_hour, parse_window

__all__ = ["CostBasis", "Ledger", "LedgerEntry", "check_cost_per_hour", "make_entry", "parse_window"]
