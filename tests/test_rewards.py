"""Controller rewards: the `rule:<name>` and `module:function` forms, the `hfplan.rewards` entry points, the batched
calling convention with the data's other columns, and the one-line errors of each way a function can fail."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import numpy as np
import pytest

from hfplan.dataflow.batch import Batch
from hfplan.dataflow.rewards import (
    Reward,
    RewardFailed,
    check_reward_ref,
    columns_per_row,
    is_rule,
    load_reward,
    per_row,
    rule_names,
    score_rows,
)
from hfplan.dataflow.roles import REWARD
from hfplan.errors import HfplanError
from hfplan.layout import ON_CONTROLLER
from hfplan.spec import workload_from_dict
from tests.support.cli import assert_user_error, invoke
from tests.support.executor_runs import cpu_plan, tiny_workload

USER_MODULE = '''
import json
import math


def first_column(prompts, responses, columns):
    return [float(v) for v in columns["value"]]


def constant(prompts, responses, columns):
    return [0.5] * len(prompts)


def too_few(prompts, responses, columns):
    return [1.0] * (len(prompts) - 1)


def text(prompts, responses, columns):
    return ["high"] * len(prompts)


def not_a_number(prompts, responses, columns):
    return [math.nan if i == 2 else 1.0 for i in range(len(prompts))]


def raises(prompts, responses, columns):
    raise KeyError("answer")


def a_dict(prompts, responses, columns):
    return {p: 1.0 for p in prompts}


def per_row_by_mistake(prompt, response):
    return 1.0


NOT_CALLABLE = 42
'''


@pytest.fixture
def user_site(tmp_path, monkeypatch):
    """A folder on sys.path holding `user_rewards` (the module:function form) and an installed distribution
    declaring `hfplan.rewards` entry points (what pip leaves behind)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "user_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (site / "heavy_rewards.py").write_text("raise RuntimeError('imported at search time')\n")
    info = site / "user_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: user-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hfplan.rewards]\nconstant-half = user_rewards:constant\n"
                                           "broken = user_rewards:missing\nshadow = user_rewards:NOT_CALLABLE\n"
                                           "vowel-fraction = user_rewards:constant\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("user_rewards", "heavy_rewards"):
        sys.modules.pop(name, None)


# -- forms ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("ref", "rule"), [
    ("rule:vowel-fraction", True), ("my_pkg.rewards:score", True), ("pkg:Scorer.score", True), ("tiny", False),
    ("models/llama/config.json", False), ("my-pkg:score", False), ("pkg:", False),
])
def test_which_references_are_controller_rewards(ref, rule):
    assert is_rule(ref) is rule


def test_a_function_reference_is_not_imported_when_the_workload_is_read(user_site):
    workload = tiny_workload("ppo", {"actor": "tiny", "critic": "tiny", "reference": "tiny",
                                     "reward": "heavy_rewards:score"})
    assert workload.model_roles == ("actor", "critic", "reference")  # the reward runs on the controller
    assert "heavy_rewards" not in sys.modules


@pytest.mark.parametrize(("reward", "needle"), [
    ("rule:nope", "unknown reward rule 'nope'; registered rules: arith-close, arith-exact, broken, constant-half"),
    ("my-pkg:score", "models.reward: 'my-pkg:score' is neither rule:<name> nor module:function"),
])
def test_bad_reward_names_are_one_line(user_site, reward, needle):
    with pytest.raises(HfplanError, match=".*") as caught:
        tiny_workload("ppo", {"actor": "tiny", "critic": "tiny", "reference": "tiny", "reward": reward})
    assert needle in str(caught.value)


def test_only_a_reward_or_cost_may_be_a_function():
    with pytest.raises(HfplanError, match="role 'critic' cannot be a rule; only reward can"):
        workload_from_dict({"algorithm": "ppo", "models": {"actor": "tiny", "critic": "pkg:values",
                                                           "reference": "tiny", "reward": "rule:vowel-fraction"}},
                           "test")


def test_rule_names_include_the_installed_entry_points_without_importing_them(user_site):
    assert {"constant-half", "broken", "vowel-fraction", "arith-exact"} <= set(rule_names())
    check_reward_ref("rule:broken")  # the name is declared: the planner asks no more
    assert "user_rewards" not in sys.modules


# -- loading --------------------------------------------------------------------------------------
def test_a_builtin_rule_is_batched_per_row():
    reward = load_reward("rule:vowel-fraction")
    assert reward.fn(["p", "q"], ["aa", "xa"], {}) == [1.0, 0.5]


def test_functions_load_by_entry_point_and_by_import_path(user_site):
    assert load_reward("rule:constant-half").fn(["p"], ["r"], {}) == [0.5]
    assert load_reward("user_rewards:first_column").fn(["p"], ["r"], {"value": [3]}) == [3.0]


@pytest.mark.parametrize(("ref", "needle"), [
    ("missing_package.rewards:score", "reward function missing_package.rewards:score: cannot import module "
                                      "missing_package.rewards (ModuleNotFoundError: No module named "
                                      "'missing_package')"),
    ("user_rewards:nothing", "reward function user_rewards:nothing: module user_rewards has no attribute 'nothing'"),
    ("user_rewards:NOT_CALLABLE", "reward function user_rewards:NOT_CALLABLE: is a int, not a function"),
    ("heavy_rewards:score", "cannot import module heavy_rewards (RuntimeError: imported at search time)"),
    ("rule:broken", "entry point 'broken' of hfplan.rewards: cannot load user_rewards:missing: AttributeError"),
    ("rule:shadow", "reward function rule:shadow: is a int, not a function"),
    ("user_rewards:per_row_by_mistake", "reward function user_rewards:per_row_by_mistake: takes (prompt, response), "
                                        "but is called as fn(prompts, responses, columns)"),
    ("rule:vowel-fraction", "entry point user_rewards:constant of hfplan.rewards has the name of a built-in rule"),
])
def test_a_reward_that_cannot_load_is_one_line(user_site, ref, needle):
    with pytest.raises(HfplanError) as caught:
        load_reward(ref)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


# -- calling --------------------------------------------------------------------------------------
def test_columns_repeat_for_each_sample_of_a_prompt():
    assert columns_per_row({"answer": [7, 3]}, 6) == {"answer": [7, 7, 7, 3, 3, 3]}
    assert columns_per_row({"answer": [7, 3]}, 2) == {"answer": [7, 3]}  # a greedy response per prompt
    assert columns_per_row({}, 5) == {}
    with pytest.raises(ValueError, match="5 sequences are not samples of 2 prompts"):
        columns_per_row({"answer": [7, 3]}, 5)


PROMPTS, RESPONSES = ["add 1 2 =", "sub 5 1 =", "add 0 0 ="], ["3", "4", "1"]


def test_scores_are_float32_one_per_row(user_site):
    out = score_rows(load_reward("user_rewards:first_column"), PROMPTS, RESPONSES, {"value": [1, 2.5, -1]})
    assert out.dtype == np.float32 and out.tolist() == [1.0, 2.5, -1.0]


@pytest.mark.parametrize(("ref", "needle"), [
    ("user_rewards:too_few", "reward user_rewards:too_few returned 2 values for 3 rows"),
    ("user_rewards:text", "reward user_rewards:text returned 'high' (str, not a number) for row 0 of 3 (prompt "
                          "'add 1 2 =', response '3')"),
    ("user_rewards:not_a_number", "reward user_rewards:not_a_number returned nan for row 2 of 3 (prompt "
                                  "'add 0 0 =', response '1')"),
    ("user_rewards:raises", "reward user_rewards:raises raised on a batch of 3 rows: KeyError: 'answer'"),
    ("user_rewards:a_dict", "reward user_rewards:a_dict returned a dict, not a list of numbers"),
])
def test_a_bad_result_is_one_line_naming_the_function_and_row(user_site, ref, needle):
    with pytest.raises(RewardFailed) as caught:
        score_rows(load_reward(ref), PROMPTS, RESPONSES, {})
    assert needle in str(caught.value)


def test_a_per_row_rule_that_raises_names_its_row():
    def picky(prompt: str, response: str) -> float:
        return 1.0 / int(response[0] == "3")

    with pytest.raises(RewardFailed, match=r"reward rule:picky raised on row 1 of 3 \(prompt 'sub 5 1 =', "
                                           r"response '4'\): ZeroDivisionError"):
        score_rows(Reward("rule:picky", per_row(picky)), PROMPTS, RESPONSES, {})


def test_infinity_and_numpy_results():
    def inf(prompts, responses, columns):
        return np.array([1.0, math.inf, 0.0])

    with pytest.raises(RewardFailed, match="returned inf for row 1 of 3"):
        score_rows(Reward("t:inf", inf), PROMPTS, RESPONSES, {})
    assert score_rows(Reward("t:np", lambda p, r, c: np.arange(3)), PROMPTS, RESPONSES, {}).tolist() == [0, 1, 2]


# -- the controller's role ------------------------------------------------------------------------
def test_the_rule_role_scores_decoded_text_with_each_samples_columns(user_site):
    pytest.importorskip("tokenizers")  # the execute extra's
    from hfplan.executor.codec import build_codec
    from hfplan.executor.errors import RunFailed
    from hfplan.executor.roles import Recorder, RuleRole

    codec = build_codec("tiny-arith")
    prompts = codec.encode(["add 1 2 =", "add 1 2 =", "sub 5 1 =", "sub 5 1 ="], 8)
    ids = codec.encode_batch(["3", "4", "4", "9"])  # responses are right-padded: their tokens come first
    responses = np.array([row + [codec.pad_id] * (4 - len(row)) for row in ids])
    mask = np.array([[1.0] * len(row) + [0.0] * (4 - len(row)) for row in ids], dtype=np.float32)
    batch = Batch(prompts=prompts, responses=responses, response_mask=mask)
    recorder = Recorder(clock_offsets={})
    recorder.start_iteration({"value": [10, 20]})
    role = RuleRole("reward", REWARD, load_reward("user_rewards:first_column"), codec.decode_responses, codec.decode,
                    recorder)
    assert role.score(batch)["rewards"].tolist() == [10, 10, 20, 20]
    recorder.start_iteration({"value": [10, 20, 30]})  # 4 sequences are not samples of 3 prompts
    with pytest.raises(RunFailed, match="role reward: 4 sequences are not samples of 3 prompts"):
        role.score(batch)
    recorder.start_iteration()  # the demo sets: no other columns
    bad = RuleRole("reward", REWARD, load_reward("user_rewards:not_a_number"), codec.decode_responses, codec.decode,
                   recorder)
    with pytest.raises(RunFailed, match=r"role reward: reward user_rewards:not_a_number returned nan for row 2 of 4 "
                                        r"\(prompt 'sub 5 1 =', response '4'\)"):
        bad.score(batch)


# -- hfplan execute -------------------------------------------------------------------------------
def test_execute_refuses_a_reward_it_cannot_import_before_anything_starts(tmp_path):
    for extra in ("torch", "ray", "transformers"):  # `hfplan execute` needs the execute extra first
        pytest.importorskip(extra)
    workload = tiny_workload("grpo", {"actor": "tiny-arith", "reference": "tiny-arith",
                                      "reward": "missing_package.rewards:score"})
    plan = tmp_path / "plan.json"
    plan.write_text(cpu_plan(workload, [(("actor", "reference"), 1)]).to_json())
    assert_user_error(invoke("execute", plan, "--out", tmp_path / "run"),
                      "models.reward: reward function missing_package.rewards:score: cannot import module")
    assert not (tmp_path / "run").exists()


def test_the_catalog_lists_installed_rules(user_site):
    result = invoke("catalog")
    assert result.exit_code == 0, result.output
    assert "rule:constant-half" in result.stdout and "rule:arith-close" in result.stdout


def test_search_and_simulate_price_a_function_reward_without_importing_it(user_site, tmp_path):
    workload = tmp_path / "w.yaml"
    workload.write_text(textwrap.dedent("""\
        algorithm: grpo
        models: {actor: tiny-arith, reference: tiny-arith, reward: "heavy_rewards:score"}
        prompt_len: 8
        response_len: 4
        batch_prompts: 4
        samples_per_prompt: 2
        mini_batches: 1
        """))
    best = tmp_path / "best.json"
    found = invoke("search", "--workload", workload, "--hardware", "cpu", "--gpus", 1, "--out", best, "--no-compare")
    assert found.exit_code == 0, found.output
    simulated = invoke("simulate", best, "--json")
    assert simulated.exit_code == 0, simulated.output
    spans = json.loads(simulated.stdout)["timeline"]
    assert {(s["role"], s["set"]) for s in spans if s["op"] == "score"} == {("reward", ON_CONTROLLER)}
    assert "heavy_rewards" not in sys.modules


def test_a_resumed_run_needs_the_same_other_columns():
    from hfplan.executor.resume import run_identity

    plan = cpu_plan(tiny_workload(), [(("actor", "critic", "reference"), 1)])
    plain = run_identity(plan, 0, ["a", "b"])
    assert run_identity(plan, 0, ["a", "b"], {}) == plain  # data without other columns: as before
    answers = run_identity(plan, 0, ["a", "b"], {"answer": [1, 2]})
    assert answers != plain
    assert run_identity(plan, 0, ["a", "b"], {"answer": [1, 3]}).prompts_sha256 != answers.prompts_sha256
