"""What each request cost: the ledger's rows (``store``), the usage report read from them (``report``)
and the fleet's hourly aggregates (``fleet``)."""
