"""tau^2 C2, tool calling precision (paper Appendix J.1), on the real retail tools and data models.

The agent knows which tool to call; the difficulty is its arguments: the order id with its ``#``, item ids
(not product ids) of exactly the items named, the refund payment id the user asked for (original method vs
gift card), the cancellation reason's exact enum value from a paraphrase, a new payment id, a full address.
Reward (tau^2 rule): final database hash equals the ground-truth replay's.

Difficulty: 0 return or cancel, order id given, one order; 1 plus payment-method changes, more items and
payment methods; 2 the order is described by a product it contains, among several orders; 3 plus
shipping-address changes (seven arguments). The prompt is a condensed excerpt of the retail policy and only
the tools the task needs plus distractors.
"""

from __future__ import annotations

import random
from typing import Any

from tracekit.targets.tau2.library.common import (PRODUCT_OPTIONS, Ids, Tau2Env, address, new_instance, pick_items,
                                                    retail_order, retail_product, retail_user)
from tracekit.synthesis.protocol import Instance

POLICY = """# Retail agent policy (excerpt relevant to this task)
Authenticate the user first: locate their user id via email.
Make at most one tool call at a time, and do not reply to the user in the same turn as a tool call.
Before an action that updates the database, list the details and obtain explicit user confirmation (yes).
Cancel: only 'pending' orders; the reason must be either 'no longer needed' or 'ordered by mistake'.
Modify payment: only pending orders; a single payment method different from the original one.
Modify address: only pending orders.
Return: only 'delivered' orders; the refund goes to the original payment method or an existing gift card.
Order ids start with '#'. Item ids and product ids are different things."""

REASONS = {"no longer needed": ["I don't need it anymore", "I no longer need it"],
           "ordered by mistake": ["I ordered it by accident", "I placed it by mistake"]}
KINDS_BY_LEVEL = {0: ["return", "cancel"], 1: ["return", "cancel", "payment"], 2: ["return", "cancel", "payment"],
                  3: ["return", "cancel", "payment", "address"]}


class ToolCallingPrecision(Tau2Env):
    name = "tau2_tool_calling_precision"
    capability = "tool_calling_precision"
    description = ("Call the right tool with exactly the right arguments: ids copied from tool results, the "
                   "payment method the user asked for, enum values matching the user's words.")
    target = "tau2_retail"
    policy = POLICY
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 10
    _base = ["find_user_id_by_email", "get_order_details", "return_delivered_order_items", "cancel_pending_order",
             "calculate", "transfer_to_human_agents"]
    tool_names_by_level = {
        0: _base,
        1: [*_base, "get_user_details", "modify_pending_order_payment"],
        2: [*_base, "get_user_details", "modify_pending_order_payment"],
        3: [*_base, "get_user_details", "modify_pending_order_payment", "modify_pending_order_address"],
    }

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        ids = Ids(rng)
        level = self.difficulty
        kind = rng.choice(KINDS_BY_LEVEL[level])
        user = retail_user(rng, ids, paypal=level >= 1, gift_card=True)
        pms = user["payment_methods"]
        card = next(k for k, v in pms.items() if v["source"] == "credit_card")
        gift = next(k for k, v in pms.items() if v["source"] == "gift_card")
        products = [retail_product(rng, ids, name, rng.randint(3, 5))
                    for name in rng.sample(sorted(PRODUCT_OPTIONS), 6)]
        n_items = {0: 2, 1: 3, 2: 3, 3: 3}[level]
        items = pick_items(rng, products, n_items)
        status = "delivered" if kind == "return" else "pending"
        original = card if level == 0 or kind in ("payment", "address") else rng.choice(
            [k for k, v in pms.items() if v["source"] != "gift_card"])
        orders: dict[str, Any] = {}
        order = retail_order(rng, ids, user, items, status, original)
        orders[order["order_id"]] = order
        for _ in range({0: 0, 1: 1, 2: 2, 3: 2}[level]):  # other orders of the same user
            # other orders never contain the product that identifies the target order
            rest = [p for p in products if p["product_id"] != items[0][0]["product_id"]]
            other = retail_order(rng, ids, user, pick_items(rng, rest, 2),
                                 rng.choice(["delivered", "pending", "processed"]), card)
            orders[other["order_id"]] = other
        rng.shuffle(user["orders"])
        oid = order["order_id"]
        facts: dict[str, str] = {"email": user["email"], "order_id": oid}

        if kind == "return":
            k = rng.randint(1, n_items - 1)
            chosen = rng.sample(items, k)
            to_gift = rng.random() < 0.5
            refund = gift if to_gift else original
            names = " and the ".join(p["name"] for p, _ in chosen)
            where = "my gift card" if to_gift else "the original payment method"
            request = f"I want to return the {names} from order {{order}}; please refund {where}."
            write = {"name": "return_delivered_order_items", "arguments": {
                "order_id": oid, "item_ids": sorted(v["item_id"] for _, v in chosen), "payment_method_id": refund}}
            facts["payment_method"] = where
        elif kind == "cancel":
            reason = rng.choice(sorted(REASONS))
            said = rng.choice(REASONS[reason])
            request = f"Please cancel order {{order}}, {said}."
            write = {"name": "cancel_pending_order", "arguments": {"order_id": oid, "reason": reason}}
            facts["reason"] = said
        elif kind == "payment":
            new_kind = rng.choice(["paypal", "gift_card"])
            new_pm = next(k for k, v in pms.items() if v["source"] == new_kind)
            if new_kind == "gift_card":
                pms[gift]["balance"] = round(order["payment_history"][0]["amount"] + rng.uniform(10, 200), 2)
            said = "PayPal" if new_kind == "paypal" else "gift card"
            request = f"For order {{order}} I'd like to pay with my {said} instead of my credit card."
            write = {"name": "modify_pending_order_payment", "arguments": {"order_id": oid, "payment_method_id": new_pm}}
            facts["payment_method"] = f"my {said}"
        else:
            new = address(rng)
            line = f"{new['address1']}, {new['address2']}, {new['city']}, {new['state']} {new['zip']}, {new['country']}"
            request = f"Please ship order {{order}} to {line} instead."
            write = {"name": "modify_pending_order_address", "arguments": {"order_id": oid, **new}}
            facts["address"] = line

        if level >= 2:
            described = f"my order with the {items[0][0]['name']}"
            facts["order_id"] = described
            request = request.format(order=described)
        else:
            request = request.format(order=oid)
        goal = f"Hi, my email is {user['email']}. {request}"
        solution: list[dict[str, Any]] = [{"name": "find_user_id_by_email", "arguments": {"email": user["email"]}}]
        if level >= 2:
            solution.append({"name": "get_user_details", "arguments": {"user_id": user["user_id"]}})
        solution += [{"name": "get_order_details", "arguments": {"order_id": oid}}, write]
        state = {"products": {p["product_id"]: p for p in products}, "users": {user["user_id"]: user}, "orders": orders}
        return new_instance(seed, POLICY, goal, state, solution, facts=facts, params={"kind": kind, "order_id": oid})
