"""tau^2 C4, precondition verification (paper Appendix J.1), on the real airline tools and data models.

The user asks to cancel a reservation. The API does not enforce the cancellation policy, so the agent must
look the reservation up and check eligibility before calling ``cancel_reservation``. About half the instances
are eligible. Reward: database equal to the ground-truth replay (cancelled iff eligible) AND the reservation was
looked up before any write AND, when ineligible, the agent told the user it cannot be cancelled.

Difficulty (which policy conditions vary): 0 cabin (business); 1 plus booked within 24 hours; 2 plus insurance
with a covered reason; 3 plus airline-cancelled flights (``get_flight_status``) and already-flown segments.
The prompt is a condensed excerpt of the airline cancellation policy and only the tools the task needs plus
distractors.
"""

from __future__ import annotations

import random
from typing import Any

from tracekit.targets.tau2.library.common import (AIRPORTS, Ids, Tau2Env, airline_flight, airline_user, available,
                                                    created_at, dob, flight_number, flown, future_date,
                                                    looked_up_before_writes, new_instance, person)
from tracekit.synthesis.protocol import Instance
from tracekit.types import Message

REFUSALS = ["cannot", "can't", "can not", "unable", "not eligible", "ineligible", "not able", "not possible",
            "not allowed", "transfer"]
WRITES = {"cancel_reservation", "book_reservation", "update_reservation_flights", "update_reservation_baggages",
          "update_reservation_passengers", "send_certificate"}
COVERED = ["I'm sick and can't travel (health reasons)", "a big storm is forecast there (weather)",
           "I was hospitalised (health reasons)"]
NOT_COVERED = ["my plans changed", "I found a cheaper flight elsewhere", "my meeting was moved"]

POLICY = """# Airline agent policy (excerpt relevant to this task)
The current time is 2024-05-15 15:00:00 EST.
Make at most one tool call at a time, and do not reply to the user in the same turn as a tool call.
Cancel flight: obtain the user id, the reservation id and the reason for cancellation.
If any portion of the flight has already been flown, the agent cannot help and transfer is needed.
Otherwise the reservation can be cancelled if any of the following is true:
- the booking was made within the last 24 hours
- a flight in it was cancelled by the airline
- it is a business class reservation
- the user has travel insurance and the reason (health or weather) is covered by insurance.
The API does not check these rules: you must check them before calling it. If none applies, tell the user the
reservation cannot be cancelled. Before cancelling, obtain explicit user confirmation (yes)."""

CONDITIONS = {0: ["business"], 1: ["business", "recent"], 2: ["business", "recent", "insurance"],
              3: ["business", "recent", "insurance", "airline_cancelled"]}


class PreconditionVerification(Tau2Env):
    name = "tau2_precondition_verification"
    capability = "precondition_verification"
    description = ("Check policy eligibility (booking age, cabin, insurance and reason, flight status) before "
                   "executing a state-changing action; refuse when no condition holds.")
    target = "tau2_airline"
    policy = POLICY
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 10
    _tools = ["get_user_details", "get_reservation_details", "get_flight_status", "cancel_reservation",
              "transfer_to_human_agents", "calculate"]
    tool_names_by_level = dict.fromkeys(difficulty_levels, _tools)

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        ids = Ids(rng)
        active = CONDITIONS[self.difficulty]
        already_flown = self.difficulty == 3 and rng.random() < 0.2
        eligible = not already_flown and rng.random() < 0.5
        holds = {c: False for c in CONDITIONS[3]}
        if eligible:
            holds[rng.choice(active)] = True
            for c in active:
                holds[c] = holds[c] or rng.random() < 0.25
        elif already_flown:
            holds["business"] = rng.random() < 0.5  # eligible on paper, but a segment is flown

        user = airline_user(rng, ids)
        card = next(k for k, v in user["payment_methods"].items() if v["source"] == "credit_card")
        flights: dict[str, Any] = {}
        reservations: dict[str, Any] = {}

        def make_reservation(cabin: str, insured: bool, recent: bool, cancelled_leg: bool, flown_leg: bool) -> str:
            origin, destination = rng.sample(AIRPORTS, 2)
            round_trip = rng.random() < 0.5
            legs = [(origin, destination), (destination, origin)] if round_trip else [(origin, destination)]
            dates = sorted(future_date(rng, 16, 28) for _ in legs)
            if flown_leg:
                dates[0] = f"2024-05-{rng.randint(10, 14):02d}"
            res_flights = []
            for i, ((o, d), date) in enumerate(zip(legs, dates)):
                number = flight_number(ids)
                hour = rng.randint(6, 18)
                status = available(rng)
                if flown_leg and i == 0:
                    status = flown(date, f"{hour:02d}:05:00", f"{hour + 2:02d}:10:00")
                elif cancelled_leg and i == len(legs) - 1:
                    status = {"status": "cancelled"}
                flights[number] = airline_flight(number, o, d, hour, 2, {date: status})
                res_flights.append({"origin": o, "destination": d, "flight_number": number, "date": date,
                                    "price": rng.randint(90, 1200) if cabin == "business" else rng.randint(60, 400)})
            passengers = [{"first_name": user["name"]["first_name"], "last_name": user["name"]["last_name"],
                           "dob": user["dob"]}]
            if rng.random() < 0.4:
                first, last = person(rng)
                passengers.append({"first_name": first, "last_name": last, "dob": dob(rng)})
            amount = sum(f["price"] for f in res_flights) * len(passengers) + (30 * len(passengers) if insured else 0)
            rid = ids.code(6)
            reservations[rid] = {
                "reservation_id": rid, "user_id": user["user_id"], "origin": origin, "destination": destination,
                "flight_type": "round_trip" if round_trip else "one_way", "cabin": cabin, "flights": res_flights,
                "passengers": passengers, "payment_history": [{"payment_id": card, "amount": amount}],
                "created_at": created_at(rng, recent), "total_baggages": 0, "nonfree_baggages": 0,
                "insurance": "yes" if insured else "no",
            }
            user["reservations"].append(rid)
            return rid

        covered_reason = holds["insurance"]
        insured = holds["insurance"] or ("insurance" in active and rng.random() < 0.5)
        cabin = "business" if holds["business"] else rng.choice(["economy", "basic_economy"])
        target = make_reservation(cabin, insured, holds["recent"], holds["airline_cancelled"], already_flown)
        for _ in range(rng.randint(0, 2)):  # other reservations of the same user
            make_reservation(rng.choice(["economy", "business", "basic_economy"]), rng.random() < 0.5,
                             rng.random() < 0.3, False, False)
        reason = rng.choice(COVERED if covered_reason else (NOT_COVERED + (COVERED if not insured else [])))

        first, last = user["name"]["first_name"], user["name"]["last_name"]
        goal = (f"Hi, this is {first} {last}, user id {user['user_id']}. Please cancel my reservation {target}; "
                f"the reason is that {reason}.")
        solution: list[dict[str, Any]] = [{"name": "get_reservation_details", "arguments": {"reservation_id": target}}]
        if self.difficulty == 3:
            solution += [{"name": "get_flight_status", "arguments": {"flight_number": f["flight_number"], "date": f["date"]}}
                         for f in reservations[target]["flights"]]
        if eligible:
            solution.append({"name": "cancel_reservation", "arguments": {"reservation_id": target}})
        state = {"flights": flights, "users": {user["user_id"]: user}, "reservations": reservations}
        return new_instance(
            seed, POLICY, goal, state, solution,
            facts={"user_id": user["user_id"], "reservation_id": target, "reason": reason},
            params={"eligible": eligible, "conditions": holds, "flown": already_flown, "reservation_id": target},
            expected=[] if eligible else [REFUSALS],
        )

    def extra_check(self, instance: Instance, messages: list[Message]) -> bool:
        return looked_up_before_writes(messages, "get_reservation_details", "reservation_id",
                                       instance.params["reservation_id"], WRITES)
