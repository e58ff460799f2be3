"""tau^2 C1, structured data reasoning (paper Appendix J.1), on the real airline tools and data models.

The user asks for the cheapest direct flight on a route and date that satisfies constraints (cabin class,
departure time, seats for the party). ``search_direct_flight`` returns flights with nested per-cabin price and
seat tables; the agent must read the right cabin's price, filter and compare. Reward (tau^2 rule): database
unchanged except for the requested booking (hash vs ground-truth replay) AND the answer names the right flight
and price.

Difficulty: 0 cheapest in a cabin among 3 flights; 1 plus a departure-time filter among 4; 2 plus a
seats-for-the-party filter and the party's total price among 5 (some flights not bookable that day);
3 like 1 among 5 flights, then book it for the user (needs the profile's dob and payment id).
The prompt is a condensed excerpt of the airline policy and only the tools the task needs plus distractors.
"""

from __future__ import annotations

import random
from typing import Any

from tracekit.targets.tau2.library.common import (AIRPORTS, Ids, Tau2Env, airline_flight, airline_user, available,
                                                    flight_number, future_date, new_instance)
from tracekit.synthesis.protocol import Instance

CABIN_WORDS = {"economy": "economy", "business": "business", "basic_economy": "basic economy"}

POLICY = """# Airline agent policy (excerpt relevant to this task)
The current time is 2024-05-15 15:00:00 EST.
You help users find and book flights, using only information from the user and the tools.
Make at most one tool call at a time, and do not reply to the user in the same turn as a tool call.
For each date a flight is bookable only if its status is available; seats and prices are listed per cabin class.
The cabin classes are basic economy, economy and business; basic economy is its own class, distinct from economy.
When you have found the answer, tell the user the flight number and the price."""

BOOKING_POLICY = """
Booking: obtain the user id; all passengers fly the same flights in the same cabin; payment methods must already
be in the user profile. Travel insurance costs 30 dollars per passenger. Do not add checked bags the user does not
need. Before booking, list the details and obtain explicit user confirmation (yes)."""


class StructuredDataReasoning(Tau2Env):
    name = "tau2_structured_data_reasoning"
    capability = "structured_data_reasoning"
    description = ("Parse and cross-reference structured records returned by tools: pick the flight whose nested "
                   "per-cabin price/seat tables satisfy the user's constraints and report or book it correctly.")
    target = "tau2_airline"
    policy = POLICY
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 10
    _reading = ["search_direct_flight", "get_user_details", "get_flight_status", "list_all_airports", "calculate"]
    tool_names_by_level = {0: _reading, 1: _reading, 2: _reading, 3: [*_reading, "book_reservation"]}

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        ids = Ids(rng)
        level = self.difficulty
        n = {0: 3, 1: 4, 2: 5, 3: 5}[level]
        origin, destination = rng.sample(AIRPORTS, 2)
        date = future_date(rng, 16, 27)
        cabin = rng.choice(list(CABIN_WORDS))
        party = rng.choice([2, 3]) if level == 2 else 1
        hours = sorted(rng.sample(range(5, 19), n))
        # distinct prices in the requested cabin, so the answer is unique
        lo, hi = {"basic_economy": (50, 160), "economy": (100, 400), "business": (400, 1500)}[cabin]
        cabin_prices = rng.sample(range(lo, hi), n)

        flights: dict[str, Any] = {}
        candidates = []
        for i, (hour, price) in enumerate(zip(hours, cabin_prices)):
            prices = {cabin: price}
            if cabin == "basic_economy":
                prices["economy"] = price + rng.randint(30, 200)
            if cabin == "business":
                prices["economy"] = max(100, price - rng.randint(200, 600))
            prices.setdefault("basic_economy", max(40, prices["economy"] - rng.randint(20, 90)))
            prices.setdefault("business", prices["economy"] + rng.randint(300, 900))
            seats = {c: rng.randint(3, 20) for c in CABIN_WORDS}
            if level == 2 and i % 2 == 1:
                seats[cabin] = rng.randint(0, party - 1)  # not enough room for the party
            status = available(rng, prices, seats)
            if level >= 2 and i == n - 1:
                status = {"status": "delayed", "estimated_departure_time_est": f"{date}T{hour + 1:02d}:00:00",
                          "estimated_arrival_time_est": f"{date}T{hour + 4:02d}:00:00"}
            number = flight_number(ids)
            flights[number] = airline_flight(number, origin, destination, hour, rng.randint(1, 5), {date: status})
            candidates.append((number, hour, price, seats[cabin], status["status"]))
        for _ in range(2):  # same route on another date and the reverse route: records the filter must skip
            other = future_date(rng, 16, 27)
            number = flight_number(ids)
            if other != date:
                flights[number] = airline_flight(number, origin, destination, rng.randint(5, 18), 2, {other: available(rng)})
            else:
                flights[number] = airline_flight(number, destination, origin, rng.randint(5, 18), 2, {date: available(rng)})

        after = hours[rng.randint(1, n - 2)] if level in (1, 2, 3) else None
        eligible = [c for c in candidates
                    if c[4] == "available" and c[3] >= party and (after is None or c[1] >= after)]
        if not eligible:  # keep the task solvable: free up the last time slot
            number, hour, price, _, _ = candidates[-2]
            flights[number]["dates"][date]["available_seats"][cabin] = party + 2
            eligible = [(number, hour, price, party + 2, "available")]
        best_number, _, best_price, _, _ = min(eligible, key=lambda c: c[2])
        total = best_price * party

        user = airline_user(rng, ids, gift_card=True)
        users = {user["user_id"]: user}
        first, last = user["name"]["first_name"], user["name"]["last_name"]
        when = f" departing at or after {after:02d}:00" if after is not None else ""
        who = f" for {party} passengers" if party > 1 else ""
        goal = (f"Hi, I'm {first} {last} (user id {user['user_id']}). What is the cheapest direct "
                f"{CABIN_WORDS[cabin]} flight from {origin} to {destination} on {date}{when}{who}? "
                "Please tell me the flight number and the " + ("total price." if party > 1 else "price."))
        solution: list[dict[str, Any]] = [
            {"name": "search_direct_flight", "arguments": {"origin": origin, "destination": destination, "date": date}}]
        facts = {"user_id": user["user_id"], "name": f"{first} {last}"}
        policy = POLICY
        if level == 3:
            pay_kind = rng.choice(["credit_card", "gift_card"])
            pay_id = next(k for k, v in user["payment_methods"].items() if v["source"] == pay_kind)
            if pay_kind == "gift_card":
                user["payment_methods"][pay_id]["amount"] = float(best_price + rng.randint(50, 300))
            goal += (f" Then book it for me only (one way, no checked bags, no insurance), paid with my "
                     f"{pay_kind.replace('_', ' ')}.")
            facts["payment_method"] = f"my {pay_kind.replace('_', ' ')}"
            solution += [
                {"name": "get_user_details", "arguments": {"user_id": user["user_id"]}},
                {"name": "book_reservation", "arguments": {
                    "user_id": user["user_id"], "origin": origin, "destination": destination, "flight_type": "one_way",
                    "cabin": cabin, "flights": [{"flight_number": best_number, "date": date}],
                    "passengers": [{"first_name": first, "last_name": last, "dob": user["dob"]}],
                    "payment_methods": [{"payment_id": pay_id, "amount": best_price}],
                    "total_baggages": 0, "nonfree_baggages": 0, "insurance": "no"}},
            ]
            policy = POLICY + BOOKING_POLICY
        state = {"flights": flights, "users": users, "reservations": {}}
        return new_instance(
            seed, policy, goal, state, solution, facts=facts,
            params={"cabin": cabin, "after": after, "party": party, "answer": best_number, "total": total},
            expected=[[best_number], [str(total)]],
        )
