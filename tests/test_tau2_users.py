"""Simulated users: the scripted rules and tau^2's LLM user prompt driven through a ChatClient."""

from __future__ import annotations

from tracekit.targets.tau2.users import (
    LLMUser,
    ScriptedUser,
    UserScenario,
    first_person,
    known_facts,
    opening_message,
    scripted_reply,
    stop_token,
)
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.types import Message

RETAIL = UserScenario(
    instructions="Instructions: ...",
    reason_for_call="You want to change #W8665881 to be delivered to Suite 641 instead.\n\nSecond paragraph.",
    known_info="You are Fatima Johnson in zipcode 78712.",
    unknown_info="You do not remember your email address",
    task_instructions="If the agent asks, the other order is #W1234567.",
)
AIRLINE = UserScenario(
    instructions="Instructions: ...",
    reason_for_call="You want to cancel reservation EHGLP3 (flight HAT156). The agent told you it was fine.",
    known_info="You are Emma Kim.\nYour user id is emma_kim_9957.\nYour email is emma.kim@example.com.",
)


def test_known_facts_from_the_scenario():
    f = known_facts(RETAIL)
    assert (f.name, f.zip, f.user_id, f.email) == ("Fatima Johnson", "78712", None, None)
    assert f.order_ids == ("#W8665881", "#W1234567")
    g = known_facts(AIRLINE)
    assert (g.name, g.user_id, g.email) == ("Emma Kim", "emma_kim_9957", "emma.kim@example.com")
    assert g.reservation_ids == ("EHGLP3",)  # the flight number HAT156 is not a reservation id


def test_opening_is_the_first_paragraph_in_the_first_person():
    assert opening_message(RETAIL) == "I want to change #W8665881 to be delivered to Suite 641 instead."
    assert first_person("The agent told you that your flight is fine.") == "The agent told me that my flight is fine."
    assert opening_message(AIRLINE, max_chars=60) == "I want to cancel reservation EHGLP3 (flight HAT156)."


def test_scripted_replies():
    assert scripted_reply(RETAIL, "Could you give me your email?", 1, 10) == "I don't remember my email address."
    assert scripted_reply(RETAIL, "Please provide your name and zip code.", 1, 10) == "My name is Fatima Johnson. My zip code is 78712."
    assert scripted_reply(RETAIL, "What is the order id?", 1, 10) == "The order id is #W8665881, #W1234567."
    assert scripted_reply(AIRLINE, "Can I have your user id?", 1, 10) == "My user id is emma_kim_9957."
    assert scripted_reply(AIRLINE, "Which reservation is it?", 1, 10) == "The reservation id is EHGLP3."
    assert scripted_reply(AIRLINE, "Do you want me to proceed with the cancellation?", 2, 10) == "Yes."
    assert scripted_reply(AIRLINE, "Shall I cancel reservation EHGLP3? Please confirm (yes/no).", 2, 10) == "Yes."
    assert scripted_reply(AIRLINE, "Anything else I can look up?", 2, 10).startswith("I want to cancel")
    assert scripted_reply(AIRLINE, "Your reservation has been cancelled.", 2, 10) == "###STOP###"
    assert scripted_reply(AIRLINE, "Can I have your user id?", 10, 10) == "###STOP###"  # turn limit


def test_scripted_user_is_deterministic_and_batched():
    user = ScriptedUser(max_turns=3)
    states = [user.start(AIRLINE, seed=1), user.start(RETAIL, seed=2)]
    first = user.respond(states, ["Hi! How can I help you today?"] * 2)
    assert first == [opening_message(AIRLINE), opening_message(RETAIL)]
    second = user.respond(states, ["Your user id please?", "What's your zip?"])
    assert second == ["My user id is emma_kim_9957.", "My name is Fatima Johnson. My zip code is 78712."]
    assert [m.role for m in states[0].history] == ["user", "assistant", "user", "assistant"]
    assert states[0].turns == 2
    again = ScriptedUser(max_turns=3)
    s2 = [again.start(AIRLINE, seed=1)]
    assert again.respond(s2, ["Hi! How can I help you today?"]) == first[:1]


class EchoUserModel(ChatClient):
    """Test double at the model boundary: records requests, replies from a fixed list."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.requests: list[ChatRequest] = []

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        self.requests.extend(requests)
        out = []
        for _ in requests:
            text = self.replies.pop(0)
            out.append(ChatResponse(message=Message(role="assistant", content=text), text=text))
        return out


def test_llm_user_uses_tau2_prompt_flipped_roles_and_stop_tokens():
    from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines

    model = EchoUserModel(["Hi, I want to cancel EHGLP3.", "  ", "Thanks! ###STOP###"])
    user = LLMUser(model, temperature=0.0)
    state = user.start(AIRLINE, seed=7)
    assert user.respond([state], ["Hi! How can I help you today?"]) == ["Hi, I want to cancel EHGLP3."]
    req = model.requests[0]
    assert req.messages[0].content == SYSTEM_PROMPT.format(
        global_user_sim_guidelines=get_global_user_sim_guidelines(use_tools=False), instructions=AIRLINE.instructions
    )
    assert [m.role for m in req.messages] == ["system", "user"] and req.tools is None and req.temperature == 0.0
    assert user.respond([state], ["Your user id?"]) == [""]  # an empty reply: the episode ends as user_error
    reply = user.respond([state], ["Done."])[0]
    assert stop_token(reply) == "###STOP###"
    roles = [m.role for m in model.requests[-1].messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    seeds = [r.seed for r in model.requests]
    assert len(set(seeds)) == 3  # one derived seed per user turn
    assert [stop_token(t) for t in ("###TRANSFER###", "x ###OUT-OF-SCOPE###", "fine")] == ["###TRANSFER###", "###OUT-OF-SCOPE###", None]


def test_llm_user_turn_limit():
    user = LLMUser(EchoUserModel(["a"]), max_turns=1)
    state = user.start(AIRLINE, seed=0)
    assert user.respond([state], ["hello"]) == ["a"]
    assert user.respond([state], ["more?"]) == ["###STOP###"]
