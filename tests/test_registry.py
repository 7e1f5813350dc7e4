"""The algorithm registry: built-ins with their role facts, and what a registered algorithm must be."""

from __future__ import annotations

import pytest

from hfplan.dataflow.registry import ROLLOUT, Algorithm, algorithms, get_algorithm, role_facts
from hfplan.dataflow.roles import ACTOR, CRITIC, REFERENCE, REWARD, RoleFacts
from hfplan.errors import HfplanError
from hfplan.spec import ALGORITHM_ROLES, SCALAR_HEAD_ROLES, TRAINED_ROLES


def _program(roles, prompts, ctl):
    return {}


def test_builtin_algorithms_and_the_spec_views_of_them():
    assert {"ppo", "grpo", "remax", "safe-rlhf"} <= set(algorithms())
    assert ALGORITHM_ROLES["ppo"] == ("actor", "critic", "reference", "reward")
    assert {"actor", "critic", "cost_critic"} == TRAINED_ROLES
    assert {"critic", "reward", "cost", "cost_critic"} == SCALAR_HEAD_ROLES
    assert get_algorithm("grpo").min_samples_per_prompt == 2 and get_algorithm("ppo").generator == "actor"
    assert role_facts("safe-rlhf", "cost").may_be_rule and not role_facts("ppo", "reference").may_be_rule


def test_today_s_output_fields_come_from_the_role_facts():
    outputs = {role: role_facts("safe-rlhf", role).output for role in ALGORITHM_ROLES["safe-rlhf"]}
    assert outputs == {"actor": "old_log_probs", "critic": "values", "reference": "ref_log_probs",
                       "reward": "rewards", "cost": "costs", "cost_critic": "cost_values"}


def test_unknown_algorithm_lists_the_registered_ones():
    with pytest.raises(HfplanError, match="unknown algorithm 'dpo'; registered algorithms: grpo, ppo"):
        get_algorithm("dpo")


@pytest.mark.parametrize(("roles", "needle"), [
    ({"a": ACTOR, "b": ACTOR}, "exactly one role must generate"),
    ({"critic": CRITIC}, "exactly one role must generate"),
    ({"actor": RoleFacts(output="x", generates=True)}, "trained language model"),
    ({"actor": ACTOR, ROLLOUT: REFERENCE}, "reserved"),
    ({"actor": ACTOR, "judge": RoleFacts(output="x", may_be_rule=True)}, "'judge' may be a rule only if"),
])
def test_an_algorithm_must_have_one_trained_generator_and_sane_rules(roles, needle):
    with pytest.raises(ValueError, match=needle):
        Algorithm("bad", _program, roles)


def test_a_well_formed_algorithm_is_accepted():
    algorithm = Algorithm("ok", _program, {"policy": ACTOR, "judge": REWARD})
    assert algorithm.generator == "policy"
