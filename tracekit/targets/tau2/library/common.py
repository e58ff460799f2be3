"""Shared pieces of the tau^2 reference environments: a world backed by the REAL tau^2 data models and
toolkits (``FlightDB``/``AirlineTools``, ``RetailDB``/``RetailTools``), small procedurally generated databases,
and the tau^2 verifier (DB hash vs ground-truth replay, times the communicate check).

Generated environments may import this module too (the generation prompt says so).
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any, ClassVar

from loguru import logger

from tracekit.synthesis.protocol import Instance, SyntheticEnv, World, communicated, db_match, tool_calls_of
from tracekit.synthesis.targets import tool_schemas
from tracekit.types import Message

# The toolkits log every cancellation at WARNING ("Seats release not implemented"): silence only them.
logger.disable("tau2.domains.airline.tools")
logger.disable("tau2.domains.retail.tools")

AIRLINE_NOW = datetime(2024, 5, 15, 15, 0, 0)  # tau^2 airline's fixed "current time"
AIRPORTS = ["SFO", "JFK", "LAX", "ORD", "DFW", "DEN", "SEA", "ATL", "MIA", "BOS",
            "PHX", "IAH", "LAS", "MCO", "EWR", "CLT", "MSP", "DTW", "PHL", "LGA"]
FIRST_NAMES = ["Mia", "Noah", "Aarav", "Sofia", "Omar", "Lucas", "Yara", "Ethan", "Amelia", "Raj", "Chen",
               "Fatima", "Liam", "Olivia", "Mei", "Ivan", "Emma", "Juan", "Anya", "Kenji", "Lei", "Sara",
               "Yusuf", "Isabella", "Harper", "Mateo", "Nia", "Daiki", "Zoe", "Ava"]
LAST_NAMES = ["Li", "Brown", "Patel", "Rossi", "Khan", "Martin", "Garcia", "Kim", "Ahmed", "Smith", "Jackson",
              "Lopez", "Nguyen", "Silva", "Wang", "Muller", "Sato", "Johnson", "Moore", "Taylor", "Anderson",
              "Thomas", "Hernandez", "Wilson", "Davis", "Lee", "Clark", "Lewis", "Young", "Hall"]
STREETS = ["Sunset Drive", "River Road", "Main Street", "Elm Street", "Lakeview Avenue", "Hillside Lane",
           "Park Avenue", "Maple Drive", "Oak Street", "Cedar Road"]
CITIES = [("Austin", "TX", "787"), ("Denver", "CO", "802"), ("New York", "NY", "100"), ("Seattle", "WA", "981"),
          ("Chicago", "IL", "606"), ("Phoenix", "AZ", "850"), ("Boston", "MA", "021"), ("Miami", "FL", "331")]
CARD_BRANDS = ["visa", "mastercard", "amex"]


class Ids:
    """Random identifiers that never repeat within one database."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def new(self, make) -> str:
        while True:
            value = make(self.rng)
            if value not in self.used:
                self.used.add(value)
                return value

    def digits(self, n: int, prefix: str = "") -> str:
        return self.new(lambda r: prefix + "".join(r.choice("0123456789") for _ in range(n)))

    def code(self, n: int = 6) -> str:
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        return self.new(lambda r: "".join(r.choice(alphabet) for _ in range(n)))


def person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)


def dob(rng: random.Random) -> str:
    return f"{rng.randint(1950, 2002)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def address(rng: random.Random) -> dict[str, str]:
    city, state, zip3 = rng.choice(CITIES)
    return {"address1": f"{rng.randint(100, 999)} {rng.choice(STREETS)}", "address2": f"Suite {rng.randint(100, 999)}",
            "city": city, "country": "USA", "state": state, "zip": f"{zip3}{rng.randint(10, 99)}"}


def money(rng: random.Random, lo: float, hi: float) -> float:
    return round(rng.uniform(lo, hi), 2)


# ------------------------------------------------------------------------------------------------- world


class Tau2World(World):
    """A tau^2 database (validated by the real pydantic model) with the real toolkit on top."""

    def __init__(self, target: str, state: dict[str, Any]):
        if target == "tau2_airline":
            from tau2.domains.airline.data_model import FlightDB
            from tau2.domains.airline.tools import AirlineTools

            self.db = FlightDB.model_validate(state)
            self.toolkit = AirlineTools(self.db)
        elif target == "tau2_retail":
            from tau2.domains.retail.data_model import RetailDB
            from tau2.domains.retail.tools import RetailTools

            self.db = RetailDB.model_validate(state)
            self.toolkit = RetailTools(self.db)
        else:
            raise ValueError(f"not a tau2 target: {target}")

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        return self.toolkit.use_tool(name, **arguments)

    def snapshot(self) -> dict[str, Any]:
        return self.toolkit.db.model_dump(mode="json")


class Tau2Env(SyntheticEnv):
    """A tau^2 synthetic environment: real toolkit, target's schemas, tau^2's reward rule.

    Subclasses set ``target``, ``tool_names_by_level`` and implement ``generate``; ``extra_check`` adds
    capability-specific conditions on the trajectory (e.g. a precondition lookup before a write).
    """

    tool_names_by_level: ClassVar[dict[int, list[str]]]

    def tools(self) -> list[dict[str, Any]]:
        return tool_schemas(self.target, self.tool_names_by_level[self.difficulty])

    def new_world(self, instance: Instance) -> World:
        return Tau2World(self.target, instance.state)

    def extra_check(self, instance: Instance, messages: list[Message]) -> bool:
        return True

    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        ok = (
            db_match(self, instance, final_state)
            and communicated(messages, instance.expected_outputs)
            and self.extra_check(instance, messages)
        )
        return (1.0 if ok else 0.0), ok


def looked_up_before_writes(messages: list[Message], read_tool: str, key: str, value: str, writes: set[str]) -> bool:
    """The agent called ``read_tool`` with ``key == value`` before its first call to any tool in ``writes``."""
    for call in tool_calls_of(messages):
        if call.name == read_tool and str(call.arguments.get(key)) == value:
            return True
        if call.name in writes:
            return False
    return False


# ----------------------------------------------------------------------------------------------- airline


def airline_user(rng: random.Random, ids: Ids, membership: str | None = None, gift_card: bool = True,
                 certificate: bool = False) -> dict[str, Any]:
    first, last = person(rng)
    pm: dict[str, Any] = {}
    cc = ids.digits(7, "credit_card_")
    pm[cc] = {"source": "credit_card", "id": cc, "brand": rng.choice(CARD_BRANDS), "last_four": f"{rng.randint(0, 9999):04d}"}
    if gift_card:
        gc = ids.digits(7, "gift_card_")
        pm[gc] = {"source": "gift_card", "id": gc, "amount": float(rng.randint(100, 600))}
    if certificate:
        ce = ids.digits(7, "certificate_")
        pm[ce] = {"source": "certificate", "id": ce, "amount": float(rng.choice([100, 150, 250]))}
    return {
        "user_id": ids.new(lambda r: f"{first.lower()}_{last.lower()}_{r.randint(1000, 9999)}"),
        "name": {"first_name": first, "last_name": last},
        "address": address(rng),
        "email": f"{first.lower()}.{last.lower()}{rng.randint(1000, 9999)}@example.com",
        "dob": dob(rng),
        "payment_methods": pm,
        "saved_passengers": [],
        "membership": membership or rng.choice(["gold", "silver", "regular"]),
        "reservations": [],
    }


def hhmm(hour: int, minute: int = 0) -> str:
    return f"{hour:02d}:{minute:02d}:00"


def seat_prices(rng: random.Random) -> dict[str, int]:
    basic = rng.randint(50, 140)
    economy = basic + rng.randint(30, 160)
    return {"basic_economy": basic, "economy": economy, "business": economy + rng.randint(200, 900)}


def available(rng: random.Random, prices: dict[str, int] | None = None, seats: dict[str, int] | None = None) -> dict:
    return {
        "status": "available",
        "available_seats": seats or {c: rng.randint(1, 20) for c in ("basic_economy", "economy", "business")},
        "prices": prices or seat_prices(rng),
    }


def flown(date: str, dep: str, arr: str) -> dict:
    return {"status": "landed", "actual_departure_time_est": f"{date}T{dep}", "actual_arrival_time_est": f"{date}T{arr}"}


def airline_flight(number: str, origin: str, destination: str, dep_hour: int, hours: int,
                   dates: dict[str, dict]) -> dict[str, Any]:
    return {
        "flight_number": number,
        "origin": origin,
        "destination": destination,
        "scheduled_departure_time_est": hhmm(dep_hour),
        "scheduled_arrival_time_est": hhmm(dep_hour + hours) if dep_hour + hours < 24 else hhmm(dep_hour + hours - 24) + "+1",
        "dates": dates,
    }


def flight_number(ids: Ids) -> str:
    return ids.new(lambda r: f"HAT{r.randint(1, 299):03d}")


def future_date(rng: random.Random, lo: int = 16, hi: int = 29) -> str:
    return f"2024-05-{rng.randint(lo, hi):02d}"


def created_at(rng: random.Random, within_24h: bool) -> str:
    if within_24h:
        delta = timedelta(minutes=rng.randint(30, 23 * 60))
    else:
        delta = timedelta(days=rng.randint(2, 40), minutes=rng.randint(0, 1439))
    return (AIRLINE_NOW - delta).strftime("%Y-%m-%dT%H:%M:%S")


# ------------------------------------------------------------------------------------------------ retail

PRODUCT_OPTIONS: dict[str, dict[str, list[str]]] = {
    "T-Shirt": {"color": ["blue", "red", "black", "white"], "size": ["S", "M", "L", "XL"], "material": ["cotton", "polyester"]},
    "Water Bottle": {"capacity": ["500ml", "750ml", "1000ml"], "material": ["glass", "plastic", "stainless steel"],
                     "color": ["blue", "green", "black"]},
    "Running Shoes": {"size": ["8", "9", "10", "11"], "color": ["red", "black", "white"], "material": ["mesh", "leather"]},
    "Desk Lamp": {"color": ["white", "black", "silver"], "brightness": ["low", "medium", "high"],
                  "power source": ["AC adapter", "battery", "USB"]},
    "Backpack": {"color": ["grey", "navy", "green"], "size": ["small", "medium", "large"], "material": ["nylon", "leather"]},
    "Headphones": {"type": ["over-ear", "on-ear", "in-ear"], "connectivity": ["wired", "wireless"], "color": ["black", "white"]},
    "Yoga Mat": {"thickness": ["4mm", "6mm", "8mm"], "material": ["PVC", "natural rubber", "TPE"], "color": ["pink", "blue"]},
    "Wall Clock": {"diameter": ["10 inches", "12 inches", "14 inches"], "color": ["black", "white", "wood"],
                   "type": ["analog", "digital"]},
    "Bluetooth Speaker": {"color": ["black", "blue", "red"], "battery life": ["10 hours", "20 hours"],
                          "water resistance": ["yes", "no"]},
    "Sunglasses": {"frame color": ["black", "brown", "silver"], "lens color": ["green", "grey", "blue"],
                   "lens type": ["polarized", "non-polarized"]},
    "Electric Kettle": {"capacity": ["1L", "1.5L", "2L"], "material": ["plastic", "glass", "stainless steel"],
                        "color": ["white", "black"]},
    "Mechanical Keyboard": {"switch type": ["linear", "tactile", "clicky"], "backlight": ["none", "white", "RGB"],
                            "size": ["full size", "80%"]},
}


def retail_product(rng: random.Random, ids: Ids, name: str, n_variants: int) -> dict[str, Any]:
    opts = PRODUCT_OPTIONS[name]
    base = money(rng, 20, 300)
    combos: list[dict[str, str]] = []
    while len(combos) < n_variants:
        combo = {k: rng.choice(v) for k, v in opts.items()}
        if combo not in combos:
            combos.append(combo)
    variants = {}
    for combo in combos:
        item_id = ids.digits(10)
        variants[item_id] = {"item_id": item_id, "options": combo, "available": rng.random() < 0.85,
                             "price": round(base * rng.uniform(0.85, 1.15), 2)}
    return {"name": name, "product_id": ids.digits(10), "variants": variants}


def retail_user(rng: random.Random, ids: Ids, paypal: bool = True, gift_card: bool = True) -> dict[str, Any]:
    first, last = person(rng)
    pm: dict[str, Any] = {}
    cc = ids.digits(7, "credit_card_")
    pm[cc] = {"source": "credit_card", "id": cc, "brand": rng.choice(CARD_BRANDS), "last_four": f"{rng.randint(0, 9999):04d}"}
    if paypal:
        pp = ids.digits(7, "paypal_")
        pm[pp] = {"source": "paypal", "id": pp}
    if gift_card:
        gc = ids.digits(7, "gift_card_")
        pm[gc] = {"source": "gift_card", "id": gc, "balance": money(rng, 20, 400)}
    return {
        "user_id": ids.new(lambda r: f"{first.lower()}_{last.lower()}_{r.randint(1000, 9999)}"),
        "name": {"first_name": first, "last_name": last},
        "address": address(rng),
        "email": f"{first.lower()}.{last.lower()}{rng.randint(1000, 9999)}@example.com",
        "payment_methods": pm,
        "orders": [],
    }


def retail_order(rng: random.Random, ids: Ids, user: dict[str, Any], items: list[tuple[dict, dict]], status: str,
                 payment_method_id: str) -> dict[str, Any]:
    """``items``: (product, variant) pairs; the order is appended to the user's order list."""
    order_items = [{"name": p["name"], "product_id": p["product_id"], "item_id": v["item_id"], "price": v["price"],
                    "options": dict(v["options"])} for p, v in items]
    fulfillments = []
    if status in ("processed", "delivered"):
        fulfillments = [{"tracking_id": [ids.digits(12)], "item_ids": [i["item_id"] for i in order_items]}]
    order = {
        "order_id": ids.digits(7, "#W"),
        "user_id": user["user_id"],
        "address": dict(user["address"]),
        "items": order_items,
        "status": status,
        "fulfillments": fulfillments,
        "payment_history": [{"transaction_type": "payment", "amount": round(sum(i["price"] for i in order_items), 2),
                             "payment_method_id": payment_method_id}],
    }
    user["orders"].append(order["order_id"])
    return order


def pick_items(rng: random.Random, products: list[dict[str, Any]], n: int) -> list[tuple[dict, dict]]:
    """``n`` (product, variant) pairs from distinct products."""
    chosen = rng.sample(products, n)
    return [(p, rng.choice(list(p["variants"].values()))) for p in chosen]


def new_instance(seed: int, policy: str, goal: str, state: dict[str, Any], solution: list[dict[str, Any]],
                 facts: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                 expected: list[list[str]] | None = None) -> Instance:
    return Instance.model_validate({
        "seed": seed, "system_prompt": policy, "user_goal": goal, "user_facts": facts or {}, "state": state,
        "params": params or {}, "solution": solution, "expected_outputs": expected or [],
    })
