"""The tracer: one node per call of the dataflow program, edges with the bytes each call reads."""

from __future__ import annotations

import pytest

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.controller import STEPS, ControllerStep
from hfplan.dataflow.registry import Algorithm, register_algorithm, unregister_algorithm
from hfplan.dataflow.roles import ACTOR, CRITIC, REFERENCE, REWARD
from hfplan.simulator.trace import field_bytes, trace
from hfplan.spec import ALGORITHM_ROLES, BUILTIN_WORKLOADS, load_workload, workload_from_dict

GRPO_ROLES = {"actor": ACTOR, "reference": REFERENCE, "reward": REWARD}


@pytest.fixture
def registered():
    """Register algorithms for one test only."""
    names = []

    def add(algorithm: Algorithm) -> Algorithm:
        names.append(algorithm.name)
        return register_algorithm(algorithm)

    yield add
    for name in names:
        unregister_algorithm(name)

# Written from hfplan/dataflow/algorithms.py, call by call, in program order.
EXPECTED_LABELS = {
    "ppo": ["actor.generate", "actor.log_prob", "reference.log_prob", "critic.values", "reward.score",
            "controller.gae", "critic.update", "actor.update"],
    "grpo": ["actor.generate", "actor.log_prob", "reference.log_prob", "reward.score", "controller.group_norm",
             "actor.update"],
    "remax": ["actor.generate", "actor.generate(greedy)", "reward.score", "actor.log_prob", "reference.log_prob",
              "reward.score", "controller.greedy_baseline", "actor.update"],
    "safe-rlhf": ["actor.generate", "actor.log_prob", "reference.log_prob", "critic.values", "cost_critic.values",
                  "reward.score", "cost.score", "controller.safe_gae", "critic.update", "cost_critic.update",
                  "actor.update"],
}
PHASE_OF_OP = {"generate": "generation", "log_prob": "preparation", "values": "preparation",
               "score": "preparation", "update": "training"}


def _deps(node) -> dict[int, tuple[float, set[str]]]:
    return {e.src: (e.nbytes, set(e.fields)) for e in node.deps}


def _node(dag, label):
    found = [n for n in dag.nodes if n.label == label]
    assert len(found) == 1, f"{label}: {len(found)} nodes"
    return found[0]


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_LABELS))
def test_labels_per_algorithm(algorithm):
    dag = trace(load_workload(f"{algorithm}-llama2-7b"))
    assert dag.algorithm == algorithm
    assert dag.signature() == EXPECTED_LABELS[algorithm]
    assert [n.id for n in dag.nodes] == list(range(len(dag.nodes)))


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_LABELS))
def test_phases_and_edges_point_backwards(algorithm):
    dag = trace(load_workload(f"{algorithm}-llama2-7b"))
    for node in dag.nodes:
        expected_phase = "preparation" if node.role == "controller" else PHASE_OF_OP[node.op]
        assert node.phase == expected_phase, node.label
        assert all(e.src < node.id for e in node.deps), node.label
        assert [e.src for e in node.deps] == sorted({e.src for e in node.deps}), node.label
        assert all(e.nbytes > 0 for e in node.deps), node.label
    # Only generation reads the iteration's prompts, which no node produced.
    assert [n.label for n in dag.nodes if not n.deps] == [lbl for lbl in EXPECTED_LABELS[algorithm]
                                                          if lbl.startswith("actor.generate")]


def test_ppo_edges_and_bytes_by_hand():
    w = load_workload("ppo-llama2-7b")
    assert (w.batch_prompts, w.prompt_len, w.response_len) == (1024, 1024, 1024)
    dag = trace(w)
    n = 1024
    seq_bytes = n * 1024 * 8 + n * 1024 * 8 + n * 1024 * 4  # prompts, responses (int64), response_mask (fp32)
    per_token = n * 1024 * 4
    per_seq = n * 4
    # critic.update reads the sequences (from generate), values (critic.values), returns (controller.gae).
    assert _deps(_node(dag, "critic.update")) == {
        0: (seq_bytes, {"prompts", "responses", "response_mask"}),
        3: (per_token, {"values"}),
        5: (per_token, {"returns"}),
    }
    # actor.update: sequences, old log-probs (actor.log_prob), advantages (controller.gae).
    assert _deps(_node(dag, "actor.update")) == {
        0: (seq_bytes, {"prompts", "responses", "response_mask"}),
        1: (per_token, {"old_log_probs"}),
        5: (per_token, {"advantages"}),
    }
    # The controller's GAE reads one field from each preparation call, the mask from generation, and a
    # score per sequence from the reward model.
    assert _deps(_node(dag, "controller.gae")) == {
        0: (per_token, {"response_mask"}),
        1: (per_token, {"old_log_probs"}),
        2: (per_token, {"ref_log_probs"}),
        3: (per_token, {"values"}),
        4: (per_seq, {"rewards"}),
    }
    for label in ("actor.log_prob", "reference.log_prob", "critic.values", "reward.score"):
        assert _deps(_node(dag, label)) == {0: (seq_bytes, {"prompts", "responses", "response_mask"})}
    assert _node(dag, "controller.gae").writes == STEPS["gae"].writes
    assert _node(dag, "reward.score").writes == ("rewards",)
    assert all(node.sequences == n for node in dag.nodes)


def test_field_bytes_kinds():
    w = workload_from_dict({"algorithm": "ppo", "models": {r: "tiny" for r in ALGORITHM_ROLES["ppo"]},
                            "prompt_len": 3, "response_len": 5, "batch_prompts": 2, "mini_batches": 1}, "t")
    assert field_bytes("prompts", 2, w) == 2 * 3 * 8
    assert field_bytes("responses", 2, w) == 2 * 5 * 8
    assert field_bytes("rewards", 2, w) == 2 * 4
    assert field_bytes("costs", 7, w) == 7 * 4
    assert field_bytes("baseline_rewards", 2, w) == 2 * 4
    assert field_bytes("advantages", 2, w) == 2 * 5 * 4
    assert field_bytes("response_mask", 2, w) == 2 * 5 * 4


def test_grpo_generates_n_responses_per_prompt():
    w = load_workload("grpo-llama2-7b")
    assert (w.batch_prompts, w.samples_per_prompt) == (256, 4)
    dag = trace(w)
    generate = _node(dag, "actor.generate")
    assert generate.sequences == 256 * 4
    assert all(node.sequences == 1024 for node in dag.nodes)
    # The reward reads 1024 sequences of prompts and responses, and writes 1024 scores.
    score = _node(dag, "reward.score")
    assert _deps(score)[generate.id][0] == 1024 * (w.prompt_len * 8 + w.response_len * 8 + w.response_len * 4)
    assert _deps(_node(dag, "controller.group_norm"))[score.id] == (1024 * 4, {"rewards"})
    assert "critic" not in {n.role for n in dag.nodes}


def test_grpo_reusing_the_policy_log_probs_has_no_actor_forward():
    base = {"algorithm": "grpo", "models": {r: "tiny" for r in ALGORITHM_ROLES["grpo"]}, "prompt_len": 4,
            "response_len": 4, "batch_prompts": 6, "samples_per_prompt": 2, "mini_batches": 1}
    computed = trace(workload_from_dict(base, "t"))
    reused = trace(workload_from_dict(base | {"reuse_policy_log_probs": True}, "t"))
    labels = {f"{n.role}.{n.op}" for n in computed.nodes}
    assert {f"{n.role}.{n.op}" for n in reused.nodes} == labels - {"actor.log_prob"}
    update = _node(reused, "actor.update")
    read = set().union(*(fields for _, fields in _deps(update).values()))
    assert "old_log_probs" not in read and {"ref_log_probs", "advantages"} <= read


def test_grpo_sequences_scale_with_n():
    base = {"algorithm": "grpo", "models": {r: "tiny" for r in ALGORITHM_ROLES["grpo"]}, "prompt_len": 4,
            "response_len": 4, "batch_prompts": 6, "mini_batches": 1}
    for n in (2, 3, 8):
        dag = trace(workload_from_dict(base | {"samples_per_prompt": n}, "t"))
        assert [node.sequences for node in dag.nodes] == [6 * n] * len(dag.nodes)


def test_remax_greedy_generation_is_the_baseline():
    w = load_workload("remax-llama2-7b")
    dag = trace(w)
    sampled, greedy = dag.nodes[0], dag.nodes[1]
    assert (sampled.greedy, greedy.greedy) == (False, True)
    assert greedy.op == "generate" and greedy.sequences == w.batch_prompts
    assert greedy.deps == ()  # both generations read only the iteration's prompts
    baseline_score, score = dag.nodes[2], dag.nodes[5]
    assert baseline_score.label == score.label == "reward.score"
    assert set(_deps(baseline_score)) == {greedy.id}
    assert set(_deps(score)) == {sampled.id}
    step = _node(dag, "controller.greedy_baseline")
    deps = _deps(step)
    # The baseline is the greedy call's score (renamed baseline_rewards in the program; an edge names the
    # fields as their producer wrote them), one fp32 per greedy sequence.
    assert deps[baseline_score.id] == (w.batch_prompts * 4, {"rewards"})
    assert deps[score.id] == (w.sequences * 4, {"rewards"})
    assert not any(e.src == greedy.id for e in _node(dag, "actor.update").deps)


def test_safe_rlhf_cost_side():
    dag = trace(load_workload("safe-rlhf-llama2-7b"))
    step = _node(dag, "controller.safe_gae")
    assert step.writes == ("advantages", "returns", "cost_returns")
    sources = {dag.nodes[e.src].label for e in step.deps}
    assert sources == {"actor.generate", "actor.log_prob", "reference.log_prob", "critic.values",
                       "cost_critic.values", "reward.score", "cost.score"}
    cost_update = _deps(_node(dag, "cost_critic.update"))
    assert {f for _, fields in cost_update.values() for f in fields} == {
        "prompts", "responses", "response_mask", "cost_values", "cost_returns"}
    assert _node(dag, "cost.score").writes == ("costs",)


def test_rule_reward_still_traced_as_a_call():
    w = load_workload("demo")
    assert w.models["reward"].startswith("rule:")
    assert trace(w).signature() == EXPECTED_LABELS["ppo"]


def _tiny(algorithm: str, **fields):
    shape = {"prompt_len": 16, "response_len": 16}
    return workload_from_dict({"algorithm": algorithm, "models": {r: "tiny" for r in GRPO_ROLES}} | shape | fields,
                              "test")


def test_tracer_refuses_untraced_values(registered):
    def bad(roles, prompts, ctl):
        roles["actor"].log_prob(Batch(prompts=[1, 2, 3]))
        return {}

    registered(Algorithm("bad-values", bad, GRPO_ROLES))
    with pytest.raises(TypeError, match="actor.log_prob"):
        trace(_tiny("bad-values"))


@pytest.mark.parametrize(("call", "needle"), [
    (lambda roles, b: roles["reward"].log_prob(b), "log_prob needs a model with a lm head; reward has a scalar"),
    (lambda roles, b: roles["actor"].values(b), "values needs a model with a scalar head"),
    (lambda roles, b: roles["reference"].generate(b), "reference.generate: role 'reference' does not generate"),
    (lambda roles, b: roles["reference"].update(b), "role 'reference' is not trained"),
])
def test_calls_a_role_cannot_offer_are_refused_by_its_facts(registered, call, needle):
    def program(roles, prompts, ctl):
        call(roles, roles["actor"].generate(prompts))
        return {}

    registered(Algorithm("odd-call", program, GRPO_ROLES | {"critic": CRITIC}))
    workload = workload_from_dict({"algorithm": "odd-call", "models": {r: "tiny" for r in (*GRPO_ROLES, "critic")},
                                   "prompt_len": 16, "response_len": 16}, "test")
    with pytest.raises(ValueError) as caught:
        trace(workload)
    assert needle in str(caught.value)


def test_output_fields_follow_the_role_facts_not_the_role_name(registered):
    """A role named `judge` with the reward's facts writes `rewards`; one named `anchor` with the
    reference's facts writes `ref_log_probs`."""

    def program(roles, prompts, ctl):
        batch = roles["policy"].generate(prompts)
        seqs = batch.select("prompts", "responses", "response_mask")
        return batch | roles["judge"].score(seqs) | roles["anchor"].log_prob(seqs)

    registered(Algorithm("renamed", program, {"policy": ACTOR, "anchor": REFERENCE, "judge": REWARD}))
    w = workload_from_dict({"algorithm": "renamed", "models": {"policy": "tiny", "anchor": "tiny",
                                                               "judge": "rule:vowel-fraction"},
                           "prompt_len": 16, "response_len": 16}, "test")
    dag = trace(w)
    assert [(n.label, n.writes) for n in dag.nodes] == [
        ("policy.generate", ("prompts", "responses", "response_mask", "behaviour_log_probs")),
        ("judge.score", ("rewards",)), ("anchor.log_prob", ("ref_log_probs",))]
    assert w.model_roles == ("policy", "anchor")


def test_a_controller_step_receives_only_the_fields_it_reads():
    """PPO hands gae the whole batch; the traced step depends only on its declared reads."""
    dag = trace(load_workload("ppo-llama2-7b"))
    step = _node(dag, "controller.gae")
    assert {f for e in step.deps for f in e.fields} == set(STEPS["gae"].reads)


def test_a_new_algorithm_traces_without_tracer_changes(monkeypatch, registered):
    """A toy algorithm (two generations, a pairwise comparison, a new controller step) registered only for
    this test: the tracer follows whatever the program calls."""

    def toy(roles, prompts, ctl):
        actor, reference, reward = roles["actor"], roles["reference"], roles["reward"]
        first = actor.generate(prompts, n=ctl.samples_per_prompt)
        second = actor.generate(prompts, greedy=True)
        a = reward.score(first.select("prompts", "responses", "response_mask"))
        b = reward.score(second.select("prompts", "responses", "response_mask")).rename(rewards="baseline_rewards")
        kl = reference.log_prob(first.select("prompts", "responses", "response_mask"))
        batch = first | a | kl
        batch = batch | ctl.step("toy_step", batch | b)
        return dict(actor.update(batch.select("prompts", "responses", "toy_advantages")))

    registered(Algorithm("toy", toy, GRPO_ROLES))
    monkeypatch.setitem(STEPS, "toy_step", ControllerStep("toy_step", ("rewards", "baseline_rewards", "ref_log_probs"),
                                                          ("toy_advantages",), lambda b, s: {}))
    w = _tiny("toy", prompt_len=10, response_len=20, batch_prompts=3, samples_per_prompt=2, mini_batches=1)
    dag = trace(w)
    assert dag.algorithm == "toy"
    assert dag.signature() == ["actor.generate", "actor.generate(greedy)", "reward.score", "reward.score",
                               "reference.log_prob", "controller.toy_step", "actor.update"]
    assert [n.sequences for n in dag.nodes] == [6, 3, 6, 3, 6, 6, 6]
    step = dag.nodes[5]
    assert step.writes == ("toy_advantages",)
    # Fields on an edge carry their producer's names (the renamed baseline is the second score's rewards).
    assert _deps(step) == {2: (6 * 4, {"rewards"}), 3: (3 * 4, {"rewards"}), 4: (6 * 20 * 4, {"ref_log_probs"})}
    assert _deps(dag.nodes[6]) == {0: (6 * 10 * 8 + 6 * 20 * 8, {"prompts", "responses"}),
                                   5: (6 * 20 * 4, {"toy_advantages"})}


def test_tracer_module_names_no_algorithm():
    import inspect

    import hfplan.simulator.trace as trace_module

    source = inspect.getsource(trace_module)
    for word in ("ppo", "grpo", "remax", "safe", "critic", "gae"):
        assert word not in source.lower(), word



def test_a_call_made_after_a_rule_the_controller_runs_waits_for_it_with_an_edge_of_no_bytes():
    """ReMax scores the greedy responses before it makes the forwards: with a `rule:` reward the controller runs
    that score itself, in program order, so the forwards it makes next depend on it (no field of it read); a reward
    model's score is a call sent to its workers and holds nothing up."""
    demo = BUILTIN_WORKLOADS["demo"]
    remax = workload_from_dict(dict(demo, algorithm="remax", models={r: demo["models"][r]
                                                                      for r in ("actor", "reference", "reward")}),
                               "demo-remax")
    assert remax.models["reward"].startswith("rule:")
    dag = trace(remax)
    greedy_score = next(n for n in dag.nodes if n.label == "reward.score")
    for label in ("actor.log_prob", "reference.log_prob"):
        edge = next(e for e in _node(dag, label).deps if e.src == greedy_score.id)
        assert edge.nbytes == 0 and edge.fields == ()
    assert not any(e.nbytes == 0 for n in trace(load_workload("remax-llama2-7b")).nodes for e in n.deps)
    # The calls the controller makes after its advantage step already read its fields: nothing is added.
    assert not any(e.nbytes == 0 for n in trace(load_workload("demo")).nodes for e in n.deps)
