"""tau^2 C3, multi-step task completion (paper Appendix J.1), on the real retail tools and data models.

One user asks for several independent operations on different orders in one message (cancel one order,
return another, switch the payment of a third, ...). The failure this targets is doing the first and then
closing the conversation. Reward (tau^2 rule, all-or-nothing): the final database hash equals the
ground-truth replay's, i.e. every requested operation was carried out with correct arguments.

Difficulty: the number of requested operations, 2 / 3 / 4 / 5 for levels 0-3. The prompt is a condensed
excerpt of the retail policy and only the tools the task needs plus distractors.
"""

from __future__ import annotations

import random
from typing import Any

from tracekit.targets.tau2.library.common import (PRODUCT_OPTIONS, Ids, Tau2Env, new_instance, pick_items,
                                                    retail_order, retail_product, retail_user)
from tracekit.synthesis.protocol import Instance

POLICY = """# Retail agent policy (excerpt relevant to this task)
Authenticate the user first: locate their user id via email.
You can handle multiple requests from the same user: complete every one of them.
Make at most one tool call at a time, and do not reply to the user in the same turn as a tool call.
Before an action that updates the database, list the details and obtain explicit user confirmation (yes).
Cancel: only 'pending' orders; the reason must be either 'no longer needed' or 'ordered by mistake'.
Modify payment: only pending orders; a single payment method different from the original one; a gift card
must have enough balance.
Return: only 'delivered' orders; the refund goes to the original payment method or an existing gift card."""

REASON_WORDS = {"no longer needed": "I no longer need it", "ordered by mistake": "I ordered it by mistake"}


class MultiStepTaskCompletion(Tau2Env):
    name = "tau2_multi_step_task_completion"
    capability = "multi_step_task_completion"
    description = ("Carry a compound request through to the end: perform every requested operation, in order, "
                   "instead of stopping after the first one.")
    target = "tau2_retail"
    policy = POLICY
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 24
    _tools = ["find_user_id_by_email", "get_user_details", "get_order_details", "cancel_pending_order",
              "return_delivered_order_items", "modify_pending_order_payment", "transfer_to_human_agents"]
    tool_names_by_level = dict.fromkeys(difficulty_levels, _tools)

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        ids = Ids(rng)
        k = self.difficulty + 2
        user = retail_user(rng, ids, paypal=True, gift_card=True)
        pms = user["payment_methods"]
        card = next(p for p, v in pms.items() if v["source"] == "credit_card")
        paypal = next(p for p, v in pms.items() if v["source"] == "paypal")
        gift = next(p for p, v in pms.items() if v["source"] == "gift_card")
        products = [retail_product(rng, ids, name, 3) for name in rng.sample(sorted(PRODUCT_OPTIONS), 8)]
        orders: dict[str, Any] = {}
        requests: list[str] = []
        solution: list[dict[str, Any]] = [{"name": "find_user_id_by_email", "arguments": {"email": user["email"]}}]
        gift_needed = 0.0
        for i in range(k):
            op = rng.choice(["cancel", "return", "payment"])
            order = retail_order(rng, ids, user, pick_items(rng, products, rng.randint(1, 3)),
                                 "delivered" if op == "return" else "pending", card)
            oid = order["order_id"]
            orders[oid] = order
            if op == "cancel":
                reason = rng.choice(sorted(REASON_WORDS))
                requests.append(f"cancel order {oid} because {REASON_WORDS[reason]}")
                write = {"name": "cancel_pending_order", "arguments": {"order_id": oid, "reason": reason}}
            elif op == "return":
                to_gift = rng.random() < 0.5
                requests.append(f"return everything in order {oid} with the refund to "
                                + ("my gift card" if to_gift else "the original payment method"))
                write = {"name": "return_delivered_order_items", "arguments": {
                    "order_id": oid, "item_ids": sorted(it["item_id"] for it in order["items"]),
                    "payment_method_id": gift if to_gift else card}}
            else:
                use_gift = rng.random() < 0.5
                if use_gift:
                    gift_needed += order["payment_history"][0]["amount"]
                requests.append(f"pay for order {oid} with my " + ("gift card" if use_gift else "PayPal account")
                                + " instead of my credit card")
                write = {"name": "modify_pending_order_payment",
                         "arguments": {"order_id": oid, "payment_method_id": gift if use_gift else paypal}}
            solution += [{"name": "get_order_details", "arguments": {"order_id": oid}}, write]
        pms[gift]["balance"] = round(gift_needed + rng.uniform(5, 150), 2)
        # a pending order the user does not mention: touching it breaks the database match
        extra = retail_order(rng, ids, user, pick_items(rng, products, 2), "pending", card)
        orders[extra["order_id"]] = extra
        rng.shuffle(user["orders"])
        listing = "; ".join(f"({i + 1}) {r}" for i, r in enumerate(requests))
        goal = f"Hi, my email is {user['email']}. I have {k} requests: {listing}."
        state = {"products": {p["product_id"]: p for p in products}, "users": {user["user_id"]: user}, "orders": orders}
        return new_instance(seed, POLICY, goal, state, solution,
                            facts={"email": user["email"], "order_id": listing}, params={"operations": k})
