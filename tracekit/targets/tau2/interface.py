"""tau^2's interface as the synthesized environments keep it: each domain's tool schemas and policy, read from the
installed benchmark itself (``AirlineTools`` / ``RetailTools`` on an empty database, ``Tool.openai_schema``), so a
synthetic environment is interface-preserving iff its schemas are equal to these. tau2 is imported only when asked
for (about 1 s: pandas via deepdiff)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _schemas(toolkit: Any) -> dict[str, dict[str, Any]]:
    return {name: tool.openai_schema for name, tool in toolkit.get_tools().items()}


def airline_tools() -> dict[str, dict[str, Any]]:
    from tau2.domains.airline.data_model import FlightDB  # deferred: tau2 loads pandas (about 1 s)
    from tau2.domains.airline.tools import AirlineTools  # deferred: as above

    return _schemas(AirlineTools(FlightDB(flights={}, users={}, reservations={})))


def retail_tools() -> dict[str, dict[str, Any]]:
    from tau2.domains.retail.data_model import RetailDB  # deferred: tau2 loads pandas (about 1 s)
    from tau2.domains.retail.tools import RetailTools  # deferred: as above

    return _schemas(RetailTools(RetailDB(products={}, users={}, orders={})))


def airline_policy() -> str:
    from tau2.domains.airline.utils import AIRLINE_POLICY_PATH  # deferred: tau2 loads pandas (about 1 s)

    return Path(AIRLINE_POLICY_PATH).read_text(encoding="utf-8")


def retail_policy() -> str:
    from tau2.domains.retail.utils import RETAIL_POLICY_PATH  # deferred: tau2 loads pandas (about 1 s)

    return Path(RETAIL_POLICY_PATH).read_text(encoding="utf-8")
