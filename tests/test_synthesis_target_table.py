"""synthesis/targets.py's interfaces (issue 38, item 5; the targets' index since issue 51) and the library families that
replaced the ``tau2`` name-prefix tests: the answers are the ones the if-chains and prefix tests gave, recorded by
running that code (commit f798941) before the change, for every interface of the index, an unknown name, and every
capability of the library."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest

from tracekit.synthesis import targets as T
from tracekit.synthesis.library import LIBRARY_NAMES, family_environments, find_library_env, library_env, library_family
from tracekit.target_index import INTERFACES

HAS_TAU2 = importlib.util.find_spec("tau2") is not None

# target -> (sha256 of its tool schemas as sorted JSON, tool names in order, sha256 of its policy, policy length)
OLD_INTERFACES = {
    "tau2_airline": ("bc6dfcae83538086ff834379e4571220f7e42b08f46f064843b31f3cbd3b3ce0",
                     ["book_reservation", "calculate", "cancel_reservation", "get_reservation_details",
                      "get_user_details", "list_all_airports", "search_direct_flight", "search_onestop_flight",
                      "send_certificate", "transfer_to_human_agents", "update_reservation_baggages",
                      "update_reservation_flights", "update_reservation_passengers", "get_flight_status"],
                     "10dc0525421521208be39cee235bba84a16e2bcba9899eb93d92cd81d2f62fc4", 7676),
    "tau2_retail": ("30c077d6b4769931108016957d28512d89bb2eb7bcc14f567509cdaa77fea22c",
                    ["calculate", "cancel_pending_order", "exchange_delivered_order_items", "find_user_id_by_name_zip",
                     "find_user_id_by_email", "get_order_details", "get_product_details", "get_user_details",
                     "list_all_product_types", "modify_pending_order_address", "modify_pending_order_items",
                     "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items",
                     "transfer_to_human_agents"],
                    "2c9652afbce57d6e087768d37cda64d31c53d50b3e3225cfdb791bac66466467", 6699),
    "toolsandbox": ("bfd5e3de60386e9448ae2ce93475d78cd3a93b1b82d176bc684d8bec0880a4e9",
                    ["add_contact", "modify_contact", "remove_contact", "search_contacts",
                     "get_cellular_service_status", "search_messages", "send_message_with_phone_number",
                     "convert_currency", "get_current_location", "get_location_service_status", "get_wifi_status",
                     "search_lat_lon", "search_location_around_lat_lon", "search_stock",
                     "search_weather_around_lat_lon", "add_reminder", "modify_reminder", "remove_reminder",
                     "search_reminder", "get_low_battery_mode_status", "set_cellular_service_status",
                     "set_location_service_status", "set_low_battery_mode_status", "set_wifi_status",
                     "calculate_lat_lon_distance", "datetime_info_to_timestamp", "get_current_timestamp",
                     "search_holiday", "seconds_to_hours_minutes_seconds", "shift_timestamp", "timestamp_diff",
                     "timestamp_to_datetime_info", "unit_conversion"],
                    "6ffd5d370df26974439b8ca75f37411a9b91b3218182c997232cb76acd1b1444", 118),
    "coding": ("7834c35dffdb131f216e4e59e7c8cd2ac90ce02c34447c875827af2406c6be15", ["bash", "submit"],
               "24be5c2a6500f212a871d7685293d8b210039d03d5bbd5bfda2dee156cb0b52b", 296),
    "micro": ("d7dcaed0f988aa595985ac8159ad90074b3f33f89062d73c08b1a2c2b44df5f3", ["find", "read", "write"],
              "59f9f253bba90f17ff631cc9b041e8039ec68903b4a32922935cf84e7ae8a18a", 244),
}
OLD_FAMILY = {"tau2_airline": "tau2", "tau2_retail": "tau2", "toolsandbox": "toolsandbox", "coding": "coding",
              "micro": "micro", "unknown": "unknown"}
TAU2 = ("tau2_structured_data_reasoning", "tau2_tool_calling_precision", "tau2_multi_step_task_completion",
        "tau2_precondition_verification")
# target -> {capability: find_library_env(capability, target).name}, None meaning any target
_TAU2_FOUND = {n.removeprefix("tau2_"): n for n in TAU2}
OLD_FOUND = {
    "tau2_airline": _TAU2_FOUND,
    "tau2_retail": _TAU2_FOUND,
    "toolsandbox": {"datetime_reasoning": "toolsandbox_datetime_reasoning",
                    "permission_error_recovery": "toolsandbox_permission_error_recovery"},
    "coding": {"fault_localization": "coding_fault_localization", "minimal_edit": "coding_minimal_edit",
               "test_before_submit": "coding_test_before_submit"},
    "micro": {c: f"micro_{c}" for c in ("finish_all_writes", "lookup_by_name", "refuse_locked", "report_value",
                                        "write_by_id")},
    "unknown": {},
}
OLD_FOUND[None] = {k: v for t in ("tau2_airline", "toolsandbox", "coding", "micro") for k, v in OLD_FOUND[t].items()}
# target -> pick_example's answer for a capability its family lacks (the family's first environment)
OLD_FIRST = {"tau2_airline": "tau2_structured_data_reasoning", "tau2_retail": "tau2_structured_data_reasoning",
             "toolsandbox": "toolsandbox_permission_error_recovery", "coding": "coding_fault_localization",
             "micro": "micro_lookup_by_name", "unknown": "tau2_structured_data_reasoning"}
OLD_CAPABILITIES = {"tau2": {n.removeprefix("tau2_"): n for n in TAU2},
                    "micro": {c: f"micro_{c}" for c in ("lookup_by_name", "refuse_locked", "finish_all_writes",
                                                        "report_value", "write_by_id")},
                    "coding": {c: f"coding_{c}" for c in ("fault_localization", "minimal_edit", "test_before_submit")},
                    "toolsandbox": {"permission_error_recovery": "toolsandbox_permission_error_recovery",
                                    "datetime_reasoning": "toolsandbox_datetime_reasoning"},
                    "nope": {}}
CAPABILITIES = sorted({c for found in OLD_FOUND.values() for c in found}) + ["no_such"]


def _sha(x) -> str:
    return hashlib.sha256((x if isinstance(x, str) else json.dumps(x, sort_keys=True)).encode()).hexdigest()


def test_the_table_lists_the_targets_in_the_old_order():
    assert T.TARGETS == ("tau2_airline", "tau2_retail", "toolsandbox", "coding", "micro") == tuple(INTERFACES)
    assert tuple(t for t in T.TARGETS if T.target_family(t) == "tau2") == ("tau2_airline", "tau2_retail")


@pytest.mark.parametrize("target", list(OLD_INTERFACES))
def test_every_target_gives_the_old_tools_and_policy(target):
    if target.startswith("tau2") and not HAS_TAU2:
        pytest.skip("the tau2 package is not installed")
    tools_sha, names, policy_sha, policy_len = OLD_INTERFACES[target]
    tools, policy = T.target_tools(target), T.target_policy(target)
    assert (_sha(tools), list(tools), _sha(policy), len(policy)) == (tools_sha, names, policy_sha, policy_len)
    assert T.tool_schemas(target, names[:2]) == [tools[n] for n in names[:2]]


@pytest.mark.parametrize("name", ["nope", "tau2_telecom", ""])
def test_an_unknown_target_raises_the_old_error(name):
    for f in (T.target_tools, T.target_policy):
        with pytest.raises(ValueError) as e:
            f(name)
        assert str(e.value) == f"unknown target {name!r}; known: tau2_airline, tau2_retail, toolsandbox, coding, micro"


def test_families_of_targets_and_library_environments():
    assert {t: T.target_family(t) for t in OLD_FAMILY} == OLD_FAMILY
    assert family_environments("tau2") == TAU2 and family_environments("nope") == ()
    assert [n for f in ("tau2", "toolsandbox", "coding", "micro") for n in family_environments(f)] == list(LIBRARY_NAMES)
    with pytest.raises(KeyError, match="no built-in synthetic environment 'nope'"):
        library_family("nope")


@pytest.mark.skipif(not HAS_TAU2, reason="the tau2 package is not installed")
def test_each_library_entry_declares_its_environments_family():
    for name in LIBRARY_NAMES:
        assert library_family(name) == T.target_family(library_env(name).target), name


@pytest.mark.skipif(not HAS_TAU2, reason="the tau2 package is not installed")
@pytest.mark.parametrize("target", [*OLD_FOUND])
def test_find_library_env_and_pick_example_give_the_old_answers(target):
    from tracekit.synthesis.agent import pick_example

    found = {c: (lambda e: e and e.name)(find_library_env(c, target)) for c in CAPABILITIES}
    assert found == {c: OLD_FOUND[target].get(c) for c in CAPABILITIES}
    if target is not None:
        assert {c: pick_example(c, target) for c in CAPABILITIES} == {
            c: OLD_FOUND[target].get(c) or OLD_FIRST[target] for c in CAPABILITIES}


def test_the_tau2_readers_of_the_family_give_the_old_answers():
    from tracekit.targets.tau2.labels import _library_tau2_envs
    from tracekit.warmstart.planted import library_capabilities

    assert _library_tau2_envs() == TAU2
    assert {f: library_capabilities(f) for f in OLD_CAPABILITIES} == OLD_CAPABILITIES
